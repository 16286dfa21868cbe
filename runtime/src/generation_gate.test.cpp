#include "wsync/runtime/generation_gate.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <vector>

namespace wsync {
namespace {

// Spins (yielding) until `cond` holds; the gate's own counters make this deterministic.
template <class F>
bool await(F cond) {  // false after 10 s: the test fails instead of hanging
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!cond()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

TEST(generation_gate, install_waits_for_running_generations) {
  generation_gate gate;
  std::vector<int> order;
  std::mutex order_mutex;
  auto note = [&](int v) {
    std::lock_guard l(order_mutex);
    order.push_back(v);
  };
  gate.lock_shared();
  std::thread writer([&] {
    std::unique_lock l(gate);
    note(2);
  });
  EXPECT_TRUE(await([&] { return gate.waiting_writers() == 1; }));
  note(1);
  gate.unlock_shared();
  writer.join();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST(generation_gate, new_generations_queue_behind_a_waiting_install) {
  generation_gate gate;
  std::atomic<int> step{0};
  gate.lock_shared();  // generation A runs
  std::thread writer([&] {
    std::unique_lock l(gate);
    int expected = 0;
    EXPECT_TRUE(step.compare_exchange_strong(expected, 1));  // before generation B
  });
  EXPECT_TRUE(await([&] { return gate.waiting_writers() == 1; }));
  std::thread late_reader([&] {
    std::shared_lock l(gate);  // generation B must not overtake the install
    EXPECT_EQ(step.load(), 1);
  });
  // B is held back while A still runs: a gate without writer preference would let it in.
  EXPECT_TRUE(await([&] { return gate.waiting_readers() == 1; }));
  EXPECT_EQ(gate.active_readers(), 1u);
  gate.unlock_shared();
  writer.join();
  late_reader.join();
  EXPECT_EQ(gate.active_readers(), 0u);
}

TEST(generation_gate, many_readers_share) {
  generation_gate gate;
  gate.lock_shared();
  std::thread other([&] {
    gate.lock_shared();
    EXPECT_EQ(gate.active_readers(), 2u);
    gate.unlock_shared();
  });
  other.join();
  gate.unlock_shared();
  EXPECT_EQ(gate.active_readers(), 0u);
}

}  // namespace
}  // namespace wsync
