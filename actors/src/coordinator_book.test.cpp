#include "wsync/actors/coordinator_book.hpp"

#include <gtest/gtest.h>

#include <random>

namespace wsync {
namespace {

using namespace std::chrono_literals;
using kind = book_effect::kind;

// Publisher rank `rank`'s shard of `version` of model m: one tensor, "t<rank>" unless named.
weight_update_manifest shard_of(int rank, std::uint64_t version, std::string tensor = "") {
  weight_update_manifest m;
  m.update_id = "u-" + std::to_string(rank) + "-" + std::to_string(version);
  m.model_id = "m";
  m.weight_version = version;
  m.source_rank = rank;
  m.tensors.push_back({});
  m.tensors.back().name = tensor.empty() ? "t" + std::to_string(rank) : tensor;
  return m;
}

// A cluster of 2 publisher ranks (0, 1) and 4 consumer ranks (10..13) on one model; time is
// a value the test advances, never the wall clock.
class book_test : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int r : {0, 1}) ASSERT_TRUE(book_.join(info(r, rank_role::publisher), now_));
    for (int r : {10, 11, 12, 13}) ASSERT_TRUE(book_.join(info(r, rank_role::consumer), now_));
  }
  // Whatever a test did, the running counts behind every decision match the tables.
  void TearDown() override { EXPECT_TRUE(book_.counts_consistent()); }

  static rank_info info(int rank, rank_role role, std::string model = "m") {
    rank_info i;
    i.rank = rank;
    i.role = role;
    i.node = "n" + std::to_string(rank % 2);
    i.model_id = std::move(model);
    i.transports = {"shared-memory"};
    return i;
  }

  static weight_update_manifest shard(int rank, std::uint64_t version, std::string tensor = "") {
    return shard_of(rank, version, std::move(tensor));
  }

  // Publishes both shards of `version` and returns the effects of the completing one.
  std::vector<book_effect> publish_both(std::uint64_t version) {
    auto first = book_.publish(shard(0, version), now_);
    EXPECT_TRUE(first);
    EXPECT_TRUE(first->empty());  // one shard of two: nothing to distribute yet
    auto second = book_.publish(shard(1, version), now_);
    EXPECT_TRUE(second) << second.error().message;
    return *second;
  }

  void ack_all(const std::string& key, std::vector<int> ranks = {10, 11, 12, 13}) {
    for (int r : ranks) {
      ASSERT_TRUE(book_.importing(key, r, "publisher:0", now_));
      ASSERT_TRUE(book_.acknowledged(key, r, now_));
    }
  }

  coord_clock::time_point now_{};
  coordinator_book book_{book_config{10s, 4}};
};

TEST_F(book_test, a_publisher_group_of_another_size_or_a_rank_outside_it_is_refused_at_join) {
  auto p0 = info(0, rank_role::publisher, "g");
  p0.publisher_ranks = 2;
  ASSERT_TRUE(book_.join(p0, now_));
  auto p1 = info(1, rank_role::publisher, "g");
  p1.publisher_ranks = 3;  // the last joiner's count used to win
  auto other = book_.join(p1, now_);
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error().message,
            "join refused: publisher_ranks: 3 differs from the 2 publisher rank 0 of model_id=g "
            "declared (rank=1)");
  auto p2 = info(2, rank_role::publisher, "g");
  p2.publisher_ranks = 2;
  auto outside = book_.join(p2, now_);
  ASSERT_FALSE(outside);
  EXPECT_EQ(outside.error().message,
            "join refused: rank: 2 is not below publisher_ranks 2 (model_id=g)");
  p1.publisher_ranks = 2;
  EXPECT_TRUE(book_.join(p1, now_));
  p0.publisher_ranks = 3;  // the same rank again (it restarted) may change the count alone
  EXPECT_FALSE(book_.join(p0, now_));
}

TEST_F(book_test, a_shard_from_outside_the_group_leaves_no_record) {
  // Model h's group is rank 0 alone; rank 3 joined for h without saying a group size.
  auto p0 = info(0, rank_role::publisher, "h");
  p0.publisher_ranks = 1;
  ASSERT_TRUE(book_.join(p0, now_));
  ASSERT_TRUE(book_.join(info(3, rank_role::publisher, "h"), now_));
  auto stray_shard = shard(3, 3);
  stray_shard.model_id = "h";
  auto stray = book_.publish(stray_shard, now_);
  ASSERT_FALSE(stray);
  EXPECT_NE(stray.error().message.find("is not among this version's publisher ranks"),
            std::string::npos)
      << stray.error().message;
  EXPECT_EQ(book_.find("h@3"), nullptr);
  auto lower = shard(0, 2);  // not refused as below a version 3 in progress
  lower.model_id = "h";
  EXPECT_TRUE(book_.publish(lower, now_));
}

TEST_F(book_test, an_update_assembles_distributes_commits_and_releases) {
  auto fx = publish_both(1);
  ASSERT_EQ(fx.size(), 1u);
  EXPECT_EQ(fx[0].what, kind::distribute);
  EXPECT_EQ(fx[0].key, "m@1");
  EXPECT_EQ(fx[0].ranks, (std::vector<std::int32_t>{10, 11, 12, 13}));
  EXPECT_EQ(fx[0].manifests.size(), 2u);  // both shards travel together
  for (int r : {10, 11, 12}) {
    ASSERT_TRUE(book_.importing("m@1", r, "publisher:0", now_));
    auto a = book_.acknowledged("m@1", r, now_);
    ASSERT_TRUE(a);
    EXPECT_TRUE(a->empty());
  }
  now_ += 5ms;
  auto last = book_.acknowledged("m@1", 13, now_);
  ASSERT_TRUE(last);
  ASSERT_EQ(last->size(), 1u);
  EXPECT_EQ((*last)[0].what, kind::outcome);
  EXPECT_EQ((*last)[0].ranks, (std::vector<std::int32_t>{0, 1}));
  const auto* u = book_.find("m@1");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->phase, update_phase::committed);
  EXPECT_EQ(u->consumers.at(10).received_from, "publisher:0");
  EXPECT_EQ(u->consumers.at(13).at.at(rank_state::acknowledged), now_);
  for (int r : {10, 11, 12}) {
    auto rel = book_.released("m@1", r, now_);
    ASSERT_TRUE(rel);
    EXPECT_TRUE(rel->empty());
  }
  auto rel = book_.released("m@1", 13, now_);
  ASSERT_TRUE(rel);
  ASSERT_EQ(rel->size(), 1u);
  EXPECT_EQ((*rel)[0].what, kind::release_publisher);
  // Which attempt: a retry of the same version may be held under the same key.
  EXPECT_EQ((*rel)[0].update_ids, (std::vector<update_id>{"u-0-1", "u-1-1"}));
  EXPECT_TRUE(book_.find("m@1")->consumers.at(13).acknowledged);  // kept after release
}

TEST_F(book_test, versions_are_monotonic_cluster_wide) {
  publish_both(5);
  auto older = book_.publish(shard(0, 4), now_);
  ASSERT_FALSE(older);
  EXPECT_EQ(older.error().code, errc::version_not_monotonic);
  EXPECT_EQ(older.error().message.rfind("weight_version must increase monotonically", 0), 0u);
  EXPECT_NE(older.error().message.find("rank=0"), std::string::npos);
  auto same = book_.publish(shard(0, 5), now_);  // already distributing
  EXPECT_FALSE(same);
  EXPECT_TRUE(book_.publish(shard(0, 6), now_));
}

TEST_F(book_test, shards_must_not_share_tensors_or_repeat) {
  ASSERT_TRUE(book_.publish(shard(0, 1, "x"), now_));
  auto clash = book_.publish(shard(1, 1, "x"), now_);
  ASSERT_FALSE(clash);
  EXPECT_EQ(clash.error().code, errc::invalid_manifest);
  EXPECT_NE(clash.error().message.find("\"x\""), std::string::npos);
  EXPECT_FALSE(book_.publish(shard(0, 1, "y"), now_));  // rank 0 already published
  weight_update_manifest stranger = shard(7, 1);
  EXPECT_FALSE(book_.publish(stranger, now_));  // not a registered publisher
}

TEST_F(book_test, a_dead_consumer_fails_and_the_others_still_commit) {
  publish_both(1);
  ack_all("m@1", {10, 11, 12});
  auto fx = book_.leave(13, rank_role::consumer, "down: remote_link_unreachable", now_);
  ASSERT_FALSE(fx.empty());
  EXPECT_EQ(fx[0].what, kind::outcome);
  const auto* u = book_.find("m@1");
  EXPECT_EQ(u->phase, update_phase::committed);
  EXPECT_EQ(u->consumers.at(13).state, rank_state::failed);
  EXPECT_NE(u->consumers.at(13).reason.find("remote_link_unreachable"), std::string::npos);
  EXPECT_EQ(book_.consumers().count(13), 0u);
}

TEST_F(book_test, a_publisher_dying_while_its_version_assembles_aborts_it) {
  ASSERT_TRUE(book_.publish(shard(0, 1), now_));
  auto fx = book_.leave(1, rank_role::publisher, "killed", now_);
  ASSERT_EQ(fx.size(), 2u);
  EXPECT_EQ(fx[0].what, kind::outcome);
  // No consumer got it: the surviving publisher gives its shard back at once.
  EXPECT_EQ(fx[1].what, kind::release_publisher);
  EXPECT_EQ(fx[1].ranks, (std::vector<std::int32_t>{0, 1}));  // rank 1 has no endpoint now
  const auto* u = book_.find("m@1");
  EXPECT_EQ(u->phase, update_phase::aborted);
  EXPECT_NE(u->reason.find("publisher rank 1 went away: killed"), std::string::npos);
  EXPECT_EQ(book_.latest_committed("m"), nullptr);  // nothing went live
}

TEST_F(book_test, a_publisher_dying_after_distribution_does_not_undo_the_version) {
  publish_both(1);
  ASSERT_TRUE(book_.importing("m@1", 10, "publisher:0", now_));
  ASSERT_TRUE(book_.acknowledged("m@1", 11, now_));  // rank 11 already switched
  EXPECT_TRUE(book_.leave(1, rank_role::publisher, "killed", now_).empty());
  EXPECT_EQ(book_.find("m@1")->phase, update_phase::distributing);
  ASSERT_TRUE(book_.acknowledged("m@1", 10, now_));
  ASSERT_TRUE(book_.rejected("m@1", 12, "segment: gone", now_));
  ASSERT_TRUE(book_.importing("m@1", 13, "publisher:0", now_));
  auto fx = book_.acknowledged("m@1", 13, now_);
  ASSERT_TRUE(fx);
  ASSERT_EQ(fx->size(), 1u);
  EXPECT_EQ((*fx)[0].what, kind::outcome);
  EXPECT_EQ(book_.find("m@1")->phase, update_phase::committed);
  ASSERT_NE(book_.latest_committed("m"), nullptr);
}

TEST_F(book_test, deadlines_fail_silent_consumers_and_unfinished_assembly) {
  publish_both(1);
  ack_all("m@1", {10, 11});
  now_ += 9s;
  EXPECT_TRUE(book_.expire(now_).empty());
  now_ += 2s;
  auto fx = book_.expire(now_);
  ASSERT_FALSE(fx.empty());
  const auto* u = book_.find("m@1");
  EXPECT_EQ(u->phase, update_phase::committed);
  EXPECT_EQ(u->consumers.at(12).state, rank_state::failed);
  EXPECT_NE(u->consumers.at(12).reason.find("deadline"), std::string::npos);

  ASSERT_TRUE(book_.publish(shard(0, 2), now_));  // rank 1 never publishes
  now_ += 11s;
  fx = book_.expire(now_);
  ASSERT_FALSE(fx.empty());
  EXPECT_EQ(book_.find("m@2")->phase, update_phase::aborted);
  EXPECT_NE(book_.find("m@2")->reason.find("publisher ranks 1"), std::string::npos);
}

// Found by the chaos soak: a consumer frozen past the deadline is failed, but it wakes up and
// goes on reading the update's memory. The publishers keep that memory until it lets go.
TEST_F(book_test, a_rank_the_deadline_failed_keeps_the_memory_until_it_lets_go_or_leaves) {
  for (std::uint64_t v : {1u, 2u}) {
    publish_both(v);
    auto key = "m@" + std::to_string(v);
    ack_all(key, {10, 11, 12});
    now_ += 11s;
    ASSERT_FALSE(book_.expire(now_).empty());
    ASSERT_EQ(book_.find(key)->consumers.at(13).state, rank_state::failed);
    EXPECT_TRUE(book_.find(key)->consumers.at(13).may_hold);
    for (int r : {10, 11, 12}) {
      auto fx = book_.released(key, r, now_);
      ASSERT_TRUE(fx);
      for (const auto& e : *fx) EXPECT_NE(e.what, kind::release_publisher) << "rank 13 may read";
    }
    // Rank 13 wakes up and lets go (v1), or dies (v2): only then do the publishers reuse it.
    auto fx = v == 1 ? *book_.released(key, 13, now_)
                     : book_.leave(13, rank_role::consumer, "killed", now_);
    bool released = false;
    for (const auto& e : fx) released = released || e.what == kind::release_publisher;
    EXPECT_TRUE(released) << key;
    EXPECT_TRUE(book_.find(key)->publishers_released);
    if (v == 1) {
      EXPECT_FALSE(book_.released(key, 13, now_)) << "released twice";
    }
  }
}

TEST_F(book_test, a_late_or_restarted_consumer_catches_up_on_the_latest_committed_version) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  ack_all("m@2");
  auto fx = book_.join(info(14, rank_role::consumer), now_);
  ASSERT_TRUE(fx);
  ASSERT_EQ(fx->size(), 1u);
  EXPECT_EQ((*fx)[0].what, kind::distribute);
  EXPECT_EQ((*fx)[0].key, "m@2");
  EXPECT_EQ((*fx)[0].ranks, std::vector<std::int32_t>{14});
  EXPECT_EQ(book_.find("m@2")->consumers.at(14).state, rank_state::pending);
  ASSERT_TRUE(book_.acknowledged("m@2", 14, now_));
  // A consumer that re-registers after a crash: its old holds are released, then catch-up.
  auto again = book_.join(info(10, rank_role::consumer), now_);
  ASSERT_TRUE(again);
  EXPECT_EQ(book_.find("m@1")->consumers.at(10).state, rank_state::released);
  ASSERT_FALSE(again->empty());
  EXPECT_EQ(again->back().what, kind::distribute);
  EXPECT_EQ(again->back().ranks, std::vector<std::int32_t>{10});
}

// The ranks named as still reading an update are the ones the book waits for: a rank that came
// back saying it holds a version it had released counts in both.
TEST_F(book_test, holders_are_the_ranks_the_memory_waits_for) {
  publish_both(1);
  ack_all("m@1");
  ASSERT_TRUE(book_.released("m@1", 10, now_));
  EXPECT_EQ(book_.holders("m@1"), (std::vector<std::int32_t>{11, 12, 13}));
  (void)book_.leave(10, rank_role::consumer, "link lost", now_);
  auto back = info(10, rank_role::consumer);
  back.active_weight_version = 1;
  back.held = {"m@1"};
  ASSERT_TRUE(book_.join(back, now_));
  ASSERT_TRUE(book_.find("m@1")->consumers.at(10).may_hold);
  EXPECT_EQ(book_.holders("m@1"), (std::vector<std::int32_t>{10, 11, 12, 13}));
  for (int r : {11, 12, 13}) ASSERT_TRUE(book_.released("m@1", r, now_));
  EXPECT_FALSE(book_.find("m@1")->publishers_released) << "rank 10 still reads it";
  EXPECT_EQ(book_.holders("m@1"), (std::vector<std::int32_t>{10}));
}

// A rank whose link went (or that was stopped) comes back still serving m@2: the book had
// counted it as holding nothing when it left, and would have given m@2's memory back to the
// publishers under it. It holds m@2 again until it lets go, and gets no catch-up of the version
// it serves (it would refuse it, and show as rejected).
TEST_F(book_test, a_rank_that_comes_back_holding_an_update_keeps_its_memory_until_it_lets_go) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  ack_all("m@2");
  for (int r : {10, 11, 12, 13}) ASSERT_TRUE(book_.released("m@1", r, now_));
  (void)book_.leave(10, rank_role::consumer, "link lost", now_);
  auto back = info(10, rank_role::consumer);
  back.active_weight_version = 2;
  back.held = {"m@2", "m@1", "m@9"};  // m@1 was given back already; m@9 the book never knew
  auto fx = book_.join(back, now_);
  ASSERT_TRUE(fx);
  EXPECT_TRUE(fx->empty());  // no catch-up: it serves m@2
  EXPECT_TRUE(book_.find("m@2")->consumers.at(10).may_hold);
  // Version 3 commits; every other rank lets go of m@2, and its memory stays: rank 10 has it.
  publish_both(3);
  ack_all("m@3");
  for (int r : {11, 12, 13}) {
    auto r2 = book_.released("m@2", r, now_);
    ASSERT_TRUE(r2) << r2.error().message;
    EXPECT_TRUE(r2->empty());
  }
  auto last = book_.released("m@2", 10, now_);  // it lets go: now the publishers may reuse it
  ASSERT_TRUE(last) << last.error().message;
  ASSERT_EQ(last->size(), 1u);
  EXPECT_EQ((*last)[0].what, kind::release_publisher);
  EXPECT_EQ((*last)[0].key, "m@2");
}

// A catch-up the rank never answers (the message was lost on the way) does not keep the rank a
// holder of that version for good: past the update deadline it is failed, holding the memory
// only while the rank may still read it, until it lets go.
TEST_F(book_test, a_catch_up_left_unanswered_is_failed_at_the_deadline) {
  publish_both(1);
  ack_all("m@1");
  ASSERT_TRUE(book_.join(info(14, rank_role::consumer), now_));
  const auto& entry = [&]() -> const rank_progress& {
    return book_.find("m@1")->consumers.at(14);
  };
  EXPECT_EQ(entry().state, rank_state::pending);
  now_ += 9s;
  book_.expire(now_);
  EXPECT_EQ(entry().state, rank_state::pending);  // within the deadline
  now_ += 2s;
  book_.expire(now_);
  EXPECT_EQ(entry().state, rank_state::failed);
  EXPECT_TRUE(entry().may_hold) << "rank 14 is joined: it may be reading the version yet";
  EXPECT_NE(entry().reason.find("catch-up"), std::string::npos) << entry().reason;
  ASSERT_TRUE(book_.released("m@1", 14, now_));
  EXPECT_FALSE(entry().may_hold);
  EXPECT_TRUE(book_.counts_consistent());

  // A catch-up answered late (a large first import) stands: the rank serves the version.
  ASSERT_TRUE(book_.join(info(15, rank_role::consumer), now_));
  now_ += 11s;
  book_.expire(now_);
  ASSERT_EQ(book_.find("m@1")->consumers.at(15).state, rank_state::failed);
  ASSERT_TRUE(book_.acknowledged("m@1", 15, now_));
  EXPECT_EQ(book_.find("m@1")->consumers.at(15).state, rank_state::acknowledged);
  EXPECT_FALSE(book_.find("m@1")->consumers.at(15).may_hold);
  EXPECT_TRUE(book_.counts_consistent());
}

// A rank waiting for the next version also says released (it holds nothing): the table keeps
// saying it waits, and why.
TEST_F(book_test, a_release_after_waiting_keeps_the_rank_waiting) {
  publish_both(1);
  ack_all("m@1");
  ASSERT_TRUE(book_.join(info(14, rank_role::consumer), now_));
  ASSERT_TRUE(book_.waiting("m@1", 14, "waiting for the next version: gone", now_));
  auto released = book_.released("m@1", 14, now_);
  ASSERT_TRUE(released) << released.error().message;
  EXPECT_TRUE(released->empty());
  const auto& entry = book_.find("m@1")->consumers.at(14);
  EXPECT_EQ(entry.state, rank_state::waiting);
  EXPECT_EQ(entry.reason, "waiting for the next version: gone");
  EXPECT_TRUE(book_.counts_consistent());
}

TEST_F(book_test, out_of_order_reports_are_refused) {
  auto unknown = book_.acknowledged("m@9", 10, now_);
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code, errc::unknown_update);
  publish_both(1);
  ASSERT_TRUE(book_.acknowledged("m@1", 10, now_));
  EXPECT_FALSE(book_.acknowledged("m@1", 10, now_));
  EXPECT_FALSE(book_.importing("m@1", 10, "", now_));
  EXPECT_FALSE(book_.rejected("m@1", 10, "late", now_));
  EXPECT_FALSE(book_.acknowledged("m@1", 99, now_));  // not a consumer of it
  ASSERT_TRUE(book_.released("m@1", 10, now_));
  EXPECT_FALSE(book_.released("m@1", 10, now_));
}

TEST_F(book_test, an_update_nobody_acknowledged_is_aborted) {
  publish_both(1);
  for (int r : {10, 11, 12, 13})
    ASSERT_TRUE(book_.rejected("m@1", r, "tensor checksum mismatch", now_));
  const auto* u = book_.find("m@1");
  EXPECT_EQ(u->phase, update_phase::aborted);
  EXPECT_EQ(u->consumers.at(12).reason, "tensor checksum mismatch");
}

TEST_F(book_test, an_aborted_version_is_retried_once_every_rank_let_go_of_it) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  for (int r : {10, 11, 12, 13}) ASSERT_TRUE(book_.importing("m@2", r, "publisher:0", now_));
  for (int r : {10, 11, 12})
    ASSERT_TRUE(book_.rejected("m@2", r, "tensor checksum mismatch", now_));
  for (int r : {10, 11, 12}) ASSERT_TRUE(book_.released("m@2", r, now_));
  ASSERT_TRUE(book_.rejected("m@2", 13, "tensor checksum mismatch", now_));
  ASSERT_EQ(book_.find("m@2")->phase, update_phase::aborted);
  // Rank 13 still holds attempt 1: a retry must wait (a late report must not hit attempt 2).
  auto retry = shard(0, 2);
  retry.update_id = "u-0-2-retry";
  EXPECT_TRUE(book_.retry_must_wait(retry));
  auto early = book_.publish(retry, now_);
  ASSERT_FALSE(early);
  EXPECT_NE(early.error().message.find("was aborted and ranks still hold it"), std::string::npos)
      << early.error().message;
  auto fx = book_.released("m@2", 13, now_);
  ASSERT_TRUE(fx);
  ASSERT_EQ(fx->size(), 1u);
  EXPECT_EQ((*fx)[0].what, kind::release_publisher);
  EXPECT_FALSE(book_.retry_must_wait(retry));
  ASSERT_TRUE(book_.publish(retry, now_));
  auto second = shard(1, 2);
  second.update_id = "u-1-2-retry";
  auto done = book_.publish(second, now_);
  ASSERT_TRUE(done) << done.error().message;
  ASSERT_FALSE(done->empty());
  EXPECT_EQ((*done)[0].what, kind::distribute);
  EXPECT_EQ((*done)[0].manifests[0].update_id, "u-0-2-retry");
  const auto* u = book_.find("m@2");
  EXPECT_EQ(u->attempt, 2u);
  EXPECT_EQ(u->phase, update_phase::distributing);
  EXPECT_EQ(u->consumers.at(13).state, rank_state::pending);
  ack_all("m@2");
  EXPECT_EQ(book_.find("m@2")->phase, update_phase::committed);
  // Committed is final: neither 2 nor 1 comes again.
  for (std::uint64_t v : {2u, 1u}) {
    auto old = shard(0, v);
    old.update_id = "u-old-" + std::to_string(v);
    auto r = book_.publish(old, now_);
    ASSERT_FALSE(r) << "version " << v;
    EXPECT_EQ(r.error().code, errc::version_not_monotonic);
  }
  // A consumer that joins serving version 7 (the coordinator restarted): 5 was committed before.
  auto late = info(14, rank_role::consumer);
  late.active_weight_version = 7;
  ASSERT_TRUE(book_.join(late, now_));
  auto r = book_.publish(shard(0, 5), now_);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("weight_version must increase monotonically: weight_version 5 "
                                   "is not above the committed 7 for model_id=m"),
            std::string::npos)
      << r.error().message;
}

// A rank still importing when the deadline aborted the version (nobody had acknowledged)
// finishes, installs it and acknowledges late. Its answer used to be refused, the trainer's
// retry of that version then waited for the rank to let go (for good, with views installed),
// and a retry that went out would put other bytes under the number the rank serves.
TEST_F(book_test, a_version_installed_after_its_abort_is_never_published_again) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  for (int r : {10, 11, 12, 13}) ASSERT_TRUE(book_.importing("m@2", r, "publisher:0", now_));
  now_ += 11s;
  book_.expire(now_);
  ASSERT_EQ(book_.find("m@2")->phase, update_phase::aborted);
  auto late = book_.acknowledged("m@2", 13, now_);
  ASSERT_TRUE(late) << late.error().message;
  const auto& entry = book_.find("m@2")->consumers.at(13);
  EXPECT_EQ(entry.state, rank_state::acknowledged);
  EXPECT_EQ(entry.reason, "installed after the update was aborted");
  EXPECT_EQ(book_.find("m@2")->phase, update_phase::aborted);  // its outcome was told already
  EXPECT_EQ(book_.used_version("m"), 2u);  // where a trainer's next version starts
  EXPECT_EQ(book_.latest_committed("m")->weight_version, 1u);  // the catch-up stays 1
  for (int r : {10, 11, 12}) {
    auto fx = book_.released("m@2", r, now_);
    ASSERT_TRUE(fx);
    for (const auto& e : *fx) EXPECT_NE(e.what, kind::release_publisher) << "rank 13 reads it";
  }
  auto retry = shard(0, 2);
  retry.update_id = "u-0-2-retry";
  EXPECT_FALSE(book_.retry_must_wait(retry)) << "it would wait for rank 13 to let go";
  auto r = book_.publish(retry, now_);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::version_not_monotonic);
  for (const char* part : {"weight_version 2 was aborted, but rank 13 installed it after the "
                           "abort and serves it; publish a version above 2",
                           "update_id=u-0-2-retry"}) {
    EXPECT_NE(r.error().message.find(part), std::string::npos) << r.error().message;
  }
  // The next version goes on, and once rank 13 moves to it the publishers get 2 back.
  ASSERT_FALSE(publish_both(3).empty());
  ack_all("m@3");
  auto fx = book_.released("m@2", 13, now_);
  ASSERT_TRUE(fx);
  ASSERT_EQ(fx->size(), 1u);
  EXPECT_EQ((*fx)[0].what, kind::release_publisher);
}

// After a coordinator restart the book knows no manifests. A consumer that re-joins serving
// version 5 gives them (adopt); ranks that joined before get version 5 as a catch-up, so do ranks
// that join after, and ranks that serve it too are in its table. Its publishers' memory is never
// released by the book: the coordinator keeps it as an orphan held by the ranks that read it.
TEST(book_adopt, a_restarted_book_takes_the_version_a_rejoining_consumer_serves) {
  coordinator_book b{book_config{10s, 4}};
  coord_clock::time_point now{};
  auto info = [](int rank, rank_role role, std::uint64_t active = 0) {
    rank_info i;
    i.rank = rank;
    i.role = role;
    i.node = "n0";
    i.model_id = "m";
    i.transports = {"shared-memory"};
    i.active_weight_version = active;
    if (active > 0) i.held = {update_key("m", active)};
    if (role == rank_role::publisher) i.publisher_ranks = 2;
    return i;
  };
  const auto shard = shard_of;
  for (int r : {0, 1}) ASSERT_TRUE(b.join(info(r, rank_role::publisher), now));
  ASSERT_TRUE(b.join(info(12, rank_role::consumer), now));  // before anyone serving came back
  ASSERT_TRUE(b.join(info(11, rank_role::consumer, 5), now));
  // Refused: not the version the rank serves, a tensor twice, a publisher rank missing.
  for (auto [bad, why] : {std::pair{std::vector{shard(0, 4, "a"), shard(1, 4, "b")},
                                    "active_manifests[0].weight_version: 4 is not the rank's "
                                    "active 5"},
                          std::pair{std::vector{shard(0, 5, "a"), shard(1, 5, "a")},
                                    "active_manifests[1].tensors: \"a\" twice"},
                          std::pair{std::vector{shard(0, 5, "a")},
                                    "source_rank: publisher rank 1 of 2 has no shard"}}) {
    auto r = b.adopt(11, bad, now);
    ASSERT_FALSE(r) << why;
    EXPECT_NE(r.error().message.find(why), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find("update=m@5 rank=11"), std::string::npos);
    EXPECT_EQ(b.find("m@5"), nullptr);
  }
  auto fx = b.adopt(11, {shard(0, 5, "a"), shard(1, 5, "b")}, now);
  ASSERT_TRUE(fx) << fx.error().message;
  ASSERT_EQ(fx->size(), 1u);
  EXPECT_EQ((*fx)[0].what, book_effect::kind::distribute);
  EXPECT_TRUE((*fx)[0].catch_up);
  EXPECT_EQ((*fx)[0].ranks, std::vector<std::int32_t>{12});
  EXPECT_EQ((*fx)[0].manifests.size(), 2u);
  const auto* u = b.find("m@5");
  ASSERT_NE(u, nullptr);
  EXPECT_TRUE(u->adopted);
  EXPECT_EQ(u->phase, update_phase::committed);
  EXPECT_EQ(u->consumers.at(11).state, rank_state::acknowledged);
  EXPECT_EQ(b.latest_committed("m"), u);
  // Taken once: another rank's manifests of it change nothing.
  EXPECT_TRUE(b.adopt(11, {shard(0, 5, "a"), shard(1, 5, "b")}, now)->empty());
  // A rank that serves it too is in its table; one that joins behind it catches up.
  ASSERT_TRUE(b.join(info(10, rank_role::consumer, 5), now)->empty());
  EXPECT_EQ(u->consumers.at(10).state, rank_state::acknowledged);
  auto late = b.join(info(13, rank_role::consumer), now);
  ASSERT_TRUE(late);
  ASSERT_EQ(late->size(), 1u);
  EXPECT_EQ((*late)[0].ranks, std::vector<std::int32_t>{13});
  // Every rank lets go: the book releases nothing (the orphan's holders say when).
  for (int r : {12, 13}) {
    ASSERT_TRUE(b.acknowledged("m@5", r, now));
  }
  for (int r : {10, 11, 12, 13}) {
    auto out = b.released("m@5", r, now);
    ASSERT_TRUE(out) << out.error().message;
    for (const auto& e : *out) EXPECT_NE(e.what, book_effect::kind::release_publisher);
  }
  // Version 5 is used: the trainer goes on above it.
  EXPECT_FALSE(b.publish(shard(0, 5, "a"), now));
  ASSERT_TRUE(b.publish(shard(0, 6, "a"), now));
  ASSERT_FALSE(b.publish(shard(1, 6, "b"), now)->empty());
  // A version this book recorded (7, aborted, then dropped from its history or not) is never
  // taken from a rank that installed it late: only versions above all it recorded.
  ASSERT_TRUE(b.publish(shard(0, 7, "a"), now));
  now += 11s;
  b.expire(now);
  ASSERT_EQ(b.find("m@7")->phase, update_phase::aborted);
  auto r7 = info(14, rank_role::consumer, 7);
  ASSERT_TRUE(b.join(r7, now));
  EXPECT_TRUE(b.adopt(14, {shard(0, 7, "a"), shard(1, 7, "b")}, now)->empty());
  EXPECT_EQ(b.find("m@7")->phase, update_phase::aborted);
  EXPECT_TRUE(b.counts_consistent());
}

TEST_F(book_test, a_version_aborted_while_assembling_is_retried_at_once) {
  ASSERT_TRUE(book_.publish(shard(0, 1), now_));
  book_.leave(1, rank_role::publisher, "killed", now_);
  ASSERT_TRUE(book_.join(info(1, rank_role::publisher), now_));  // the trainer restarts
  EXPECT_FALSE(book_.retry_must_wait(shard(0, 1)));
  auto again = shard(0, 1);
  again.update_id = "u-0-1-retry";
  ASSERT_TRUE(book_.publish(again, now_));
  auto fx = book_.publish(shard(1, 1), now_);
  ASSERT_TRUE(fx) << fx.error().message;
  EXPECT_EQ(book_.find("m@1")->attempt, 2u);
  EXPECT_EQ(book_.find("m@1")->phase, update_phase::distributing);
}

TEST_F(book_test, history_is_bounded_but_keeps_the_catch_up_source) {
  for (std::uint64_t v = 1; v <= 10; ++v) {
    publish_both(v);
    ack_all("m@" + std::to_string(v));
    if (v < 10) {
      for (int r : {10, 11, 12, 13}) ASSERT_TRUE(book_.released("m@" + std::to_string(v), r, now_));
    }
  }
  auto list = book_.updates("m");
  EXPECT_LE(list.size(), 5u);
  ASSERT_NE(book_.latest_committed("m"), nullptr);
  EXPECT_EQ(book_.latest_committed("m")->weight_version, 10u);
}

TEST_F(book_test, history_is_bounded_when_every_version_aborts_while_assembling) {
  for (std::uint64_t v = 1; v <= 12; ++v) {
    ASSERT_TRUE(book_.publish(shard(0, v), now_));  // rank 1 never publishes
    now_ += 11s;
    ASSERT_FALSE(book_.expire(now_).empty());
    ASSERT_EQ(book_.find("m@" + std::to_string(v))->phase, update_phase::aborted);
  }
  EXPECT_LE(book_.updates("m").size(), 5u);
}

// Two versions in flight when the rank they wait on leaves: both finish in one call, and the
// second's history cleanup may drop the first before its outcome is carried out. The outcome
// effect carries the finished record, so the trainer still hears it.
TEST_F(book_test, an_outcome_survives_the_history_dropping_its_record) {
  for (std::uint64_t v = 1; v <= 6; ++v) {  // a full history, rank 10 still holding 3..6
    publish_both(v);
    ack_all("m@" + std::to_string(v));
    for (int r : {10, 11, 12, 13}) {
      if (r == 10 && v >= 3) continue;
      ASSERT_TRUE(book_.released("m@" + std::to_string(v), r, now_));
    }
  }
  publish_both(7);
  publish_both(8);
  ack_all("m@7", {10, 11, 12});
  ack_all("m@8", {10, 11, 12});
  for (int r : {10, 11, 12}) ASSERT_TRUE(book_.released("m@7", r, now_));
  auto fx = book_.leave(13, rank_role::consumer, "down", now_);
  std::vector<std::string> outcomes;
  bool dropped = false;
  for (const auto& e : fx) {
    if (e.what != kind::outcome) continue;
    outcomes.push_back(e.key);
    ASSERT_TRUE(e.record) << e.key;
    EXPECT_EQ(e.record->key, e.key);
    EXPECT_EQ(e.record->phase, update_phase::committed);
    EXPECT_EQ(e.record->consumers.at(13).state, rank_state::failed);
    dropped = dropped || book_.find(e.key) == nullptr;
  }
  EXPECT_EQ(outcomes, (std::vector<std::string>{"m@7", "m@8"}));
  EXPECT_TRUE(dropped) << "the history kept every record: the case this test is about did not "
                          "happen";
}

// A rank that joins while a version distributes gets the one committed before it at once, and
// that version too once it commits, whether it answered meanwhile or not.
TEST_F(book_test, a_rank_that_joins_mid_update_gets_that_update_once_it_commits) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  auto joined = book_.join(info(14, rank_role::consumer), now_);
  ASSERT_TRUE(joined);
  ASSERT_EQ(joined->size(), 1u);
  EXPECT_EQ((*joined)[0].key, "m@1");  // catch-up on the committed version
  EXPECT_TRUE((*joined)[0].catch_up);
  ASSERT_TRUE(book_.acknowledged("m@1", 14, now_));
  for (int r : {10, 11, 12}) {
    ASSERT_TRUE(book_.importing("m@2", r, "publisher:0", now_));
    ASSERT_TRUE(book_.acknowledged("m@2", r, now_));
  }
  ASSERT_TRUE(book_.importing("m@2", 13, "publisher:0", now_));
  auto last = book_.acknowledged("m@2", 13, now_);
  ASSERT_TRUE(last);
  ASSERT_GE(last->size(), 2u);
  EXPECT_EQ((*last)[0].what, kind::outcome);
  EXPECT_EQ((*last)[0].record->consumers.count(14), 0u);  // the outcome is the ranks it waited on
  EXPECT_EQ((*last)[1].what, kind::distribute);
  EXPECT_EQ((*last)[1].key, "m@2");
  EXPECT_EQ((*last)[1].ranks, (std::vector<std::int32_t>{14}));
  EXPECT_TRUE((*last)[1].catch_up);
  EXPECT_FALSE(book_.find("m@2")->publishers_released);  // 14 will read it
  ASSERT_TRUE(book_.acknowledged("m@2", 14, now_));
}

// The same for a rank that restarted mid-update: the entry its first process left (failed) does
// not stand for the new one.
TEST_F(book_test, a_rank_that_restarts_mid_update_gets_that_update_once_it_commits) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  (void)book_.leave(13, rank_role::consumer, "down", now_);
  ASSERT_TRUE(book_.join(info(13, rank_role::consumer), now_));  // caught up on m@1
  ASSERT_TRUE(book_.acknowledged("m@1", 13, now_));
  for (int r : {10, 11}) ASSERT_TRUE(book_.acknowledged("m@2", r, now_));
  auto last = book_.acknowledged("m@2", 12, now_);  // m@2 commits
  ASSERT_TRUE(last);
  bool sent = false;
  for (const auto& e : *last) {
    sent = sent || (e.what == kind::distribute && e.key == "m@2" &&
                    e.ranks == std::vector<std::int32_t>{13} && e.catch_up);
  }
  EXPECT_TRUE(sent) << "the new process of rank 13 was not sent m@2";
  EXPECT_EQ(book_.find("m@2")->consumers.at(13).state, rank_state::pending);
  ASSERT_TRUE(book_.acknowledged("m@2", 13, now_));
}

// A link that went and came back while an update distributes: the same process, still
// importing it (it names it as held) or serving it already (its answer was lost with the link).
TEST_F(book_test, a_rank_whose_link_comes_back_mid_update_keeps_its_entry) {
  publish_both(1);
  ack_all("m@1");
  publish_both(2);
  for (int r : {10, 11}) ASSERT_TRUE(book_.importing("m@2", r, "publisher:0", now_));
  (void)book_.leave(10, rank_role::consumer, "down: remote_link_unreachable", now_);
  (void)book_.leave(11, rank_role::consumer, "down: remote_link_unreachable", now_);
  EXPECT_EQ(book_.find("m@2")->consumers.at(10).state, rank_state::failed);
  auto importing = info(10, rank_role::consumer);
  importing.active_weight_version = 1;
  importing.held = {"m@1", "m@2"};
  auto served = info(11, rank_role::consumer);
  served.active_weight_version = 2;
  served.held = {"m@2"};
  ASSERT_TRUE(book_.join(importing, now_));
  ASSERT_TRUE(book_.join(served, now_));
  const auto& table = book_.find("m@2")->consumers;
  EXPECT_EQ(table.at(10).state, rank_state::importing);
  EXPECT_TRUE(table.at(10).reason.empty());
  EXPECT_EQ(table.at(11).state, rank_state::acknowledged);
  // Rank 10's answer comes after its re-join and counts; the commit sends no catch-up of m@2 to
  // either (each would refuse it as a repeat, and show as rejected).
  ASSERT_TRUE(book_.acknowledged("m@2", 10, now_));
  ASSERT_TRUE(book_.acknowledged("m@2", 12, now_));
  auto last = book_.acknowledged("m@2", 13, now_);
  ASSERT_TRUE(last);
  for (const auto& e : *last) EXPECT_NE(e.what, kind::distribute) << "a catch-up of " << e.key;
  EXPECT_EQ(book_.find("m@2")->phase, update_phase::committed);
  EXPECT_EQ(book_.find("m@2")->counts.acknowledged, 4u);
  // Their releases give the memory back as anyone's do.
  publish_both(3);
  ack_all("m@3");
  for (int r : {10, 11, 12}) ASSERT_TRUE(book_.released("m@2", r, now_));
  auto rel = book_.released("m@2", 13, now_);
  ASSERT_TRUE(rel);
  ASSERT_EQ(rel->size(), 1u);
  EXPECT_EQ((*rel)[0].what, kind::release_publisher);
}

TEST_F(book_test, other_models_are_independent) {
  ASSERT_TRUE(book_.join(info(20, rank_role::publisher, "other"), now_));
  weight_update_manifest m = shard(20, 1);
  m.model_id = "other";
  auto fx = book_.publish(m, now_);
  ASSERT_TRUE(fx);
  // "other" has a publisher but no consumers: it commits at once with an empty table.
  EXPECT_EQ(book_.find("other@1")->phase, update_phase::committed);
  EXPECT_TRUE(book_.publish(shard(0, 1), now_));  // version 1 of "m" is still free
}

TEST_F(book_test, a_collective_transport_asks_for_the_live_consumers_of_its_model) {
  EXPECT_EQ(book_.consumers_of("m", "shared-memory"), (std::vector<std::int32_t>{10, 11, 12, 13}));
  EXPECT_TRUE(book_.consumers_of("m", "nccl").empty());
  EXPECT_TRUE(book_.consumers_of("other", "shared-memory").empty());
  auto nccl = info(14, rank_role::consumer);
  nccl.transports = {"shared-memory", "nccl"};
  ASSERT_TRUE(book_.join(nccl, now_));
  EXPECT_EQ(book_.consumers_of("m", "nccl"), std::vector<std::int32_t>{14});
  book_.leave(11, rank_role::consumer, "down", now_);
  EXPECT_EQ(book_.consumers_of("m", "shared-memory"), (std::vector<std::int32_t>{10, 12, 13, 14}));
}

// Random reports, leaves, re-joins, deadlines and publishes, in any order (most refused): after
// each, the running counts match a walk of the tables, and no update is left waiting on answers
// it already has or holding memory nobody holds.
TEST_F(book_test, running_counts_survive_any_sequence_of_messages) {
  std::mt19937 rng(20261123);
  auto pick = [&](int n) {
    return static_cast<int>(rng() % static_cast<unsigned>(n));
  };
  const std::vector<int> consumers{10, 11, 12, 13};
  std::uint64_t version = 1;
  for (int step = 0; step < 20000; ++step) {
    const int rank = consumers[static_cast<std::size_t>(pick(4))];
    const auto key = "m@" + std::to_string(version - static_cast<std::uint64_t>(pick(2)));
    now_ += std::chrono::milliseconds(pick(400));
    switch (pick(9)) {
      case 0:
        (void)book_.importing(key, rank, "publisher:0", now_);
        break;
      case 1:
      case 2:
        (void)book_.acknowledged(key, rank, now_);
        break;
      case 3:
        if (pick(2) == 0) {
          (void)book_.rejected(key, rank, "bad", now_);
        } else {
          (void)book_.waiting(key, rank, "gone", now_);
        }
        break;
      case 4:
        (void)book_.released(key, rank, now_);
        break;
      case 5:
        (void)book_.leave(rank, rank_role::consumer, "gone", now_);
        (void)book_.join(info(rank, rank_role::consumer), now_);
        break;
      case 6:
        (void)book_.expire(now_);
        break;
      default:
        if (book_.publish(shard(pick(2), version), now_) &&
            book_.find("m@" + std::to_string(version))->phase != update_phase::assembling) {
          ++version;
        } else if (pick(4) == 0) {
          ++version;  // sometimes give up on one
        }
        break;
    }
    ASSERT_TRUE(book_.counts_consistent()) << "after step " << step;
    for (const auto* u : book_.updates("m")) {
      bool all_answered = true, anyone_holds = false;
      for (const auto& [r, p] : u->consumers) {
        all_answered =
            all_answered && p.state != rank_state::pending && p.state != rank_state::importing;
        anyone_holds = anyone_holds || p.may_hold ||
                       (p.state != rank_state::released && p.state != rank_state::failed &&
                        p.state != rank_state::waiting);
      }
      if (u->phase == update_phase::distributing) {
        ASSERT_FALSE(all_answered) << u->key << " after step " << step;
      }
      if (u->phase == update_phase::committed || u->phase == update_phase::aborted) {
        ASSERT_EQ(u->publishers_released, !anyone_holds) << u->key << " after step " << step;
      }
    }
  }
  EXPECT_GT(version, 20u);  // the walk got through many versions, not one stuck update
}

}  // namespace
}  // namespace wsync
