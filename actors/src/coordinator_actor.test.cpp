// The coordinator actor in one process, driven by scoped actors standing in for ranks. Every
// step is a request answered in mailbox order, so nothing here sleeps or races: a message sent
// before a request is handled before it.

#include "coordinator_actor.hpp"

#include <gtest/gtest.h>

#include <tuple>

#include <nlohmann/json.hpp>

#include "guard.hpp"
#include "wsync/manifest/codec.hpp"

namespace wsync {
namespace {

using namespace proto;
using namespace std::chrono_literals;
using json = nlohmann::json;

const std::string token = "right-token";

struct test_config : caf::actor_system_config {
  test_config() {
    add_message_types<caf::id_block::wsync>();
    set("logger.console", caf::atom("none"));
  }
};

weight_update_manifest shard(std::uint64_t version) {
  weight_update_manifest m;
  m.update_id = "u-test-" + std::to_string(version);
  m.model_id = "m";
  m.weight_version = version;
  m.source_worker = "host:1";
  m.source_rank = 0;
  m.transport = "shared-memory";
  m.transport_handle = "h";
  m.tensors = {{"w", dtype::f32, {4}, {}, 16, "cpu", 0, 0, 1}};
  m.segments = {{16}};
  m.total_bytes = 16;
  return m;
}

class coordinator_actor_test : public ::testing::Test {
 protected:
  void SetUp() override {
#if defined(__SANITIZE_THREAD__)
    // Debian's libcaf is not built with TSan: its scheduler's handover of a new actor is
    // invisible to it and reported as a race (the cluster suites are skipped for the same reason).
    GTEST_SKIP() << "CAF actors under tsan: libcaf is not instrumented";
#endif
    system_ = std::make_unique<caf::actor_system>(cfg_);
    coordinator_ = coordinator_spawn(*system_, token, book_config{});
  }
  void TearDown() override {
    if (system_) stop_guarded(coordinator_, caf::exit_reason::kill);
  }

  test_config cfg_;
  std::unique_ptr<caf::actor_system> system_;
  coordinator_actor coordinator_;
  caf::actor_system& sys() {
    return *system_;
  }

  // (reply token, refusal) of a join by `self`.
  std::pair<std::string, std::string> join(caf::scoped_actor& self, rank_hello hello) {
    std::pair<std::string, std::string> out{"unset", "no answer"};
    self->request(coordinator_, 5s, join_atom::value, std::move(hello))
        .receive(
            [&](const std::string& t, const std::string& r) {
              out = {t, r};
            },
            [&](caf::error& e) { out.second = sys().render(e); });
    return out;
  }

  json status() {
    caf::scoped_actor self{sys()};
    json out;
    self->request(coordinator_, 5s, status_atom::value, token)
        .receive([&](const std::string& s) { out = json::parse(s); },
                 [&](caf::error& e) { ADD_FAILURE() << sys().render(e); });
    return out;
  }

  // Publisher rank 0 of model m, the only publisher rank of its versions.
  void join_publisher(caf::scoped_actor& self) {
    auto hello = hello_make(token, 0, "publisher", "n0", "m");
    hello.publisher_ranks = 1;
    ASSERT_EQ(join(self, hello), std::make_pair(token, std::string()));
  }

  static rank_hello consumer_hello(std::int32_t rank, std::string with = token) {
    return hello_make(std::move(with), rank, "consumer", "n0", "m");
  }

  // A consumer on `node` whose endpoint serves its node's ranks on `port`.
  static rank_hello node_hello(std::int32_t rank, std::string node, std::uint16_t port) {
    auto h = hello_make(token, rank, "consumer", std::move(node), "m");
    h.node_port = port;
    return h;
  }

  // The next lead message `who` gets: the leader's port and the leadership's epoch.
  static std::pair<std::uint16_t, std::uint64_t> lead_of(caf::scoped_actor& who) {
    std::pair<std::uint16_t, std::uint64_t> out{9, 0};
    who->receive(
        [&](lead_atom, const std::string& t, std::uint16_t port, std::uint64_t epoch) {
          EXPECT_EQ(t, token);
          out = {port, epoch};
        },
        caf::after(5s) >> [] { ADD_FAILURE() << "no lead message"; });
    return out;
  }

  // The next update `who` is sent.
  static update_available update_at(caf::scoped_actor& who) {
    update_available u;
    who->receive([&](update_atom, const update_available& got) { u = got; },
                 caf::after(5s) >> [] { ADD_FAILURE() << "no update"; });
    return u;
  }
};

TEST_F(coordinator_actor_test, a_join_with_a_wrong_token_gets_no_token_back) {
  caf::scoped_actor self{sys()};
  auto [t, refusal] = join(self, consumer_hello(3, "guess"));
  EXPECT_EQ(t, "");
  EXPECT_EQ(refusal, "join refused: token: wrong cluster token");
  EXPECT_TRUE(status()["ranks"].empty());
}

TEST(token_matches, only_the_same_bytes_match_whatever_their_length) {
  EXPECT_TRUE(token_matches(token, token));
  EXPECT_FALSE(token_matches("right-tokeN", token));  // same length, last byte differs
  EXPECT_FALSE(token_matches("wrong-token", token));  // same length, first byte differs
  EXPECT_FALSE(token_matches("right-toke", token));   // a prefix
  EXPECT_FALSE(token_matches(token + "x", token));
  EXPECT_FALSE(token_matches("", token));
  EXPECT_TRUE(token_matches("", ""));
}

TEST_F(coordinator_actor_test, a_refused_join_changes_nothing) {
  caf::scoped_actor endpoint{sys()};
  auto hello = hello_make(token, 0, "publisher", "n0", "m");
  hello.publisher_ranks = 1;
  ASSERT_EQ(join(endpoint, hello), std::make_pair(token, std::string()));
  // The same endpoint now claims consumer rank 0 and a bad one: both refused, neither registered,
  // and its publisher rank stays joined (it can still publish).
  EXPECT_EQ(join(endpoint, consumer_hello(0)),
            std::make_pair(token, std::string("join refused: role: this endpoint already joined "
                                              "ranks as publisher")));
  caf::scoped_actor consumer{sys()};
  auto bad = consumer_hello(-2);
  EXPECT_EQ(join(consumer, bad).second, "join refused: rank: negative (-2)");
  auto ranks = status()["ranks"];
  ASSERT_EQ(ranks.size(), 1u) << ranks.dump();
  EXPECT_EQ(ranks[0]["role"], "publisher");
  // Every row has every key (scripts index them), null where it does not apply.
  for (const char* key : {"reason", "via", "active_weight_version", "received_from"}) {
    EXPECT_TRUE(ranks[0].contains(key) && ranks[0][key].is_null()) << key;
  }
  EXPECT_EQ(ranks[0]["rank"], 0);
  std::string outcome_token = "unset";
  endpoint->request(coordinator_, 5s, publish_atom::value, token, manifest_to_json(shard(1)))
      .receive([&](const std::string& t, const std::string&) { outcome_token = t; },
               [&](caf::error& e) { ADD_FAILURE() << sys().render(e); });
  EXPECT_EQ(outcome_token, token) << "the publisher rank was dropped by the refused join";
}

TEST_F(coordinator_actor_test, a_collective_publisher_learns_the_live_consumers_of_its_model) {
  auto members = [&](const std::string& with, const std::string& model,
                     const std::string& transport) {
    caf::scoped_actor self{sys()};
    std::string out = "no answer";
    self->request(coordinator_, 5s, members_atom::value, with, model, transport)
        .receive([&](const std::string& s) { out = s; },
                 [&](caf::error& e) { out = sys().render(e); });
    return out;
  };
  caf::scoped_actor r1{sys()}, r2{sys()}, r3{sys()};
  ASSERT_EQ(join(r1, hello_make(token, 1, "consumer", "n0", "m", "nccl")).second, "");
  ASSERT_EQ(join(r2, hello_make(token, 2, "consumer", "n1", "m", "nccl")).second, "");
  ASSERT_EQ(join(r3, consumer_hello(3)).second, "");  // shared memory
  EXPECT_EQ(members(token, "m", "nccl"), "[1,2]");
  EXPECT_EQ(members(token, "m", "shared-memory"), "[3]");
  EXPECT_EQ(members(token, "other", "nccl"), "[]");
  EXPECT_EQ(members("guess", "m", "nccl"), R"({"error":"members refused: token"})");
}

TEST_F(coordinator_actor_test, exits_and_errors_from_outside_do_not_stop_it) {
  caf::anon_send_exit(coordinator_, caf::exit_reason::kill);
  caf::anon_send_exit(coordinator_, caf::exit_reason::user_shutdown);
  caf::anon_send(caf::actor_cast<caf::actor>(coordinator_),
                 caf::make_error(caf::sec::runtime_error));
  EXPECT_EQ(status().value("status", ""), "fail");  // still answering: nothing committed yet
}

TEST_F(coordinator_actor_test, a_forged_down_message_does_not_evict_a_running_rank) {
  caf::scoped_actor rank3{sys()};
  ASSERT_EQ(join(rank3, consumer_hello(3)), std::make_pair(token, std::string()));
  caf::anon_send(caf::actor_cast<caf::actor>(coordinator_),
                 caf::down_msg{rank3->address(), caf::exit_reason::kill});
  auto ranks = status()["ranks"];
  ASSERT_EQ(ranks.size(), 1u);
  EXPECT_EQ(ranks[0]["rank"], 3);
}

TEST_F(coordinator_actor_test,
       only_reports_with_the_token_count_and_the_publisher_hears_the_table) {
  caf::scoped_actor publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  caf::scoped_actor consumer{sys()};
  ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));

  // A plain send: the outcome comes back as an ordinary message once the update ends.
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(1)));
  update_available update;
  consumer->receive([&](update_atom, const update_available& u) { update = u; },
                    caf::after(5s) >> [] { ADD_FAILURE() << "no update reached the consumer"; });
  EXPECT_EQ(update.token, token);
  EXPECT_EQ(update.key, "m@1");
  ASSERT_EQ(update.manifests.size(), 1u);

  // A report without the token is refused: the rank is still pending.
  consumer->send(coordinator_, report_atom::value,
                 rank_report{"guess", "m@1", 3, "acknowledged", "", 1, 0.1, ""});
  EXPECT_EQ(status()["updates"][0]["ranks"][0]["state"], "pending");
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "acknowledged", "", 1, 0.1, ""});
  std::string outcome_token, outcome;
  publisher->receive(
      [&](const std::string& t, const std::string& o) { outcome_token = t, outcome = o; },
      caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
  EXPECT_EQ(outcome_token, token);
  auto table = json::parse(outcome);
  EXPECT_EQ(table["phase"], "committed");
  EXPECT_EQ(table["ranks"][0]["state"], "acknowledged");
}

TEST_F(coordinator_actor_test, a_join_asked_again_by_the_same_endpoint_is_not_a_restart) {
  caf::scoped_actor publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  caf::scoped_actor consumer{sys()};
  ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(1)));
  consumer->receive([](update_atom, const update_available&) {},
                    caf::after(5s) >> [] { ADD_FAILURE() << "no update reached the consumer"; });
  // The consumer's first join timed out on its side and it asked again: the answer is the
  // same, and the update it is importing stays its to answer.
  ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));
  auto rank = status()["updates"][0]["ranks"][0];
  EXPECT_EQ(rank["state"], "pending") << rank.dump();
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "acknowledged", "", 1, 0.1, ""});
  std::string outcome;
  publisher->receive([&](const std::string&, const std::string& o) { outcome = o; },
                     caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
  EXPECT_EQ(json::parse(outcome)["phase"], "committed") << outcome;
}

TEST_F(coordinator_actor_test, each_rank_is_judged_by_its_own_models_committed_version) {
  // Model a at version 5, model b at version 2: both are current, the cluster passes.
  caf::scoped_actor pub_a{sys()}, pub_b{sys()}, con_a{sys()}, con_b{sys()};
  for (auto [self, model] : {std::pair{&pub_a, "a"}, std::pair{&pub_b, "b"}}) {
    // No publisher_ranks: each model's shards come from the publishers joined for it.
    auto hello = hello_make(token, model == std::string("a") ? 0 : 1, "publisher", "n0", model);
    ASSERT_EQ(join(*self, hello), std::make_pair(token, std::string()));
  }
  ASSERT_EQ(join(con_a, hello_make(token, 1, "consumer", "n0", "a")).second, "");
  ASSERT_EQ(join(con_b, hello_make(token, 2, "consumer", "n0", "b")).second, "");
  for (auto [self, consumer, model, version, rank] :
       {std::tuple{&pub_a, &con_a, "a", 5, 1}, std::tuple{&pub_b, &con_b, "b", 2, 2}}) {
    auto m = shard(version);
    m.model_id = model;
    m.update_id = std::string("u-") + model;
    m.source_rank = rank - 1;  // publisher rank 0 publishes a, 1 publishes b
    (*self)->send(coordinator_, publish_atom::value, token, manifest_to_json(m));
    const std::string key = std::string(model) + "@" + std::to_string(version);
    (*consumer)->receive([](update_atom, const update_available&) {},
                         caf::after(5s) >> [] { ADD_FAILURE() << "no update"; });
    (*consumer)->send(coordinator_, report_atom::value,
                      rank_report{token, key, rank, "acknowledged", "",
                                  static_cast<std::uint64_t>(version), 0.01, ""});
    (*self)->receive([](const std::string&, const std::string&) {},
                     caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
  }
  auto s = status();
  EXPECT_EQ(s["status"], "pass") << s.dump();
  EXPECT_EQ(s["committed_version"], 5);
  for (const auto& r : s["ranks"]) {
    if (r["role"] == "consumer") {
      EXPECT_EQ(r["model"], r["rank"] == 1 ? "a" : "b") << r.dump();
    }
  }
}

TEST_F(coordinator_actor_test, an_endpoint_of_many_ranks_gets_one_update_and_answers_in_one_batch) {
  caf::scoped_actor publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  caf::scoped_actor node{sys()}, other{sys()};  // ranks 3 and 4 share an endpoint; 5 is apart
  ASSERT_EQ(join(node, consumer_hello(3)), std::make_pair(token, std::string()));
  ASSERT_EQ(join(node, consumer_hello(4)), std::make_pair(token, std::string()));
  ASSERT_EQ(join(other, consumer_hello(5)), std::make_pair(token, std::string()));

  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(1)));
  update_available update;
  node->receive([&](update_atom, const update_available& u) { update = u; },
                caf::after(5s) >> [] { ADD_FAILURE() << "no update reached the endpoint"; });
  EXPECT_EQ(update.ranks, (std::vector<std::int32_t>{3, 4}));
  bool second = false;
  node->receive([&](update_atom, const update_available&) { second = true; },
                caf::after(100ms) >> [] {});
  EXPECT_FALSE(second) << "the endpoint got the update once per rank";
  other->receive([&](update_atom, const update_available& u) { update = u; },
                 caf::after(5s) >> [] { ADD_FAILURE() << "no update reached rank 5"; });
  EXPECT_EQ(update.ranks, (std::vector<std::int32_t>{5}));

  // The node answers for its ranks, and tries to answer for rank 5 too: refused.
  auto report = [](std::int32_t rank, std::string state) {
    return rank_report{token, "m@1", rank, std::move(state), "", 1, 0.01, ""};
  };
  node->send(
      coordinator_, report_atom::value,
      report_batch{token,
                   {report(3, "importing"), report(4, "importing"), report(3, "acknowledged"),
                    report(5, "acknowledged"), report(4, "rejected")}});
  auto ranks = status()["updates"][0]["ranks"];
  ASSERT_EQ(ranks.size(), 3u);
  EXPECT_EQ(ranks[0]["state"], "acknowledged");
  EXPECT_EQ(ranks[1]["state"], "rejected");  // one rank's failure is still its own
  EXPECT_EQ(ranks[2]["state"], "pending");
  // A batch without the token changes nothing.
  other->send(
      coordinator_, report_atom::value,
      report_batch{"guess", {rank_report{"guess", "m@1", 5, "acknowledged", "", 1, 0, ""}}});
  EXPECT_EQ(status()["updates"][0]["ranks"][2]["state"], "pending");
  other->send(coordinator_, report_atom::value, report_batch{token, {report(5, "acknowledged")}});
  std::string outcome;
  publisher->receive([&](const std::string&, const std::string& o) { outcome = o; },
                     caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
  EXPECT_EQ(json::parse(outcome)["phase"], "committed");
}

TEST_F(coordinator_actor_test, a_node_leader_carries_its_nodes_endpoints_and_hands_over_on_exit) {
  caf::scoped_actor publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  caf::scoped_actor member{sys()}, apart{sys()};
  std::uint64_t epoch = 0;
  {
    caf::scoped_actor leader{sys()};
    ASSERT_EQ(join(leader, node_hello(0, "n0", 4242)), std::make_pair(token, std::string()));
    auto [port, e] = lead_of(leader);
    EXPECT_EQ(port, 0) << "the first endpoint offering a port leads n0";
    epoch = e;
    ASSERT_EQ(join(member, node_hello(1, "n0", 4243)), std::make_pair(token, std::string()));
    EXPECT_EQ(lead_of(member), std::make_pair(std::uint16_t{4242}, epoch));
    ASSERT_EQ(join(apart, node_hello(2, "n1", 0)), std::make_pair(token, std::string()));

    // Only n0's leader, in its epoch, may carry ranks, and only ranks of its node.
    member->send(coordinator_, carry_atom::value, carry_notice{token, epoch, {1}, true});
    leader->send(coordinator_, carry_atom::value, carry_notice{token, epoch + 1, {1}, true});
    leader->send(coordinator_, carry_atom::value, carry_notice{token, epoch, {2}, true});
    auto via = [&](std::int32_t rank) {
      const auto s = status();
      for (const auto& r : s["ranks"]) {
        if (r["role"] == "consumer" && r["rank"] == rank) return r["via"];
      }
      return json("gone");
    };
    EXPECT_TRUE(via(1).is_null());
    EXPECT_TRUE(via(2).is_null());
    leader->send(coordinator_, carry_atom::value, carry_notice{token, epoch, {1}, true});
    EXPECT_EQ(via(1), "rank:0");
    // A publisher rank with the same number is another rank: rank 1 stays carried.
    caf::scoped_actor publisher1{sys()};
    auto p1 = hello_make(token, 1, "publisher", "n0", "m2");
    p1.publisher_ranks = 2;
    ASSERT_EQ(join(publisher1, p1), std::make_pair(token, std::string()));
    EXPECT_EQ(via(1), "rank:0");

    // v1 reaches n0 in one message, for both of its ranks; the leader answers for both.
    publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(1)));
    update_available update;
    leader->receive([&](update_atom, const update_available& u) { update = u; },
                    caf::after(5s) >> [] { ADD_FAILURE() << "no update reached the leader"; });
    EXPECT_EQ(update.ranks, (std::vector<std::int32_t>{0, 1}));
    EXPECT_FALSE(update.resend);
    apart->receive([](update_atom, const update_available&) {},
                   caf::after(5s) >> [] { ADD_FAILURE() << "no update reached n1"; });
    auto ack = [](std::int32_t rank, std::string key) {
      return rank_report{token, std::move(key), rank, "acknowledged", "", 1, 0.01, ""};
    };
    // n1's endpoint leads nothing: it cannot answer for rank 1.
    apart->send(coordinator_, report_atom::value, report_batch{token, {ack(1, "m@1")}});
    EXPECT_EQ(status()["updates"][0]["ranks"][1]["state"], "pending");
    leader->send(coordinator_, report_atom::value,
                 report_batch{token, {ack(0, "m@1"), ack(1, "m@1")}});
    apart->send(coordinator_, report_atom::value, report_batch{token, {ack(2, "m@1")}});
    std::string outcome;
    publisher->receive([&](const std::string&, const std::string& o) { outcome = o; },
                       caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
    EXPECT_EQ(json::parse(outcome)["phase"], "committed");
    auto messages = status()["messages"];
    EXPECT_EQ(messages["updates_sent"], 2) << "one per node";
    EXPECT_EQ(messages["reports"], 4);

    // v2 goes out through the leader, which then goes away before anyone answered.
    publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(2)));
    leader->receive([&](update_atom, const update_available& u) { update = u; },
                    caf::after(5s) >> [] { ADD_FAILURE() << "no v2 at the leader"; });
    EXPECT_EQ(update.key, "m@2");
  }
  // The member leads n0 now, under a new epoch, and gets v2 again itself, marked as a resend.
  auto [port, e2] = lead_of(member);
  EXPECT_EQ(port, 0);
  EXPECT_NE(e2, epoch);
  update_available update;
  member->receive([&](update_atom, const update_available& u) { update = u; },
                  caf::after(5s) >> [] { ADD_FAILURE() << "v2 was not sent again"; });
  EXPECT_EQ(update.key, "m@2");
  EXPECT_EQ(update.ranks, (std::vector<std::int32_t>{1}));
  EXPECT_TRUE(update.resend);
}

// A rank that joined while v1 was distributing gets v1 once it commits (a catch-up), carried by
// its node's leader. The leader dies with it unanswered: the catch-up is sent again, as an
// update in flight would be, not left pending for good (holding the publisher's slot).
TEST_F(coordinator_actor_test, a_catch_up_lost_with_its_node_leader_is_sent_again) {
  caf::scoped_actor publisher{sys()}, member{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  {
    caf::scoped_actor leader{sys()};
    ASSERT_EQ(join(leader, node_hello(0, "n0", 4242)), std::make_pair(token, std::string()));
    const auto epoch = lead_of(leader).second;
    publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(1)));
    EXPECT_EQ(update_at(leader).ranks, (std::vector<std::int32_t>{0}));
    // Rank 1 joins while v1 distributes; the leader carries it.
    ASSERT_EQ(join(member, node_hello(1, "n0", 4243)), std::make_pair(token, std::string()));
    lead_of(member);
    leader->send(coordinator_, carry_atom::value, carry_notice{token, epoch, {1}, true});
    leader->send(
        coordinator_, report_atom::value,
        report_batch{token, {rank_report{token, "m@1", 0, "acknowledged", "", 1, 0.01, ""}}});
    publisher->receive([](const std::string&, const std::string&) {},
                       caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
    auto catch_up = update_at(leader);  // v1 for rank 1, through its carrier
    EXPECT_EQ(catch_up.key, "m@1");
    EXPECT_EQ(catch_up.ranks, (std::vector<std::int32_t>{1}));
  }                 // the leader goes away before rank 1 answered
  lead_of(member);  // rank 1's endpoint leads n0 now
  auto again = update_at(member);
  EXPECT_EQ(again.key, "m@1");
  EXPECT_EQ(again.ranks, (std::vector<std::int32_t>{1}));
  member->send(
      coordinator_, report_atom::value,
      report_batch{token, {rank_report{token, "m@1", 1, "acknowledged", "", 1, 0.01, ""}}});
  bool found = false;
  const auto s = status();  // kept: a range-for over status()["ranks"] would dangle
  for (const auto& r : s["ranks"]) {
    if (r["role"] == "consumer" && r["rank"] == 1) {
      found = true;
      EXPECT_EQ(r["active_weight_version"], 1);
    }
  }
  EXPECT_TRUE(found) << "rank 1 is not in the status: " << s.dump();
  // An answer sent again (lost with a node leader, say) carries the version of its time: the
  // book refuses it, and it never lowers the version the rank serves.
  member->send(
      coordinator_, report_atom::value,
      report_batch{token, {rank_report{token, "m@1", 1, "acknowledged", "", 0, 0.01, ""}}});
  const auto after = status();
  for (const auto& r : after["ranks"]) {
    if (r["role"] == "consumer" && r["rank"] == 1) {
      EXPECT_EQ(r["active_weight_version"], 1);
    }
  }
}

TEST_F(coordinator_actor_test, a_shard_of_another_rank_than_the_joined_one_is_refused_naming_it) {
  caf::scoped_actor publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  auto other = shard(1);
  other.source_rank = 1;
  std::string outcome;
  publisher->request(coordinator_, 5s, publish_atom::value, token, manifest_to_json(other))
      .receive([&](const std::string&, const std::string& o) { outcome = o; },
               [](caf::error&) { ADD_FAILURE() << "no answer"; });
  auto j = json::parse(outcome, nullptr, false);
  EXPECT_EQ(j.value("error", ""),
            "publish refused: source_rank 1 differs from the joined rank 0 (update_id=" +
                other.update_id + " rank=1)")
      << outcome;
}

// A report names its attempt: one of an aborted attempt, replayed late, does not answer for
// the retry of the same key.
TEST_F(coordinator_actor_test, a_late_report_of_an_aborted_attempt_does_not_answer_for_the_retry) {
  caf::scoped_actor publisher{sys()}, consumer{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));
  auto report = [&](std::string state, std::string id) {
    consumer->send(
        coordinator_, report_atom::value,
        rank_report{token, "m@1", 3, std::move(state), "bad shapes", 0, 0.01, "", std::move(id)});
  };
  auto next_outcome = [&] {
    std::string outcome;
    publisher->receive([&](const std::string&, const std::string& o) { outcome = o; },
                       caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
    return outcome.empty() ? json() : json::parse(outcome);
  };
  auto next_update = [&] {
    consumer->receive([](update_atom, const update_available&) {},
                      caf::after(5s) >> [] { ADD_FAILURE() << "no update"; });
  };
  auto first = shard(1);
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(first));
  next_update();
  report("rejected", first.update_id);  // nobody acknowledged: aborted
  EXPECT_EQ(next_outcome()["phase"], "aborted");
  report("released", first.update_id);  // the coordinator releases attempt 1

  auto retry = shard(1);
  retry.update_id = "u-test-1-retry";
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(retry));
  next_update();
  report("released", first.update_id);  // attempt 1's, replayed: refused
  auto updates = status()["updates"];
  ASSERT_FALSE(updates.empty());
  EXPECT_EQ(updates[0]["attempt"], 2) << updates.dump();
  EXPECT_EQ(updates[0]["ranks"][0]["state"], "pending") << updates.dump();
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "acknowledged", "", 1, 0.01, "", retry.update_id});
  auto outcome = next_outcome();
  EXPECT_EQ(outcome["phase"], "committed");
  EXPECT_EQ(outcome["attempt"], 2);
}

// A retry waits while the aborted attempt is held; the rank's request times out and it retries
// again. The newer retry replaces the older, which is refused and given back: taken later, the
// older would commit while the newer, the one its trainer waits for, was refused.
TEST_F(coordinator_actor_test, a_newer_retry_from_the_same_rank_replaces_a_waiting_one) {
  caf::scoped_actor publisher{sys()}, consumer{sys()};
  ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
  ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));
  auto first = shard(1);
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(first));
  consumer->receive([](update_atom, const update_available&) {},
                    caf::after(5s) >> [] { ADD_FAILURE() << "no update"; });
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "rejected", "bad", 0, 0.01, "", first.update_id});
  auto older = shard(1), newer = shard(1);
  older.update_id = "u-test-1-older";
  newer.update_id = "u-test-1-newer";
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(older));
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(newer));
  // Rank 3 lets go of attempt 1: the waiting retry is taken.
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "released", "", 0, 0.01, "", first.update_id});
  std::string update_of;
  consumer->receive(
      [&](update_atom, const update_available& u) {
        auto m = manifest_from_json(u.manifests.at(0));
        update_of = m ? m->update_id : "";
      },
      caf::after(5s) >> [] { ADD_FAILURE() << "no update for the retry"; });
  EXPECT_EQ(update_of, newer.update_id);
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "acknowledged", "", 1, 0.01, "", newer.update_id});
  // The publisher hears: attempt 1 aborted, the older retry refused and given back, attempt 1
  // released, and the newer retry committed.
  std::vector<json> outcomes;
  std::vector<std::vector<std::string>> released;
  for (int i = 0; i < 8 && outcomes.size() < 3; ++i) {
    publisher->receive(
        [&](const std::string&, const std::string& o) { outcomes.push_back(json::parse(o)); },
        [&](release_atom, const std::string&, const std::string&,
            const std::vector<std::string>& ids) { released.push_back(ids); },
        caf::after(5s) >> [] {});
  }
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_EQ(outcomes[0]["phase"], "aborted");
  EXPECT_NE(outcomes[1].value("error", "").find("was replaced by a newer retry"), std::string::npos)
      << outcomes[1].dump();
  EXPECT_EQ(outcomes[2]["phase"], "committed") << outcomes[2].dump();
  EXPECT_NE(std::find(released.begin(), released.end(), std::vector<std::string>{older.update_id}),
            released.end());
}

// A coordinator whose update deadline is `deadline`, in place of the fixture's.
class deadline_test : public coordinator_actor_test {
 protected:
  void SetUp() override {
    coordinator_actor_test::SetUp();
    if (IsSkipped()) return;
    stop_guarded(coordinator_, caf::exit_reason::kill);
    book_config config;
    config.update_deadline = 300ms;
    coordinator_ = coordinator_spawn(sys(), token, config);
  }
  // Publishes attempt 1 of m@1, which consumer rank 3 receives and says it imports.
  void first_attempt(caf::scoped_actor& publisher, caf::scoped_actor& consumer,
                     const weight_update_manifest& first) {
    ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
    ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));
    publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(first));
    (void)update_at(consumer);
    consumer->send(coordinator_, report_atom::value,
                   rank_report{token, "m@1", 3, "importing", "", 0, 0, "", first.update_id});
  }
  // What `publisher` hears until `outcomes` outcomes (JSON) and `releases` released update ids
  // came, or `within` passed.
  static std::pair<std::vector<json>, std::vector<std::string>> heard(
      caf::scoped_actor& publisher, std::size_t outcomes, std::size_t releases,
      std::chrono::milliseconds within = 5000ms) {
    std::pair<std::vector<json>, std::vector<std::string>> out;
    const auto until = std::chrono::steady_clock::now() + within;
    while ((out.first.size() < outcomes || out.second.size() < releases) &&
           std::chrono::steady_clock::now() < until) {
      publisher->receive(
          [&](const std::string&, const std::string& o) { out.first.push_back(json::parse(o)); },
          [&](release_atom, const std::string&, const std::string&,
              const std::vector<std::string>& ids) {
            out.second.insert(out.second.end(), ids.begin(), ids.end());
          },
          caf::after(100ms) >> [] {});
    }
    return out;
  }
};

// Rank 3 stays silent past the deadline (attempt 1 aborted) but may still read it, so the
// trainer's retry waits. It used to wait for good: refused and given back after a deadline.
TEST_F(deadline_test, a_retry_that_waits_past_the_update_deadline_is_refused_and_given_back) {
  caf::scoped_actor publisher{sys()}, consumer{sys()};
  auto first = shard(1), retry = shard(1);
  retry.update_id = "u-test-1-retry";
  ASSERT_NO_FATAL_FAILURE(first_attempt(publisher, consumer, first));
  auto aborted = heard(publisher, 1, 0).first;
  ASSERT_EQ(aborted.size(), 1u);
  EXPECT_EQ(aborted[0]["phase"], "aborted");
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(retry));
  auto [refused, released] = heard(publisher, 1, 1);
  ASSERT_EQ(refused.size(), 1u) << "the retry waited on";
  EXPECT_EQ(refused[0].value("code", ""), "timeout") << refused[0].dump();
  EXPECT_NE(refused[0]
                .value("error", "")
                .find("publish refused: update_id=u-test-1-retry "
                      "(source_rank 0) waited 300 ms, the update "
                      "deadline, for ranks 3 to let go of the aborted "
                      "attempt 1 of m@1"),
            std::string::npos)
      << refused[0].dump();
  EXPECT_EQ(released, std::vector<std::string>{retry.update_id});
  // Rank 3 lets go of attempt 1 at last: the retry is gone, nothing is distributed.
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "released", "", 0, 0.01, "", first.update_id});
  consumer->receive([](update_atom, const update_available&) { ADD_FAILURE() << "retry sent"; },
                    caf::after(500ms) >> [] {});
}

// Rank 3 finishes its import after the deadline aborted attempt 1, installs it and says so. Its
// acknowledgement stands; the retry that waited for it is refused at once (the version is
// served), not distributed with other bytes under the same number.
TEST_F(deadline_test, a_late_acknowledgement_of_an_aborted_version_refuses_its_waiting_retry) {
  caf::scoped_actor publisher{sys()}, consumer{sys()};
  auto first = shard(1), retry = shard(1);
  retry.update_id = "u-test-1-retry";
  ASSERT_NO_FATAL_FAILURE(first_attempt(publisher, consumer, first));
  ASSERT_EQ(heard(publisher, 1, 0).first.size(), 1u);  // aborted
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(retry));
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "acknowledged", "", 1, 0.5, "", first.update_id});
  auto [refused, released] = heard(publisher, 1, 1);
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(released, std::vector<std::string>{retry.update_id});
  EXPECT_EQ(refused[0].value("code", ""), "version_not_monotonic") << refused[0].dump();
  EXPECT_NE(refused[0]
                .value("error", "")
                .find("weight_version 1 was aborted, but rank 3 "
                      "installed it after the abort"),
            std::string::npos)
      << refused[0].dump();
  auto s = status();
  EXPECT_EQ(s["committed_version"], 1) << "a trainer that starts from it publishes 1 for good";
  auto ranks = s["updates"][0]["ranks"];
  ASSERT_EQ(ranks.size(), 1u);
  EXPECT_EQ(ranks[0]["state"], "acknowledged") << ranks.dump();
}

// Updates held from before a coordinator restart ("orphans"): a coordinator with the given
// rejoin grace in place of the fixture's.
class orphan_test : public coordinator_actor_test {
 protected:
  void restart(std::chrono::milliseconds grace) {
    stop_guarded(coordinator_, caf::exit_reason::kill);
    book_config config;
    config.rejoin_grace = grace;
    coordinator_ = coordinator_spawn(sys(), token, config);
  }
  // Publisher `rank` of model m (of two ranks), saying it still holds `held`: (key, update id).
  void join_holding_publisher(caf::scoped_actor& self,
                              std::vector<std::pair<std::string, std::string>> held,
                              std::int32_t rank = 0) {
    auto hello = hello_make(token, rank, "publisher", "n0", "m");
    hello.publisher_ranks = 2;
    for (auto& [key, id] : held) hello.held.push_back(key), hello.held_ids.push_back(id);
    ASSERT_EQ(join(self, hello), std::make_pair(token, std::string()));
  }
  void join_holding_consumer(caf::scoped_actor& self, std::int32_t rank,
                             std::vector<std::string> held) {
    auto hello = consumer_hello(rank);
    hello.held = std::move(held);
    ASSERT_EQ(join(self, hello), std::make_pair(token, std::string()));
  }
  void released(caf::scoped_actor& consumer, std::int32_t rank, const std::string& key) {
    consumer->send(coordinator_, report_atom::value,
                   rank_report{token, key, rank, "released", "", 0, 0.01, ""});
  }
  // The next release `publisher` is told within `within` ("" when none): key and update ids.
  static std::pair<std::string, std::vector<std::string>> release_at(
      caf::scoped_actor& publisher, std::chrono::milliseconds within = 5000ms) {
    std::pair<std::string, std::vector<std::string>> out;
    publisher->receive(
        [&](release_atom, const std::string& t, const std::string& key,
            const std::vector<std::string>& ids) {
          EXPECT_EQ(t, token);
          out = {key, ids};
        },
        caf::after(within) >> [] {});
    return out;
  }
};

// A restarted coordinator knows no manifests: a rank that joined it got nothing until the next
// version, for good once the trainer was done. A consumer that re-joins serving version 5 now
// gives its manifests, and a rank that joins after it catches up on version 5. The publisher's
// memory of it goes back once neither reads it.
TEST_F(orphan_test, a_version_a_rejoining_consumer_serves_is_the_catch_up_source) {
  restart(0ms);
  caf::scoped_actor serving{sys()}, also{sys()}, fresh{sys()}, publisher{sys()};
  const auto v5 = shard(5);
  auto hello = consumer_hello(3);
  hello.active_weight_version = 5;
  hello.held = {"m@5"};
  hello.active_manifests = {manifest_to_json(v5)};
  ASSERT_EQ(join(serving, hello), std::make_pair(token, std::string()));
  hello.rank = 5;  // serves it too, as views
  ASSERT_EQ(join(also, hello), std::make_pair(token, std::string()));
  auto p = hello_make(token, 0, "publisher", "n0", "m");
  p.publisher_ranks = 1;
  p.held = {"m@5"};
  p.held_ids = {v5.update_id};
  ASSERT_EQ(join(publisher, p), std::make_pair(token, std::string()));
  ASSERT_EQ(join(fresh, consumer_hello(4)), std::make_pair(token, std::string()));
  auto u = update_at(fresh);
  EXPECT_EQ(u.key, "m@5");
  ASSERT_EQ(u.manifests.size(), 1u);
  auto m = manifest_from_json(u.manifests[0]);
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->update_id, v5.update_id);
  released(serving, 3, "m@5");  // rank 3 moved on
  EXPECT_EQ(release_at(publisher, 600ms).first, "") << "released while rank 4 reads it";
  fresh->send(coordinator_, report_atom::value,
              rank_report{token, "m@5", 4, "acknowledged", "", 5, 0.01, "", v5.update_id});
  auto s = status();
  ASSERT_EQ(s["updates"].size(), 1u) << s.dump();
  EXPECT_EQ(s["updates"][0]["adopted"], true);
  EXPECT_EQ(s["updates"][0]["ranks"].size(), 3u) << "ranks 3, 4 and 5";
  EXPECT_EQ(s["updates"][0]["phase"], "committed");
  EXPECT_EQ(s["committed_version"], 5);
  fresh->send(coordinator_, report_atom::value,
              rank_report{token, "m@5", 4, "released", "", 5, 0.01, "", v5.update_id});
  EXPECT_EQ(release_at(publisher, 600ms).first, "") << "released while rank 5 reads it";
  released(also, 5, "m@5");
  EXPECT_EQ(release_at(publisher),
            std::make_pair(std::string("m@5"), std::vector<std::string>{v5.update_id}));
}

// Manifests that do not make up the version the rank says it serves are not taken: the join
// stands, and nothing is sent to anyone.
TEST_F(orphan_test, manifests_of_another_version_are_not_taken) {
  restart(0ms);
  caf::scoped_actor serving{sys()}, fresh{sys()};
  auto hello = consumer_hello(3);
  hello.active_weight_version = 5;
  hello.active_manifests = {manifest_to_json(shard(4))};
  ASSERT_EQ(join(serving, hello), std::make_pair(token, std::string()));
  ASSERT_EQ(join(fresh, consumer_hello(4)), std::make_pair(token, std::string()));
  fresh->receive([](update_atom, const update_available&) { ADD_FAILURE() << "sent"; },
                 caf::after(300ms) >> [] {});
  EXPECT_TRUE(status()["updates"].empty());
}

TEST_F(orphan_test, what_no_consumer_holds_goes_back_to_its_publisher_after_the_grace) {
  restart(0ms);
  caf::scoped_actor publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3"}}));
  auto [key, ids] = release_at(publisher);
  EXPECT_EQ(key, "m@3") << "the publisher was never told to give back what nobody holds";
  EXPECT_EQ(ids, std::vector<std::string>{"u-3"});
  // The grace is over: a publisher that joins later is told at once.
  caf::scoped_actor again{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(again, {{"m@4", "u-4"}}, 1));
  EXPECT_EQ(release_at(again).first, "m@4");
}

TEST_F(orphan_test, what_a_consumer_holds_goes_back_when_it_lets_go) {
  restart(0ms);
  caf::scoped_actor consumer{sys()}, publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_consumer(consumer, 3, {"m@3"}));
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3"}}));
  EXPECT_EQ(release_at(publisher, 600ms).first, "") << "released while rank 3 holds it";
  released(consumer, 3, "m@3");
  EXPECT_EQ(release_at(publisher).first, "m@3");
}

// A rank that named the key at its re-join (it was importing it) and then found the bytes gone
// waits for the next version. Waiting alone does not let go of the orphan: the rank may serve
// another attempt of the key, which the orphan's key covers too. The rank says released when it
// holds none, and then the orphan goes back.
TEST_F(orphan_test, a_consumer_waiting_for_the_next_version_lets_go_of_it_by_releasing) {
  restart(0ms);
  caf::scoped_actor consumer{sys()}, publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_consumer(consumer, 3, {"m@3"}));
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3"}}));
  consumer->send(
      coordinator_, report_atom::value,
      rank_report{token, "m@3", 3, "waiting", "waiting for the next version: gone", 0, 0.01, ""});
  EXPECT_EQ(release_at(publisher, 600ms).first, "") << "released on waiting alone";
  released(consumer, 3, "m@3");
  EXPECT_EQ(release_at(publisher).first, "m@3");
}

TEST_F(orphan_test, nothing_goes_back_during_the_grace) {
  restart(std::chrono::hours(1));
  caf::scoped_actor consumer{sys()}, publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_consumer(consumer, 3, {"m@3"}));
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3"}, {"m@4", "u-4"}}));
  // Rank 3 let go, and nobody said it holds m@4; a rank still reconnecting might.
  released(consumer, 3, "m@3");
  EXPECT_EQ(release_at(publisher, 600ms).first, "");
}

TEST_F(orphan_test, only_the_attempts_a_publisher_named_go_back_never_a_retry) {
  restart(0ms);
  caf::scoped_actor rank0{sys()}, rank1{sys()};
  // Rank 0 re-joined holding attempt 1 of version 3 and is told to give back exactly that.
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(rank0, {{"m@3", "u-3-a1"}}));
  EXPECT_EQ(release_at(rank0),
            std::make_pair(std::string("m@3"), std::vector<std::string>{"u-3-a1"}));
  // Rank 1 re-joins holding its attempt 1 too: only rank 1 hears of it (rank 0 may have started
  // attempt 2 of version 3 meanwhile, under the same key).
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(rank1, {{"m@3", "u-3-b1"}}, 1));
  EXPECT_EQ(release_at(rank1),
            std::make_pair(std::string("m@3"), std::vector<std::string>{"u-3-b1"}));
  EXPECT_EQ(release_at(rank0, 600ms).first, "") << "rank 0 was told again";
}

TEST_F(orphan_test, a_consumer_that_rejoins_without_the_key_let_go_of_it) {
  restart(0ms);
  caf::scoped_actor publisher{sys()};
  {
    caf::scoped_actor consumer{sys()};
    ASSERT_NO_FATAL_FAILURE(join_holding_consumer(consumer, 3, {"m@3"}));
    ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3"}}));
    EXPECT_EQ(release_at(publisher, 600ms).first, "");
    // Rank 3's link drops before it reports its release, and the rank restarts (a new endpoint
    // replaces the old one): it names m@3 no more.
    caf::scoped_actor restarted{sys()};
    ASSERT_NO_FATAL_FAILURE(join_holding_consumer(restarted, 3, {}));
    EXPECT_EQ(release_at(publisher).first, "m@3");
  }
}

// After a restart the publisher retries the version (a new attempt the book tracks) while a
// consumer still holds the old one: the consumer's release of the old attempt is not the book's,
// but it is the orphan's, which goes back to the publisher.
TEST_F(orphan_test, a_release_of_the_attempt_before_a_retry_gives_that_attempt_back) {
  restart(0ms);
  caf::scoped_actor consumer{sys()}, publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_consumer(consumer, 3, {"m@3"}));
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3-a1"}}));
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(shard(3)));
  EXPECT_EQ(release_at(publisher, 600ms).first, "") << "released while rank 3 holds it";
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@3", 3, "released", "", 0, 0.01, "", "u-3-a1"});
  EXPECT_EQ(release_at(publisher),
            std::make_pair(std::string("m@3"), std::vector<std::string>{"u-3-a1"}))
      << "the old attempt's release was refused as not the book's";
}

// The same, the other way round: a rank that serves the old attempt refuses the retry ("not
// above the active 3") and says it let go of the retry. That says nothing of the old attempt,
// which it still serves: it must not go back.
TEST_F(orphan_test, a_release_of_the_retry_keeps_the_attempt_the_rank_still_serves) {
  restart(0ms);
  caf::scoped_actor consumer{sys()}, publisher{sys()};
  ASSERT_NO_FATAL_FAILURE(join_holding_consumer(consumer, 3, {"m@3"}));
  ASSERT_NO_FATAL_FAILURE(join_holding_publisher(publisher, {{"m@3", "u-3-a1"}}));
  const auto retry = shard(3);
  publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(retry));
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@3", 3, "released", "", 0, 0.01, "", retry.update_id});
  EXPECT_EQ(release_at(publisher, 600ms).first, "") << "given back while rank 3 serves it";
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@3", 3, "released", "", 0, 0.01, "", "u-3-a1"});
  EXPECT_EQ(release_at(publisher).second, std::vector<std::string>{"u-3-a1"});
}

TEST_F(coordinator_actor_test, a_release_sent_while_the_publisher_was_away_is_sent_on_its_rejoin) {
  caf::scoped_actor consumer{sys()};
  ASSERT_EQ(join(consumer, consumer_hello(3)), std::make_pair(token, std::string()));
  const auto first = shard(1);
  {
    caf::scoped_actor publisher{sys()};
    ASSERT_NO_FATAL_FAILURE(join_publisher(publisher));
    publisher->send(coordinator_, publish_atom::value, token, manifest_to_json(first));
    (void)update_at(consumer);
    consumer->send(coordinator_, report_atom::value,
                   rank_report{token, "m@1", 3, "acknowledged", "", 1, 0.01, "", first.update_id});
    publisher->receive([](const std::string&, const std::string&) {},
                       caf::after(5s) >> [] { ADD_FAILURE() << "no outcome"; });
  }  // the publisher's endpoint is gone: the release below reaches nobody
  consumer->send(coordinator_, report_atom::value,
                 rank_report{token, "m@1", 3, "released", "", 0, 0.01, "", first.update_id});
  EXPECT_EQ(status()["updates"][0]["ranks"][0]["state"], "released");
  caf::scoped_actor rejoined{sys()};
  auto hello = hello_make(token, 0, "publisher", "n0", "m");
  hello.publisher_ranks = 1;
  hello.held = {"m@1"};
  hello.held_ids = {first.update_id};
  ASSERT_EQ(join(rejoined, hello), std::make_pair(token, std::string()));
  std::pair<std::string, std::vector<std::string>> got;
  rejoined->receive(
      [&](release_atom, const std::string&, const std::string& key,
          const std::vector<std::string>& ids) {
        got = {key, ids};
      },
      caf::after(5s) >> [] { ADD_FAILURE() << "the lost release was not sent again"; });
  EXPECT_EQ(got.first, "m@1");
  EXPECT_EQ(got.second, std::vector<std::string>{first.update_id});
}

TEST_F(coordinator_actor_test, this_process_can_stop_it) {
  caf::scoped_actor self{sys()};
  self->monitor(coordinator_);
  stop_guarded(coordinator_);
  bool down = false;
  self->receive([&](const caf::down_msg&) { down = true; }, caf::after(5s) >> [] {});
  EXPECT_TRUE(down);
}

}  // namespace
}  // namespace wsync

TEST(host_is_loopback, only_addresses_that_stay_on_this_machine) {
  EXPECT_TRUE(wsync::host_is_loopback("127.0.0.1"));
  EXPECT_TRUE(wsync::host_is_loopback("127.1.2.3"));
  EXPECT_TRUE(wsync::host_is_loopback("::1"));
  EXPECT_TRUE(wsync::host_is_loopback("localhost"));
  EXPECT_FALSE(wsync::host_is_loopback(""));
  EXPECT_FALSE(wsync::host_is_loopback("0.0.0.0"));
  EXPECT_FALSE(wsync::host_is_loopback("::"));
  EXPECT_FALSE(wsync::host_is_loopback("10.1.2.3"));
  EXPECT_FALSE(wsync::host_is_loopback("no-such-host.invalid"));
}
