// The torn-read detector on a GPU: reader threads run a CUDA kernel (the chunked checksum) over
// every tensor of the active weights, in place in the imported device slots, and compare each
// digest with the one the active update's manifest names, while hundreds of updates stream
// through a two-slot cuda-ipc or cuda-vmm pool that the publisher rewrites the moment a slot is
// released. A slot released (and rewritten) while it is still active, a switch readers saw
// half-way, a stale mapping or a version going back shows up as a digest that differs. Each
// reader waits for its kernel inside the generation step, so this does not test kernels still
// queued after a step ended (the release's wait on the legacy default stream covers those that
// run there). Without a CUDA device it skips with the reason.

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>

#include "pattern_tensors.hpp"
#include "releasing_transport.hpp"
#include "wsync/runtime/generation_gate.hpp"
#include "wsync/runtime/install_adapter.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

// An engine that reads its weights where they were imported: the active tensors are the device
// views themselves (zero-copy), so the import is held until the next activation.
class device_view_runtime final : public install_adapter {
 public:
  struct weights {
    std::uint64_t version = 0;
    update_id id;
    std::uint64_t chunk_bytes = 0;
    std::vector<gpu::device_range> ranges;
    std::vector<std::uint64_t> digests;  ///< what the manifest says each tensor hashes to
  };

  result<void> stage(std::span<const imported_update* const> shards) override {
    auto w = std::make_unique<weights>();
    w->version = shards[0]->manifest.weight_version;
    w->id = shards[0]->manifest.update_id;
    w->chunk_bytes = shards[0]->manifest.checksum_method.chunk_bytes;
    for (const auto* s : shards) {
      if (s->memory.host()) {
        return make_error(errc::install_failed,
                          "install failed: this runtime reads device memory (" + w->id + ")");
      }
      for (const auto& t : s->tensors) {
        w->ranges.push_back({t.data, t.descriptor->nbytes});
        w->digests.push_back(t.descriptor->checksum);
      }
    }
    std::lock_guard lock(mutex_);
    staged_ = std::move(w);
    return {};
  }
  void activate(const update_id& id) noexcept override {
    std::lock_guard lock(mutex_);
    if (staged_ && staged_->id == id) active_ = std::move(staged_);
  }
  void discard(const update_id& id) noexcept override {
    std::lock_guard lock(mutex_);
    if (staged_ && staged_->id == id) staged_.reset();
  }
  bool references_import() const override { return true; }
  bool deactivate() noexcept override {
    std::lock_guard lock(mutex_);
    active_.reset();
    return true;
  }

  generation_gate& gate() { return gate_; }

  /// One generation step under the shared side of the gate.
  template <class F>
  void generate(F&& fn) {
    std::shared_lock lock(gate_);
    fn(active_.get());  // nullptr before the first install
  }

 private:
  generation_gate gate_;
  std::mutex mutex_;
  std::unique_ptr<weights> active_;  // changes only in activate(), under the exclusive gate
  std::unique_ptr<weights> staged_;
};

class gpu_torn_read : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (auto r = gpu::ready(); !r) GTEST_SKIP() << r.error().message;
  }
};

TEST_P(gpu_torn_read, kernels_reading_the_active_weights_never_see_a_rewritten_slot) {
  constexpr std::uint64_t updates = 200;
  constexpr int readers = 2;
  constexpr std::size_t tensors = 8, words = std::size_t{1} << 17;  // 8 x 1 MiB
  auto t = make_transport(GetParam(), transport_options{{"slots", "2"}});
  ASSERT_TRUE(t) << t.error().message;
  auto p = (*t)->make_publisher();
  auto c = (*t)->make_consumer();
  ASSERT_TRUE(p && c);
  publisher_config cfg;
  cfg.model_id = "gpu-torn";
  cfg.slot_wait = std::chrono::seconds(30);
  cfg.checksum = {checksum_algorithm::xxh3_64_chunked, std::uint64_t{64} << 10};
  weight_publisher publisher(std::move(*p), std::string((*t)->name()), cfg);
  weight_consumer consumer(std::make_unique<test::releasing_transport>(std::move(*c), publisher),
                           consumer_config{0, 1});
  device_view_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());

  // The trainer's tensors live on the device; each version is written on the host and uploaded.
  test::pattern_tensors host(tensors, words);
  std::vector<gpu::device_buffer> device;
  std::vector<tensor_source> sources = host.sources();
  for (auto& s : sources) {
    auto b = gpu::device_buffer::make(s.nbytes);
    ASSERT_TRUE(b) << b.error().message;
    s.data = static_cast<const std::byte*>(b->data());
    s.cuda_device = 0;
    device.push_back(std::move(*b));
  }

  std::mutex queue_mutex;
  std::condition_variable queue_cv;
  std::deque<weight_update_manifest> queue;
  std::atomic<bool> trainer_failed{false};
  std::thread trainer([&] {
    auto fail = [&](const std::string& why) {
      ADD_FAILURE() << why;
      std::lock_guard l(queue_mutex);
      trainer_failed = true;
      queue_cv.notify_one();
    };
    for (std::uint64_t v = 1; v <= updates && !trainer_failed; ++v) {
      const auto& filled = host.fill(v);
      for (std::size_t i = 0; i < tensors; ++i) {
        if (auto ok = device[i].upload(filled[i].data, filled[i].nbytes); !ok) {
          return fail(ok.error().message);
        }
      }
      auto m = publisher.publish(sources, v, {0});
      if (!m) return fail(m.error().message);
      std::lock_guard l(queue_mutex);
      queue.push_back(*m);
      queue_cv.notify_one();
    }
  });

  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> torn{0}, generations{0}, versions_seen{0};
  std::vector<std::string> reader_errors(readers);
  std::vector<std::thread> threads;
  for (int k = 0; k < readers; ++k) {
    threads.emplace_back([&, k] {
      // One reader on the legacy default stream (what the import orders itself on), the other on
      // a stream of its own.
      auto s = gpu::stream::make(0);
      if (!s) {
        reader_errors[k] = s.error().message;
        done = true;  // the main thread waits for readers' generations at the end
        return;
      }
      void* on = k == 0 ? nullptr : s->handle();
      std::uint64_t last = 0;
      while (!done.load()) {
        rt.generate([&](const device_view_runtime::weights* w) {
          if (!w) return;
          if (w->version < last) torn.fetch_add(1);  // versions never go back
          if (w->version != last) versions_seen.fetch_add(1);
          last = w->version;
          auto sums = gpu::chunked_checksums(w->ranges, w->chunk_bytes, on);
          if (!sums) {
            reader_errors[k] = sums.error().message;
            done = true;
            return;
          }
          for (std::size_t i = 0; i < sums->size(); ++i) torn += (*sums)[i] != w->digests[i];
        });
        generations.fetch_add(1);
      }
    });
  }

  for (std::uint64_t v = 1; v <= updates; ++v) {
    weight_update_manifest m;
    {
      std::unique_lock l(queue_mutex);
      queue_cv.wait(l, [&] { return !queue.empty() || trainer_failed; });
      if (queue.empty()) break;
      m = std::move(queue.front());
      queue.pop_front();
    }
    auto r = ex.update_weights(m);
    if (!r.acknowledged) {
      ADD_FAILURE() << r.failure->message;
      trainer_failed = true;  // stops the trainer; the threads are joined below
      break;
    }
  }
  trainer.join();
  // Let the readers run over the last version too before stopping.
  auto seen = generations.load();
  while (!done && generations.load() < seen + readers) std::this_thread::yield();
  done = true;
  for (auto& th : threads) th.join();
  for (const auto& e : reader_errors) EXPECT_EQ(e, "");
  EXPECT_EQ(torn.load(), 0u) << "digests that differ over " << generations.load() << " generations";
  EXPECT_GT(versions_seen.load(), 1u);
  (void)ex.release_active();
  EXPECT_TRUE(publisher.held_updates().empty());
}

INSTANTIATE_TEST_SUITE_P(device, gpu_torn_read, ::testing::Values("cuda-ipc", "cuda-vmm"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& ch : n) ch = ch == '-' ? '_' : ch;
                           return n;
                         });

}  // namespace
}  // namespace wsync
