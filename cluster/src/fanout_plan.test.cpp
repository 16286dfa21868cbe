#include "wsync/cluster/fanout_plan.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>

namespace wsync {
namespace {

// A random cluster: 1..24 consumer nodes with 1..6 ranks each, 1..4 publisher ranks on their
// own nodes or on consumer nodes, a random shape and degree.
plan_request random_request() {
  plan_request r;
  const int nodes = *rc::gen::inRange(1, 25);
  std::int32_t rank = 0;
  for (int n = 0; n < nodes; ++n) {
    const int ranks = *rc::gen::inRange(1, 7);
    for (int k = 0; k < ranks; ++k) r.consumers.push_back({rank++, "n" + std::to_string(n)});
  }
  // In any order: the planner must not rely on ranks arriving sorted.
  const auto turn = static_cast<std::size_t>(*rc::gen::inRange(0, static_cast<int>(rank)));
  std::rotate(r.consumers.begin(), r.consumers.begin() + static_cast<std::ptrdiff_t>(turn),
              r.consumers.end());
  if (*rc::gen::arbitrary<bool>()) std::reverse(r.consumers.begin(), r.consumers.end());
  const int publishers = *rc::gen::inRange(1, 5);
  for (int p = 0; p < publishers; ++p) {
    const bool shared = *rc::gen::arbitrary<bool>();
    r.publishers.push_back({p, shared ? "n" + std::to_string(*rc::gen::inRange(0, nodes))
                                      : "trainer" + std::to_string(p % 2)});
  }
  r.shape = *rc::gen::element(plan_shape::tree, plan_shape::chain, plan_shape::star);
  r.degree = static_cast<std::uint32_t>(*rc::gen::inRange(1, 5));
  return r;
}

std::string node_of(const plan_request& r, std::int32_t rank) {
  for (const auto& c : r.consumers) {
    if (c.rank == rank) return c.node;
  }
  return {};
}

// Walks every segment of every shard down the plan: each live consumer must receive each
// shard exactly once, from a source that already had it, and no node may take a shard over the
// network twice.
void check_delivery(const fanout_plan& plan) {
  const auto& req = plan.request;
  RC_ASSERT(plan.hops.size() == req.consumers.size());
  for (const auto& p : req.publishers) {
    std::map<std::int32_t, int> received;
    std::map<std::string, int> network_in;
    // Sources are visited before the ranks they feed: by depth.
    std::vector<std::pair<std::uint32_t, std::int32_t>> by_depth;
    for (const auto& [rank, hop] : plan.hops) by_depth.push_back({hop.depth, rank});
    std::sort(by_depth.begin(), by_depth.end());
    for (const auto& [depth, rank] : by_depth) {
      const auto& hop = plan.hops.at(rank);
      const auto node = node_of(req, rank);
      if (hop.from_publishers) {
        RC_ASSERT(hop.depth == 1u);
        if (p.node != node) ++network_in[node];
      } else {
        RC_ASSERT(plan.hops.count(hop.from) == 1u);  // a live source
        RC_ASSERT(received[hop.from] == 1);          // that already has the shard
        RC_ASSERT(plan.hops.at(hop.from).depth + 1 == depth);
        const bool remote = node_of(req, hop.from) != node;
        RC_ASSERT(remote == hop.network);
        if (remote) ++network_in[node];
      }
      ++received[rank];
    }
    for (const auto& c : req.consumers) RC_ASSERT(received[c.rank] == 1);
    for (const auto& [node, n] : network_in) RC_ASSERT(n <= 1);
  }
}

// `children` is `hops` seen from the sources: each rank fed by a relay is listed exactly once,
// under that relay, and nobody else is listed (a rank listed twice would be sent it twice).
void check_children(const fanout_plan& plan) {
  std::map<std::int32_t, int> listed;
  for (const auto& [relay, kids] : plan.children) {
    for (auto kid : kids) {
      ++listed[kid];
      RC_ASSERT(plan.hops.count(kid) == 1u);
      const auto& hop = plan.hops.at(kid);
      RC_ASSERT(!hop.from_publishers);
      RC_ASSERT(hop.from == relay);
    }
  }
  for (const auto& [rank, hop] : plan.hops) {
    RC_ASSERT(listed[rank] == (hop.from_publishers ? 0 : 1));
  }
}

// One leader per node; every other rank imports from it over shared memory.
void check_leaders(const fanout_plan& plan) {
  for (const auto& c : plan.request.consumers) {
    const auto& hop = plan.hops.at(c.rank);
    const auto leader = plan.leader_of.at(c.node);
    RC_ASSERT(hop.leader == (c.rank == leader));
    if (!hop.leader) {
      RC_ASSERT(hop.from == leader);
      RC_ASSERT(!hop.network);
    }
  }
}

// Every stripe is a tree over exactly the live leaders, rooted at the publishers: following a
// leader's sources reaches the publishers without a cycle, so each leader gets every stripe,
// hence every chunk, exactly once and over the network once.
void check_stripes(const fanout_plan& plan) {
  if (plan.stripes.empty()) return;
  RC_ASSERT(plan.request.shape == plan_shape::tree);
  RC_ASSERT(plan.stripes.size() == plan.request.degree);
  std::set<std::int32_t> leaders;
  for (const auto& [node, rank] : plan.leader_of) leaders.insert(rank);
  for (const auto& stripe : plan.stripes) {
    std::set<std::int32_t> keys;
    for (const auto& [leader, from] : stripe) keys.insert(leader);
    RC_ASSERT(keys == leaders);
    for (const auto& [leader, from] : stripe) {
      auto at = leader;
      for (std::size_t steps = 0; at >= 0; ++steps) {
        RC_ASSERT(steps <= stripe.size());
        RC_ASSERT(stripe.count(at) == 1u);
        at = stripe.at(at);
      }
    }
  }
}

// What striping is for: the publishers send each stripe once, no stripe is deeper than a
// d-ary tree, and each leader relays at most d stripe-children in all, i.e. its uplink carries
// the update about once (each stripe is 1/d of it) — at most twice where the leaders are too
// few for every stripe to have relays of its own (d * ceil((n-1)/d) > n).
void check_stripe_load(const fanout_plan& plan) {
  const auto d = plan.request.degree;
  std::map<std::int32_t, std::uint32_t> children;
  const double nodes = static_cast<double>(plan.leader_of.size());
  const auto bound =
      static_cast<std::uint32_t>(std::ceil(std::log(nodes) / std::log(d) - 1e-9)) + 1;
  for (const auto& stripe : plan.stripes) {
    int roots = 0;
    for (const auto& [leader, from] : stripe) {
      if (from < 0) ++roots;
      if (from >= 0) ++children[from];
      std::uint32_t depth = 1;
      for (auto at = from; at >= 0; at = stripe.at(at)) ++depth;
      RC_ASSERT(depth <= bound);
    }
    RC_ASSERT(roots == 1);
  }
  const auto relays = (plan.leader_of.size() - 1 + d - 1) / d;
  const auto most = d * relays <= plan.leader_of.size() ? d : 2 * d;
  for (const auto& [leader, n] : children) RC_ASSERT(n <= most);
}

RC_GTEST_PROP(fanout_plan, every_consumer_gets_every_segment_exactly_once, ()) {
  auto req = random_request();
  auto plan = plan_fanout(req);
  RC_ASSERT(bool(plan));
  check_delivery(*plan);
  check_children(*plan);
  check_leaders(*plan);
  check_stripes(*plan);
  check_stripe_load(*plan);
  const bool striped =
      req.shape == plan_shape::tree && req.degree >= 2 && plan->leader_of.size() >= 2;
  RC_ASSERT(striped == !plan->stripes.empty());
}

RC_GTEST_PROP(fanout_plan, depth_is_logarithmic_in_the_nodes, ()) {
  auto req = random_request();
  req.shape = plan_shape::tree;
  req.degree = static_cast<std::uint32_t>(*rc::gen::inRange(2, 5));
  auto plan = plan_fanout(req);
  RC_ASSERT(bool(plan));
  const double nodes = static_cast<double>(plan->leader_of.size());
  const auto bound =
      static_cast<std::uint32_t>(std::ceil(std::log(nodes) / std::log(req.degree) - 1e-9)) + 1;
  for (const auto& [rank, hop] : plan->hops) RC_ASSERT(hop.depth <= std::max(bound, 2u));
}

RC_GTEST_PROP(fanout_plan, a_dead_leader_only_re_sources_its_subtree, ()) {
  auto req = random_request();
  auto plan = plan_fanout(req);
  RC_ASSERT(bool(plan));
  std::vector<std::int32_t> leaders;
  for (const auto& [node, rank] : plan->leader_of) leaders.push_back(rank);
  const auto failed = *rc::gen::elementOf(leaders);
  const auto affected = plan->subtree(failed);
  auto next = replan(*plan, failed);
  RC_ASSERT(bool(next));
  RC_ASSERT(next->hops.count(failed) == 0u);
  for (const auto& [rank, hop] : plan->hops) {
    if (rank == failed || affected.count(rank)) continue;
    RC_ASSERT(next->hops.at(rank) == hop);  // nobody else restarts
  }
  check_delivery(*next);
  check_children(*next);
  check_leaders(*next);
  check_stripes(*next);
  for (const auto& stripe : next->stripes) {  // still fed from the top once
    RC_ASSERT(std::count_if(stripe.begin(), stripe.end(),
                            [](const auto& e) { return e.second < 0; }) == 1);
  }
}

TEST(fanout_plan, shapes_of_a_small_cluster) {
  plan_request r;
  r.publishers = {{0, "trainer"}};
  for (int n = 0; n < 4; ++n) {
    for (int k = 0; k < 4; ++k) r.consumers.push_back({n * 4 + k, "n" + std::to_string(n)});
  }
  auto star = plan_fanout([&] {
    auto s = r;
    s.shape = plan_shape::star;
    return s;
  }());
  ASSERT_TRUE(star);
  for (int n = 0; n < 4; ++n) EXPECT_TRUE(star->hops.at(n * 4).from_publishers);
  auto chain = plan_fanout([&] {
    auto s = r;
    s.shape = plan_shape::chain;
    return s;
  }());
  ASSERT_TRUE(chain);
  EXPECT_EQ(chain->hops.at(12).from, 8);
  EXPECT_EQ(chain->hops.at(12).depth, 4u);
  EXPECT_EQ(chain->received_from(12), "rank:8 (network)");
  EXPECT_EQ(chain->received_from(13), "rank:12 (shared memory)");
  EXPECT_EQ(chain->received_from(0), "publisher:0");
  auto naive = plan_fanout([&] {
    auto s = r;
    s.shape = plan_shape::naive;
    return s;
  }());
  ASSERT_TRUE(naive);
  for (int rank = 0; rank < 16; ++rank) {  // nobody relays: 16 copies leave the trainer's node
    EXPECT_TRUE(naive->hops.at(rank).from_publishers) << rank;
    EXPECT_TRUE(naive->hops.at(rank).network) << rank;
    EXPECT_EQ(naive->received_from(rank), "publisher:0") << rank;
  }
  EXPECT_TRUE(naive->children.empty());
  EXPECT_TRUE(naive->stripes.empty());
  auto tree = plan_fanout(r);  // degree 2: n0, n1 under the publisher; n2, n3 under n0
  ASSERT_TRUE(tree);
  EXPECT_EQ(tree->hops.at(8).from, 0);
  EXPECT_EQ(tree->hops.at(12).from, 0);
  // n0's leader dies: rank 1 takes over, n2 and n3 now relay from it.
  auto next = replan(*tree, 0);
  ASSERT_TRUE(next);
  EXPECT_TRUE(next->hops.at(1).leader);
  EXPECT_TRUE(next->hops.at(1).from_publishers);
  EXPECT_EQ(next->hops.at(8).from, 1);
  EXPECT_EQ(next->hops.at(2).from, 1);
  EXPECT_EQ(next->hops.at(4), tree->hops.at(4));  // n1 untouched

  // The tree is striped: stripe 0 relays through n0 and n1, stripe 1 through n2 and n3.
  ASSERT_EQ(tree->stripes.size(), 2u);
  EXPECT_EQ(tree->stripes[0],
            (std::map<std::int32_t, std::int32_t>{{0, -1}, {4, 0}, {8, 0}, {12, 4}}));
  EXPECT_EQ(tree->stripes[1],
            (std::map<std::int32_t, std::int32_t>{{8, -1}, {12, 8}, {0, 8}, {4, 12}}));
  EXPECT_EQ(tree->received_from(12), "stripes: rank:4 (network) | rank:8 (network)");
  EXPECT_EQ(tree->received_from(13), "rank:12 (shared memory)");
  // A stripe root pulls every shard: with two publishers it names both.
  auto two = r;
  two.publishers = {{0, "trainer"}, {1, "trainer"}};
  auto sharded = plan_fanout(two);
  ASSERT_TRUE(sharded);
  EXPECT_EQ(sharded->received_from(0), "stripes: publisher:0,1 | rank:8 (network)");
  // Rank 1 inherits rank 0's places in both stripes.
  EXPECT_EQ(next->stripes[0].at(1), -1);
  EXPECT_EQ(next->stripes[0].at(4), 1);
  EXPECT_EQ(next->stripes[1].at(1), 8);
  EXPECT_TRUE(chain->stripes.empty());
  EXPECT_TRUE(star->stripes.empty());
}

TEST(fanout_plan, bad_requests_name_the_field) {
  plan_request r;
  r.consumers = {{0, "n0"}};
  EXPECT_EQ(plan_fanout(r).error().message, "plan: publishers: none");
  r.publishers = {{0, "t"}};
  r.consumers.push_back({0, "n1"});
  EXPECT_EQ(plan_fanout(r).error().message, "plan: consumers: rank 0 listed twice");
  r.consumers = {{0, ""}};
  EXPECT_EQ(plan_fanout(r).error().message, "plan: consumers: rank 0 has no node");
  r.consumers = {{0, "n0"}};
  r.degree = 0;
  EXPECT_NE(plan_fanout(r).error().message.find("degree"), std::string::npos);
  EXPECT_FALSE(plan_shape_parse("ring"));
  EXPECT_FALSE(replan(*plan_fanout([&] {
    auto s = r;
    s.degree = 2;
    return s;
  }()),
                      7));
}

TEST(fanout_plan, the_plan_is_reused_while_membership_is_unchanged) {
  plan_request r;
  r.publishers = {{0, "t"}};
  r.consumers = {{0, "n0"}, {1, "n1"}};
  plan_cache cache;
  ASSERT_TRUE(cache.plan_for(r));
  ASSERT_TRUE(cache.plan_for(r));
  EXPECT_EQ(cache.computed(), 1u);
  r.consumers.push_back({2, "n2"});
  ASSERT_TRUE(cache.plan_for(r));
  EXPECT_EQ(cache.computed(), 2u);
}

}  // namespace
}  // namespace wsync
