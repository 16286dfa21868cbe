// The ucx slot pool on its own: a slot released while transfers still touch it, past the time
// UCX should have ended them, is set aside and a slot made in its place.

#include <gtest/gtest.h>

#if WSYNC_HAVE_UCX
#include <thread>

#include "ucx/slot_pool.hpp"

namespace wsync::ucx_detail {
namespace {

using namespace std::chrono_literals;

class slot_pool_test : public ::testing::Test {
 protected:
  void SetUp() override {
    ucp_config_t* config = nullptr;
    ASSERT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA;
    const auto st = ucp_init(&params, config, &ctx_);
    ucp_config_release(config);
    if (st != UCS_OK) GTEST_SKIP() << "ucp_init failed: " << ucs_status_string(st);
  }
  void TearDown() override {
    if (ctx_) ucp_cleanup(ctx_);
  }
  ucp_context_h ctx_ = nullptr;
};

TEST_F(slot_pool_test, a_slot_pinned_past_its_time_is_set_aside_and_replaced) {
  {
    slot_pool pool(ctx_, "consumer", 1, 100ms);
    auto a = pool.acquire("u-1", 1 << 16, 0ms);
    ASSERT_TRUE(a) << a.error().message;
    pool.busy_begin(*a);  // a receive given up on, which UCX never ends
    pool.release("u-1");
    // Within its time the one slot is still the ring: the next update waits, then fails.
    auto refused = pool.acquire("u-2", 1 << 16, 0ms);
    ASSERT_FALSE(refused);
    EXPECT_NE(refused.error().message.find("no free consumer slot for update_id=u-2"),
              std::string::npos)
        << refused.error().message;
    // A caller waiting across that time gets a new slot once the old one counts as pinned.
    auto b = pool.acquire("u-2", 1 << 16, 2000ms);
    ASSERT_TRUE(b) << b.error().message;
    EXPECT_NE(*b, *a);
    // Never more than the ring again: a third update waits for one of the two.
    pool.release("u-2");
    auto c = pool.acquire("u-3", 1 << 16, 0ms);
    ASSERT_TRUE(c) << c.error().message;
    EXPECT_EQ(*c, *b);
    // The old slot's last transfer ends: its memory goes (the ring has its slot).
    pool.busy_end(*a);
    pool.release("u-3");
    auto d = pool.acquire("u-4", 1 << 16, 0ms);
    ASSERT_TRUE(d) << d.error().message;
    EXPECT_EQ(*d, *b);
  }
}

TEST_F(slot_pool_test, a_busy_slot_within_its_time_is_waited_for) {
  slot_pool pool(ctx_, "consumer", 1, 60s);
  auto a = pool.acquire("u-1", 1 << 16, 0ms);
  ASSERT_TRUE(a) << a.error().message;
  pool.busy_begin(*a);
  pool.release("u-1");
  std::thread ends([&] {
    std::this_thread::sleep_for(50ms);
    pool.busy_end(*a);
  });
  auto b = pool.acquire("u-2", 1 << 16, 5000ms);
  ends.join();
  ASSERT_TRUE(b) << b.error().message;
  EXPECT_EQ(*b, *a);  // the same slot, once its transfer ended
}

}  // namespace
}  // namespace wsync::ucx_detail

#else
TEST(slot_pool_test, needs_ucx) {
  GTEST_SKIP() << "built without UCX (libucx-dev not found)";
}
#endif
