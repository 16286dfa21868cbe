// What a consumer rank says it holds (its hello.held on a re-join, and the "released" reports
// that let publishers reuse memory): exactly the updates whose memory it still reads.

#include "consumer_rank.hpp"

#include <gtest/gtest.h>

#include "held_publisher.hpp"
#include "pattern_tensors.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync::consumer_detail {
namespace {

class rollout_side_test : public ::testing::TestWithParam<reference_runtime::install_mode> {
 protected:
  void SetUp() override {
    publisher_ = test::held_shm_publisher("m");
    if (!publisher_) GTEST_SKIP() << "shared memory is not available here";
  }
  void TearDown() override {
    if (publisher_) test::release_held(*publisher_);
  }

  // A rank over shared memory installing into `runtime_`; null (a failure) when no transport.
  std::unique_ptr<rollout_side> make_side() {
    auto t = make_transport("shared-memory", {});
    EXPECT_TRUE(t) << t.error().message;
    if (!t) return nullptr;
    auto c = (*t)->make_consumer();
    EXPECT_TRUE(c) << c.error().message;
    if (!c) return nullptr;
    return std::make_unique<rollout_side>(std::move(*c), 0, true, runtime_, runtime_.gate());
  }

  test::pattern_tensors tensors_{4, 512};
  std::unique_ptr<weight_publisher> publisher_;
  reference_runtime runtime_{GetParam()};
};

// What a rank tells a restarted coordinator of the version it serves (rank_hello): the version,
// and its manifests when it got them from the publishers (a relay's would send catch-ups there).
TEST_P(rollout_side_test, a_rank_offers_the_manifests_of_the_version_it_serves) {
  auto made = make_side();
  ASSERT_TRUE(made);
  auto& side = *made;
  EXPECT_EQ(side.active_served(), (std::pair<std::uint64_t, std::vector<std::string>>{0, {}}));
  for (const char* from : {"publisher:0", "rank:2"}) {
    const std::uint64_t v = from[0] == 'p' ? 1 : 2;
    auto m = publisher_->publish(tensors_.fill(v), v, {0});
    ASSERT_TRUE(m) << m.error().message;
    auto r = side.executor.update_weights(*m);
    ASSERT_TRUE(r.acknowledged) << (r.failure ? r.failure->message : "");
    (void)side.settle(r, update_key("m", v));
    auto u = std::make_shared<parsed_update>();
    u->key = update_key("m", v);
    u->received_from = from;
    u->shards = {*m};
    side.serving(u);
    auto [version, manifests] = side.active_served();
    EXPECT_EQ(version, v);
    if (v == 1) {
      ASSERT_EQ(manifests.size(), 1u);
      EXPECT_EQ(manifests[0], manifest_to_json(*m));
    } else {
      EXPECT_TRUE(manifests.empty()) << "a relay's manifests were offered";
    }
  }
  for (const auto& id : side.executor.release_active()) (void)id;
}

TEST_P(rollout_side_test, a_rank_holds_only_what_it_reads) {
  auto made = make_side();
  ASSERT_TRUE(made);
  auto& side = *made;
  const bool views = GetParam() == reference_runtime::install_mode::view;
  std::set<std::string> released;
  std::vector<weight_update_manifest> last;
  for (std::uint64_t v = 1; v <= 3; ++v) {
    auto m = publisher_->publish(tensors_.fill(v), v, {0});
    ASSERT_TRUE(m) << m.error().message;
    auto r = side.executor.update_weights(*m);
    ASSERT_TRUE(r.acknowledged) << (r.failure ? r.failure->message : "");
    for (const auto& [key, id] : side.settle(r, update_key("m", v))) released.insert(key);
    last = {*m};
  }
  // Another attempt of the version it serves (a retry, after a coordinator restart) is not held:
  // the key is the same, the shard ids are not.
  auto other_attempt = last;
  other_attempt.front().update_id = update_id_generate();
  EXPECT_FALSE(side.holds_any(other_attempt));
  if (views) {
    // It reads version 3 from the publisher's memory; 1 and 2 were let go as 3 came.
    EXPECT_EQ(side.held(), (std::vector<std::string>{"m@3"}));
    EXPECT_TRUE(side.holds_any(last));
    EXPECT_EQ(released, (std::set<std::string>{"m@1", "m@2"}));
  } else {
    // Copies: it let go of each import at once and holds nothing a publisher must keep.
    EXPECT_TRUE(side.held().empty());
    EXPECT_FALSE(side.holds_any(last));
    EXPECT_TRUE(released.empty());
  }
  (void)side.executor.release_active();
}

TEST_P(rollout_side_test, an_update_being_imported_is_held) {
  auto made = make_side();
  ASSERT_TRUE(made);
  auto& side = *made;
  // A re-join while an import runs names its key: a restarted coordinator must not have the
  // publishers reuse that memory before the rank says it let go.
  side.importing("m@5");
  side.importing("m@5");  // a catch-up of the same version alongside
  EXPECT_EQ(side.held(), (std::vector<std::string>{"m@5"}));
  side.dropped("m@5");
  EXPECT_EQ(side.held(), (std::vector<std::string>{"m@5"}));
  side.dropped("m@5");
  EXPECT_TRUE(side.held().empty());
}

// From the hand-off to the worker until the install is settled, the key is held without a gap:
// settling ends the import and records what the rank now serves in one step.
TEST_P(rollout_side_test, an_install_is_held_from_hand_off_to_settle) {
  auto made = make_side();
  ASSERT_TRUE(made);
  auto& side = *made;
  auto m = publisher_->publish(tensors_.fill(1), 1, {0});
  ASSERT_TRUE(m) << m.error().message;
  side.importing("m@1");
  EXPECT_EQ(side.held(), (std::vector<std::string>{"m@1"}));
  auto r = side.executor.update_weights(*m);
  ASSERT_TRUE(r.acknowledged) << (r.failure ? r.failure->message : "");
  EXPECT_EQ(side.held(), (std::vector<std::string>{"m@1"}));
  (void)side.settle(r, "m@1");
  const bool views = GetParam() == reference_runtime::install_mode::view;
  EXPECT_EQ(side.held(), views ? std::vector<std::string>{"m@1"} : std::vector<std::string>{});
  EXPECT_EQ(side.holds_key("m@1"), views);
  EXPECT_FALSE(side.holds_key("m@2"));
  (void)side.executor.release_active();
}

INSTANTIATE_TEST_SUITE_P(installs, rollout_side_test,
                         ::testing::Values(reference_runtime::install_mode::view,
                                           reference_runtime::install_mode::copy));

}  // namespace
}  // namespace wsync::consumer_detail
