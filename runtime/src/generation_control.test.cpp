#include "wsync/runtime/generation_control.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

namespace wsync {
namespace {

using namespace std::chrono_literals;

TEST(generation_control, parses_the_three_modes_and_nothing_else) {
  EXPECT_EQ(pause_mode_parse("abort"), pause_mode::abort);
  EXPECT_EQ(pause_mode_parse("wait"), pause_mode::wait);
  EXPECT_EQ(pause_mode_parse("keep"), pause_mode::keep);
  EXPECT_EQ(pause_mode_parse("Keep"), std::nullopt);
  EXPECT_EQ(pause_mode_parse(""), std::nullopt);
}

TEST(generation_control, abort_ends_in_flight_generations_and_returns_when_none_is_left) {
  generation_control c;
  std::atomic<int> steps{0};
  auto gen = std::async(std::launch::async, [&] {
    generation_scope g(c);
    while (g.step() == generation_status::running) ++steps;  // runs until aborted
    return steps.load();
  });
  while (steps < 3) std::this_thread::yield();
  EXPECT_TRUE(c.pause(pause_mode::abort));  // returns only once the generation ended
  EXPECT_EQ(c.in_flight(), 0u);
  EXPECT_GE(gen.get(), 3);
  EXPECT_TRUE(c.paused());
}

// One generation on its own thread, in flight once made, stepping until finish(): get() says
// whether every step ran (false: an abort caught it).
class running_generation {
 public:
  explicit running_generation(generation_control& c) {
    auto began = started_.get_future();
    done_ = std::async(std::launch::async, [this, &c] {
      generation_scope g(c);
      started_.set_value();
      while (!finish_) {
        if (g.step() != generation_status::running) return false;
      }
      return true;
    });
    began.wait();
  }
  ~running_generation() {  // a failed expectation must not leave it stepping for ever
    finish_ = true;
    if (done_.valid()) done_.wait();
  }
  void finish() { finish_ = true; }
  bool get() { return done_.get(); }

 private:
  std::promise<void> started_;
  std::atomic<bool> finish_{false};
  std::future<bool> done_;
};

TEST(generation_control, wait_lets_in_flight_generations_finish) {
  generation_control c;
  running_generation gen(c);
  auto pausing = std::async(std::launch::async, [&] { return c.pause(pause_mode::wait); });
  EXPECT_EQ(pausing.wait_for(50ms), std::future_status::timeout);  // still draining
  gen.finish();
  EXPECT_TRUE(pausing.get());
  EXPECT_TRUE(gen.get());  // never aborted
  EXPECT_EQ(c.in_flight(), 0u);
}

TEST(generation_control, a_second_pause_returns_only_once_the_first_ones_promise_holds) {
  generation_control c;
  running_generation gen(c);
  auto first = std::async(std::launch::async, [&] { return c.pause(pause_mode::wait); });
  while (!c.paused()) std::this_thread::yield();
  // A retry, or another caller: it may update once this returns, so it waits for the drain
  // like the first, and its own mode (keep) changes nothing.
  auto retry = std::async(std::launch::async, [&] { return c.pause(pause_mode::keep); });
  EXPECT_EQ(retry.wait_for(50ms), std::future_status::timeout);
  EXPECT_EQ(c.in_flight(), 1u);
  gen.finish();
  EXPECT_TRUE(retry.get());
  EXPECT_TRUE(first.get());
  EXPECT_TRUE(gen.get());  // it ran to completion: a keep pause would have held it
  EXPECT_EQ(c.in_flight(), 0u);
}

TEST(generation_control, a_resume_before_the_pause_took_hold_makes_it_say_so) {
  generation_control c;
  running_generation gen(c);
  auto pausing = std::async(std::launch::async, [&] { return c.pause(pause_mode::wait); });
  while (!c.paused()) std::this_thread::yield();
  c.resume();
  EXPECT_FALSE(pausing.get());  // the generation still runs: the pause's promise never held
  gen.finish();
  EXPECT_TRUE(gen.get());
}

TEST(generation_control, keep_holds_in_flight_generations_until_resume) {
  generation_control c;
  std::atomic<int> steps{0};
  std::atomic<bool> stop{false};
  auto gen = std::async(std::launch::async, [&] {
    generation_scope g(c);
    while (!stop) {
      if (g.step() != generation_status::running) return false;
      ++steps;
    }
    return true;
  });
  while (steps < 1) std::this_thread::yield();
  EXPECT_TRUE(c.pause(pause_mode::keep));  // returns once the generation holds
  int held_at = steps;
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(steps, held_at);  // no step while paused
  EXPECT_EQ(c.in_flight(), 1u);
  c.resume();
  while (steps < held_at + 2) std::this_thread::yield();
  stop = true;
  EXPECT_TRUE(gen.get());  // it completed: never aborted
}

TEST(generation_control, a_generation_that_begins_while_paused_waits_for_resume) {
  generation_control c;
  EXPECT_TRUE(c.pause(pause_mode::abort));
  std::atomic<bool> began{false};
  auto gen = std::async(std::launch::async, [&] {
    generation_scope g(c);
    began = true;
    return g.step();
  });
  EXPECT_EQ(gen.wait_for(30ms), std::future_status::timeout);
  EXPECT_FALSE(began);
  c.resume();
  EXPECT_EQ(gen.get(), generation_status::running);  // the earlier abort does not catch it
}

TEST(generation_control, pausing_twice_changes_nothing) {
  generation_control c;
  std::atomic<int> steps{0};
  std::atomic<bool> stop{false};
  auto gen = std::async(std::launch::async, [&] {
    generation_scope g(c);
    while (!stop) {
      if (g.step() != generation_status::running) return -1;
      ++steps;
    }
    return steps.load();
  });
  while (steps < 3) std::this_thread::yield();
  EXPECT_TRUE(c.pause(pause_mode::keep));   // returns once the generation holds
  EXPECT_TRUE(c.pause(pause_mode::abort));  // already paused: must neither abort nor change mode
  EXPECT_TRUE(c.paused());
  EXPECT_EQ(c.in_flight(), 1u);
  c.resume();
  EXPECT_FALSE(c.paused());
  const int held_at = steps;
  while (steps < held_at + 3 && gen.wait_for(0s) != std::future_status::ready) {
    std::this_thread::yield();  // goes on after the resume (or ended: an abort, checked below)
  }
  stop = true;
  EXPECT_GE(gen.get(), held_at + 3);  // never aborted
}

TEST(generation_control, abort_and_hold_ends_held_and_waiting_generations_and_keeps_a_pause) {
  generation_control c;
  std::atomic<int> steps{0};
  auto held = std::async(std::launch::async, [&] {
    generation_scope g(c);
    while (g.step() == generation_status::running) ++steps;
    return steps.load();
  });
  while (steps < 1) std::this_thread::yield();
  EXPECT_TRUE(c.pause(pause_mode::keep));  // `held` holds at its next step
  auto waiting = std::async(std::launch::async, [&] {
    generation_scope g(c);  // begins while paused: waits
    return g.step();
  });
  EXPECT_EQ(waiting.wait_for(20ms), std::future_status::timeout);

  c.abort_and_hold();  // returns once `held` ended
  EXPECT_GE(held.get(), 1);
  EXPECT_EQ(waiting.get(), generation_status::aborted);  // never ran a step
  EXPECT_TRUE(c.paused());                               // the pause is not the hold's

  // While held nothing begins, paused or not; a pause made meanwhile stays after release.
  c.resume();
  auto later = std::async(std::launch::async, [&] {
    generation_scope g(c);
    return g.step();
  });
  EXPECT_EQ(later.wait_for(20ms), std::future_status::timeout);
  EXPECT_TRUE(c.pause(pause_mode::wait));  // (an abort pause would end `later`: it waits to begin)
  c.release_hold();
  EXPECT_EQ(later.wait_for(20ms), std::future_status::timeout);  // still paused
  EXPECT_TRUE(c.paused());
  c.resume();
  EXPECT_EQ(later.get(), generation_status::running);
}

TEST(generation_control, close_ends_every_generation_and_refuses_later_ones) {
  generation_control c;
  EXPECT_TRUE(c.pause(pause_mode::keep));
  auto waiting = std::async(std::launch::async, [&] {
    generation_scope g(c);
    return g.step();
  });
  EXPECT_EQ(waiting.wait_for(20ms), std::future_status::timeout);
  c.close();  // a pause nobody lifts does not keep it waiting
  EXPECT_EQ(waiting.get(), generation_status::aborted);
  EXPECT_EQ(c.in_flight(), 0u);
  c.resume();
  generation_scope late(c);
  EXPECT_EQ(late.step(), generation_status::aborted);
}

}  // namespace
}  // namespace wsync
