#pragma once
// A vLLM NCCL trainer in host memory, for tests on machines without a GPU: it plays rank 0 of the
// group behind a broadcast_endpoint. Its broadcasts are what a trainer sends for a list of
// tensors (one each, or vLLM's packed groups, packed here independently of
// transports/nccl/plan.hpp); queued work runs in order at wait(), as on a CUDA stream, so a
// receiver that reads a buffer before waiting sees stale bytes.

#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "wsync/manifest/checksum.hpp"
#include "wsync/transports/nccl_receiver.hpp"

namespace wsync::testing {

/// The broadcasts a vLLM trainer makes for `tensors` (names order): each tensor, or packed:
/// tensors appended to a buffer that goes out once it holds more than `buffer_bytes`.
inline std::deque<std::vector<std::byte>> trainer_broadcasts(
    const std::vector<std::vector<std::byte>>& tensors, bool packed, std::uint64_t buffer_bytes) {
  std::deque<std::vector<std::byte>> out;
  if (!packed) {
    for (const auto& t : tensors) out.push_back(t);
    return out;
  }
  std::vector<std::byte> buffer;
  bool open = false;
  for (const auto& t : tensors) {
    buffer.insert(buffer.end(), t.begin(), t.end());
    open = true;
    if (buffer.size() > buffer_bytes) {
      out.push_back(std::move(buffer));
      buffer.clear();
      open = false;
    }
  }
  if (open) out.push_back(std::move(buffer));
  return out;
}

class host_trainer final : public nccl::broadcast_endpoint {
 public:
  /// What rank 0 will broadcast, in order; tests append to it.
  std::deque<std::vector<std::byte>> sends;
  std::size_t receives_done = 0;
  std::uint64_t allocated_bytes = 0;
  int allocations_left = -1;  ///< allocate() fails once this reaches 0 (-1: never)
  /// With nothing left to send: wait, as NCCL would for a trainer that is gone, until the
  /// receive's deadline or `cancel` (the flag the join was handed) ends it.
  bool hang_when_empty = false;
  const std::atomic<bool>* cancel = nullptr;
  std::atomic<bool> hanging{false};  ///< a receive is waiting so (for tests to wait on)
  /// What a test may still read once the rank dropped the group (and this trainer with it).
  struct ending {
    std::size_t receives_done = 0;
    std::string aborted;  ///< why the group was aborted; empty: it was not
  };
  ending* on_end = nullptr;  ///< filled in by the destructor

  ~host_trainer() override {
    if (on_end) *on_end = {receives_done, aborted_};
  }

  memory_location memory() const override { return {}; }

  result<nccl::block> allocate(std::uint64_t nbytes) override {
    if (allocations_left == 0) return make_error(errc::io_error, "out of device memory (test)");
    if (allocations_left > 0) --allocations_left;
    auto v = std::make_shared<std::vector<std::byte>>(nbytes, std::byte{0xee});
    allocated_bytes += nbytes;
    return nccl::block{v->data(), nbytes, v};
  }

  result<void> receive(std::span<std::byte> into,
                       std::chrono::steady_clock::time_point deadline) override {
    if (!aborted_.empty()) return make_error(errc::io_error, "aborted: " + aborted_);
    queue_.push_back([this, into, deadline]() -> result<void> {
      while (sends.empty() && hang_when_empty && std::chrono::steady_clock::now() < deadline) {
        hanging = true;
        if (cancel && cancel->load()) return fail(errc::io_error, "cancelled");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (sends.empty()) {
        return fail(errc::timeout, "rank 0 sent nothing more; the receive missed its deadline");
      }
      auto bytes = std::move(sends.front());
      sends.pop_front();
      if (bytes.size() != into.size()) {
        return fail(errc::io_error, "rank 0 broadcast " + std::to_string(bytes.size()) +
                                        " bytes where " + std::to_string(into.size()) +
                                        " were posted");
      }
      if (!bytes.empty()) std::memcpy(into.data(), bytes.data(), bytes.size());
      ++receives_done;
      return {};
    });
    return {};
  }

  result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) override {
    if (!aborted_.empty()) return make_error(errc::io_error, "aborted: " + aborted_);
    queue_.push_back([=]() -> result<void> {
      if (nbytes > 0) std::memcpy(dst, src, nbytes);
      return {};
    });
    return {};
  }

  result<void> wait(std::chrono::steady_clock::time_point) override {
    if (!aborted_.empty()) return make_error(errc::io_error, "aborted: " + aborted_);
    while (!queue_.empty()) {
      auto step = std::move(queue_.front());
      queue_.pop_front();
      if (auto r = step(); !r) return r;
    }
    return {};
  }

  result<std::vector<std::uint64_t>> checksums(std::span<const std::span<const std::byte>> ranges,
                                               const checksum_method& method) override {
    std::vector<std::uint64_t> out;
    for (const auto& r : ranges) out.push_back(checksum_compute(r.data(), r.size(), method));
    return out;
  }

  void abort(const std::string& why) override {
    if (aborted_.empty()) aborted_ = why;
    queue_.clear();
  }
  std::string broken() const override { return aborted_; }
  std::string describe() const override { return "host trainer (rank 1 of 2)"; }

 private:
  error fail(errc code, const std::string& why) {
    aborted_ = why;
    queue_.clear();
    return {code, why};
  }

  std::deque<std::function<result<void>()>> queue_;
  std::string aborted_;
};

}  // namespace wsync::testing
