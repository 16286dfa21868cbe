#include "wsync/cluster/fanout_plan.hpp"

#include <algorithm>
#include <map>

namespace wsync {
namespace {

result<void> check_members(const std::vector<plan_member>& members, const char* field) {
  std::set<std::int32_t> seen;
  for (const auto& m : members) {
    if (m.node.empty()) {
      return make_error(errc::invalid_argument, std::string("plan: ") + field + ": rank " +
                                                    std::to_string(m.rank) + " has no node");
    }
    if (!seen.insert(m.rank).second) {
      return make_error(errc::invalid_argument, std::string("plan: ") + field + ": rank " +
                                                    std::to_string(m.rank) + " listed twice");
    }
  }
  return {};
}

// Shards come straight from the publishers: over the network unless every publisher shares the
// node.
bool publishers_remote(const plan_request& r, const std::string& node) {
  return std::any_of(r.publishers.begin(), r.publishers.end(),
                     [&](const plan_member& p) { return p.node != node; });
}

std::string node_of(const plan_request& r, std::int32_t rank) {
  for (const auto& c : r.consumers) {
    if (c.rank == rank) return c.node;
  }
  return {};
}

// Depths below `rank` follow its own (after a re-source).
void settle_depths(fanout_plan& plan, std::int32_t rank) {
  std::vector<std::int32_t> todo{rank};
  while (!todo.empty()) {
    auto r = todo.back();
    todo.pop_back();
    for (auto c : plan.children[r]) {
      plan.hops[c].depth = plan.hops[r].depth + 1;
      todo.push_back(c);
    }
  }
}

// The stripes of a tree plan: stripe s lays the leaders out in a rotated order and builds a
// complete d-ary tree over it, position 0 fed by the publishers and position j by position
// (j-1)/d. A tree's relays are its first k = ceil((n-1)/d) positions; rotating stripe s by s*k
// gives each stripe its own block of relays, disjoint whenever d*k <= n (else blocks overlap and
// a leader relays in several stripes, each for fewer children: its uplink still carries about
// twice the update at most).
std::vector<std::map<std::int32_t, std::int32_t>> stripe_trees(
    const std::vector<std::int32_t>& leaders, std::uint32_t degree) {
  const std::size_t n = leaders.size();
  const std::size_t relays = (n - 1 + degree - 1) / degree;
  std::vector<std::map<std::int32_t, std::int32_t>> stripes(degree);
  for (std::size_t s = 0; s < degree; ++s) {
    const std::size_t rotation = s * relays % n;
    auto at = [&](std::size_t position) {
      return leaders[(rotation + position) % n];
    };
    stripes[s][at(0)] = -1;
    for (std::size_t j = 1; j < n; ++j) stripes[s][at(j)] = at((j - 1) / degree);
  }
  return stripes;
}

}  // namespace

result<plan_shape> plan_shape_parse(const std::string& text) {
  if (text == "tree") return plan_shape::tree;
  if (text == "chain") return plan_shape::chain;
  if (text == "star") return plan_shape::star;
  if (text == "naive") return plan_shape::naive;
  return make_error(errc::invalid_argument,
                    "plan: \"" + text + "\" is not one of tree, chain, star, naive");
}

const char* plan_shape_name(plan_shape shape) {
  switch (shape) {
    case plan_shape::tree:
      return "tree";
    case plan_shape::chain:
      return "chain";
    case plan_shape::star:
      return "star";
    case plan_shape::naive:
      return "naive";
  }
  return "?";
}

std::set<std::int32_t> fanout_plan::subtree(std::int32_t rank) const {
  std::set<std::int32_t> out;
  std::vector<std::int32_t> todo{rank};
  while (!todo.empty()) {
    auto r = todo.back();
    todo.pop_back();
    auto it = children.find(r);
    if (it == children.end()) continue;
    for (auto c : it->second) {
      if (out.insert(c).second) todo.push_back(c);
    }
  }
  return out;
}

std::string fanout_plan::received_from(std::int32_t rank) const {
  auto it = hops.find(rank);
  if (it == hops.end()) return "";
  const auto& h = it->second;
  std::string publishers = "publisher:";  // every shard's: a rank fed by them pulls each
  for (std::size_t i = 0; i < request.publishers.size(); ++i) {
    publishers += (i ? "," : "") + std::to_string(request.publishers[i].rank);
  }
  if (h.leader && !stripes.empty()) {
    std::string out = "stripes:";
    for (std::size_t s = 0; s < stripes.size(); ++s) {
      auto from = stripes[s].at(rank);
      out += std::string(s ? " |" : "") + " " +
             (from < 0 ? publishers : "rank:" + std::to_string(from) + " (network)");
    }
    return out;
  }
  if (h.from_publishers) return publishers;
  return "rank:" + std::to_string(h.from) + (h.network ? " (network)" : " (shared memory)");
}

result<fanout_plan> plan_fanout(const plan_request& request) {
  if (request.publishers.empty()) {
    return make_error(errc::invalid_argument, "plan: publishers: none");
  }
  if (auto ok = check_members(request.publishers, "publishers"); !ok) return ok.error();
  if (auto ok = check_members(request.consumers, "consumers"); !ok) return ok.error();
  if (request.shape == plan_shape::tree && request.degree == 0) {
    return make_error(errc::invalid_argument, "plan: degree: must be at least 1 for a tree");
  }
  fanout_plan plan;
  plan.request = request;

  // Ranks by node; the lowest rank of a node leads it.
  std::map<std::string, std::vector<std::int32_t>> by_node;
  for (const auto& c : request.consumers) by_node[c.node].push_back(c.rank);
  for (auto& [node, ranks] : by_node) std::sort(ranks.begin(), ranks.end());

  // Nodes that host a publisher go first: their leaders take the shards there without the
  // network. Then by name, so the same membership always gives the same plan.
  std::set<std::string> publisher_nodes;
  for (const auto& p : request.publishers) publisher_nodes.insert(p.node);
  std::vector<std::string> order;
  for (const auto& [node, ranks] : by_node) {
    if (publisher_nodes.count(node)) order.push_back(node);
  }
  for (const auto& [node, ranks] : by_node) {
    if (!publisher_nodes.count(node)) order.push_back(node);
  }

  if (request.shape == plan_shape::naive) {
    // Every rank straight from the publishers; the lowest rank of a node is still named its
    // leader (it leads nothing).
    for (const auto& node : order) {
      for (auto rank : by_node[node]) {
        plan.hops[rank] = {true, -1, publishers_remote(request, node), 1, rank == by_node[node][0]};
      }
      plan.leader_of[node] = by_node[node].front();
    }
    return plan;
  }
  const std::uint32_t degree = request.shape == plan_shape::chain ? 1 : request.degree;
  std::vector<std::int32_t> leaders;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const auto& node = order[k];
    const auto leader = by_node[node].front();
    plan_hop hop;
    hop.leader = true;
    // The publishers feed the first `degree` leaders (every leader for a star); leader k after
    // those hangs under leader (k - degree) / degree: a complete degree-ary tree, level by level.
    if (request.shape == plan_shape::star || k < degree) {
      hop.from_publishers = true;
      hop.network = publishers_remote(request, node);
      hop.depth = 1;
    } else {
      hop.from = leaders[(k - degree) / degree];
      hop.network = true;
      hop.depth = plan.hops[hop.from].depth + 1;
      plan.children[hop.from].push_back(leader);
    }
    plan.hops[leader] = hop;
    plan.leader_of[node] = leader;
    leaders.push_back(leader);
    for (std::size_t i = 1; i < by_node[node].size(); ++i) {
      auto member = by_node[node][i];
      plan.hops[member] = {false, leader, false, hop.depth + 1, false};
      plan.children[leader].push_back(member);
    }
  }
  if (request.shape == plan_shape::tree && degree >= 2 && leaders.size() >= 2) {
    plan.stripes = stripe_trees(leaders, degree);
  }
  return plan;
}

result<fanout_plan> replan(const fanout_plan& plan, std::int32_t failed) {
  auto it = plan.hops.find(failed);
  if (it == plan.hops.end()) {
    return make_error(errc::invalid_argument,
                      "plan: rank " + std::to_string(failed) + " is not in the plan");
  }
  fanout_plan next = plan;
  const plan_hop gone = it->second;
  const std::string node = node_of(plan.request, failed);
  auto orphans = next.children[failed];
  next.hops.erase(failed);
  next.children.erase(failed);
  auto& consumers = next.request.consumers;
  consumers.erase(std::remove_if(consumers.begin(), consumers.end(),
                                 [&](const plan_member& m) { return m.rank == failed; }),
                  consumers.end());
  if (!gone.from_publishers) {
    auto& siblings = next.children[gone.from];
    siblings.erase(std::remove(siblings.begin(), siblings.end(), failed), siblings.end());
  }
  if (!gone.leader) return next;  // a member: nobody took bytes from it

  // The lowest live rank of the node takes the leader's place: same source, same children.
  std::int32_t heir = -1;
  for (auto r : orphans) {
    if (node_of(next.request, r) == node && !next.hops[r].leader && (heir < 0 || r < heir)) {
      heir = r;
    }
  }
  // Stripes: the heir takes the dead leader's place in every stripe. Without one, one of its
  // stripe children takes that place and the others hang under it, so the stripe keeps one
  // source at the top (the publishers would otherwise send it once per orphaned child): the
  // child relaying least in that stripe (a leaf when there is one), lowest rank on a tie.
  for (auto& stripe : next.stripes) {
    auto source = stripe.at(failed);
    stripe.erase(failed);
    if (heir >= 0) {
      stripe[heir] = source;
      for (auto& [leader, from] : stripe) {
        if (from == failed) from = heir;
      }
      continue;
    }
    std::map<std::int32_t, std::size_t> relays;  // the orphans, with their stripe children
    for (const auto& [leader, from] : stripe) {
      if (from == failed) relays.emplace(leader, 0);
    }
    for (const auto& [leader, from] : stripe) {
      if (auto r = relays.find(from); r != relays.end()) ++r->second;
    }
    if (relays.empty()) continue;
    const auto first = std::min_element(relays.begin(), relays.end(), [](auto& a, auto& b) {
                         return a.second < b.second;
                       })->first;
    for (auto& [leader, from] : stripe) {
      if (from == failed) from = leader == first ? source : first;
    }
  }
  if (next.stripes.size() && next.leader_of.size() - (heir >= 0 ? 0 : 1) < 2) next.stripes.clear();
  if (heir >= 0) {
    plan_hop hop = gone;
    next.hops[heir] = hop;
    next.leader_of[node] = heir;
    if (!gone.from_publishers) next.children[gone.from].push_back(heir);
    for (auto r : orphans) {
      if (r == heir) continue;
      next.hops[r].from = heir;  // members (shared memory) and child leaders (network) alike
      next.children[heir].push_back(r);
    }
    settle_depths(next, heir);
    return next;
  }

  // Nobody is left on the node: its child leaders move up to the failed leader's source.
  next.leader_of.erase(node);
  for (auto r : orphans) {
    auto& hop = next.hops[r];
    if (gone.from_publishers) {
      hop.from_publishers = true;
      hop.from = -1;
      hop.network = publishers_remote(next.request, node_of(next.request, r));
      hop.depth = 1;
    } else {
      hop.from = gone.from;
      hop.depth = next.hops[gone.from].depth + 1;
      next.children[gone.from].push_back(r);
    }
    settle_depths(next, r);
  }
  return next;
}

result<const fanout_plan*> plan_cache::plan_for(const plan_request& request) {
  if (!plan_ || !(plan_->request == request)) {
    auto p = plan_fanout(request);
    if (!p) return p.error();
    plan_ = std::move(*p);
    ++computed_;
  }
  return &*plan_;
}

}  // namespace wsync
