#pragma once
// A small in-memory inference runtime for tests, benchmarks and the demo: it installs weights
// through the install_adapter contract and runs generation steps that read the active weights
// under the generation gate, like a real engine's forward pass would.

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "wsync/runtime/generation_gate.hpp"
#include "wsync/runtime/install_adapter.hpp"

namespace wsync {

/// One tensor of the active weights, as a generation step sees it.
struct runtime_tensor {
  std::string name;
  wsync::dtype dtype = wsync::dtype::f32;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
};

/// The weights readers see: one version, complete.
struct runtime_weights {
  std::uint64_t weight_version = 0;
  update_id id;
  std::vector<runtime_tensor> tensors;
};

class reference_runtime final : public install_adapter {
 public:
  /// view: active tensors point into the imported memory (zero-copy, double-buffered by the
  /// transport's slots). copy: stage() copies into the runtime's own inactive buffer.
  enum class install_mode { view, copy };

  explicit reference_runtime(install_mode mode = install_mode::view) : mode_(mode) {}

  result<void> stage(std::span<const imported_update* const> shards) override;
  void activate(const update_id& id) noexcept override;
  void discard(const update_id& id) noexcept override;
  /// Readers then see no weights, version 0, as before the first install (view mode).
  bool deactivate() noexcept override;
  /// After an activation: whether the active weights are views into the import (view mode with
  /// host shards; device shards are always copied to the host, and need not be held).
  bool references_import() const override { return !active_->copied; }

  generation_gate& gate() { return gate_; }

  /// `fn` must not enter the gate again (active_version(), another generate()) nor call into
  /// the rollout executor: with an install waiting, either deadlocks.
  /// Runs `fn(const runtime_weights&)` as one generation step: under the shared side of the
  /// gate, so it sees one complete version from start to end. Before any install the weights
  /// are empty with version 0.
  template <class F>
  decltype(auto) generate(F&& fn) {
    std::shared_lock lock(gate_);
    const runtime_weights& weights = active_->weights;
    return fn(weights);
  }

  /// Version readers see now (0 before the first install).
  std::uint64_t active_version();

 private:
  struct buffer_set {
    runtime_weights weights;
    std::vector<std::vector<std::byte>> storage;  // when copied
    bool copied = false;  // the tensors live in `storage`, not in the import
  };

  install_mode mode_;
  generation_gate gate_;
  std::mutex stage_mutex_;
  std::unique_ptr<buffer_set> active_ = std::make_unique<buffer_set>();
  std::unique_ptr<buffer_set> staged_;
  std::unique_ptr<buffer_set> spare_;  // copy mode: the previous buffers, reused
  // After deactivate(): the model's tensors (their data no longer valid, never read), which
  // the next stage() is checked against.
  std::vector<runtime_tensor> architecture_;
};

}  // namespace wsync
