// The torn-read detector: reader threads check, generation after generation, that every tensor
// of the active weights carries the pattern of the version the runtime says is active, while
// hundreds of updates stream through a two-slot shared-memory ring that rewrites each slot as
// soon as it is released. Any early release, late switch or torn install shows up as a mismatch.

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "pattern_tensors.hpp"
#include "releasing_transport.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

struct torn_case {
  const char* transport;
  reference_runtime::install_mode mode;
};

class torn_read : public ::testing::TestWithParam<torn_case> {};

TEST_P(torn_read, readers_never_see_a_mixed_model) {
  constexpr std::uint64_t updates = 300;
  constexpr int readers = 2;
  auto t = make_transport(GetParam().transport, std::string(GetParam().transport) == "shared-memory"
                                                    ? transport_options{{"slots", "2"}}
                                                    : transport_options{});
  ASSERT_TRUE(t);
  auto p = (*t)->make_publisher();
  auto c = (*t)->make_consumer();
  ASSERT_TRUE(p && c);
  publisher_config cfg;
  cfg.model_id = "torn";
  cfg.slot_wait = std::chrono::seconds(30);
  weight_publisher publisher(std::move(*p), std::string((*t)->name()), cfg);
  weight_consumer consumer(std::make_unique<test::releasing_transport>(std::move(*c), publisher),
                           consumer_config{0, 1});
  reference_runtime rt(GetParam().mode);
  rollout_executor ex(consumer, rt, rt.gate());
  test::pattern_tensors tensors(8, 4096);  // 8 x 32 KiB

  // The trainer publishes as fast as slots come free, while the consumer installs: the
  // publisher rewrites a slot the instant the consumer releases it.
  std::mutex queue_mutex;
  std::condition_variable queue_cv;
  std::deque<weight_update_manifest> queue;
  bool trainer_stopped = false;  // queue_mutex
  // A failure on either side stops both and reaches the test's end, where every thread is
  // joined: a failed assertion must report, not hang or terminate.
  std::atomic<bool> failed{false};
  std::thread trainer([&] {
    for (std::uint64_t v = 1; v <= updates && !failed; ++v) {
      auto m = publisher.publish(tensors.fill(v), v, {0});
      std::lock_guard l(queue_mutex);
      if (!m) {
        ADD_FAILURE() << "publish " << v << ": " << m.error().message;
        failed = true;
      } else {
        queue.push_back(*m);
      }
      queue_cv.notify_one();
    }
    std::lock_guard l(queue_mutex);
    trainer_stopped = true;
    queue_cv.notify_one();
  });

  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> torn{0}, reads{0}, versions_seen{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < readers; ++k) {
    threads.emplace_back([&] {
      std::uint64_t last = 0;
      while (!done.load()) {
        rt.generate([&](const runtime_weights& w) {
          if (w.weight_version < last) torn.fetch_add(1);  // versions never go back
          if (w.weight_version != last) versions_seen.fetch_add(1);
          last = w.weight_version;
          for (std::size_t i = 0; i < w.tensors.size(); ++i) {
            torn.fetch_add(test::pattern_mismatches(w.tensors[i].data, w.tensors[i].nbytes,
                                                    w.weight_version, i));
          }
        });
        reads.fetch_add(1);
      }
    });
  }
  for (std::uint64_t v = 1; v <= updates && !failed; ++v) {
    weight_update_manifest m;
    {
      std::unique_lock l(queue_mutex);
      queue_cv.wait(l, [&] { return !queue.empty() || trainer_stopped; });
      if (queue.empty()) break;
      m = std::move(queue.front());
      queue.pop_front();
    }
    auto r = ex.update_weights(m);
    if (!r.acknowledged) {
      ADD_FAILURE() << "update " << v << ": " << (r.failure ? r.failure->message : "no reason");
      failed = true;
    }
  }
  trainer.join();
  // Let readers look at the last version too before stopping.
  auto seen = reads.load();
  while (reads.load() < seen + readers) std::this_thread::yield();
  done = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(torn.load(), 0u) << "torn words over " << reads.load() << " generations";
  EXPECT_GT(versions_seen.load(), 0u);
  if (failed) return;
  EXPECT_EQ(rt.active_version(), updates);
  (void)ex.release_active();
  EXPECT_TRUE(publisher.held_updates().empty());
}

INSTANTIATE_TEST_SUITE_P(
    transports, torn_read,
    ::testing::Values(torn_case{"shared-memory", reference_runtime::install_mode::view},
                      torn_case{"shared-memory", reference_runtime::install_mode::copy},
                      torn_case{"local-clone", reference_runtime::install_mode::view}),
    [](const auto& param_info) {
      std::string n =
          std::string(param_info.param.transport) +
          (param_info.param.mode == reference_runtime::install_mode::view ? "_view" : "_copy");
      for (auto& ch : n) ch = ch == '-' ? '_' : ch;
      return n;
    });

}  // namespace
}  // namespace wsync
