#pragma once
// Transport halves that pass every call to another: the base of wrappers that change one or two
// calls (the Python bindings defer releases while views live; tests watch releases). A wrapper
// that derives from these and overrides only what it changes cannot hide a call the contract
// gains later: a forgotten memory() once made device memory look like host memory, and a
// forgotten intact() dropped the shared-memory ring's check for rewritten bytes.

#include <memory>
#include <utility>

#include "wsync/transports/transport.hpp"

namespace wsync {

class forwarding_publisher : public publisher_transport {
 public:
  explicit forwarding_publisher(std::shared_ptr<publisher_transport> inner)
      : inner_(std::move(inner)) {}

  memory_location memory() const override { return inner_->memory(); }
  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> segment_bytes,
                                                    std::chrono::milliseconds wait) override {
    return inner_->acquire(id, segment_bytes, wait);
  }
  result<void> consumers_set(const update_id& id,
                             std::span<const std::int32_t> consumers) override {
    return inner_->consumers_set(id, consumers);
  }
  bool can_lend() const override { return inner_->can_lend(); }
  result<void> lend(const update_id& id, std::span<const std::uint64_t> segment_bytes,
                    std::vector<lent_range> ranges) override {
    return inner_->lend(id, segment_bytes, std::move(ranges));
  }
  result<void> lent_wait(const update_id& id, std::chrono::milliseconds wait) override {
    return inner_->lent_wait(id, wait);
  }
  result<std::string> expose(const update_id& id) override { return inner_->expose(id); }
  result<void> announce(const weight_update_manifest& manifest) override {
    return inner_->announce(manifest);
  }
  void release(const update_id& id) override { inner_->release(id); }
  void closing() override { inner_->closing(); }

 protected:
  /// Shared, so that work a wrapper defers (a release) may outlive the wrapper.
  std::shared_ptr<publisher_transport> inner_;
};

class forwarding_consumer : public consumer_transport {
 public:
  explicit forwarding_consumer(std::shared_ptr<consumer_transport> inner)
      : inner_(std::move(inner)) {}

  memory_location memory() const override { return inner_->memory(); }
  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& manifest) override {
    return inner_->import_segments(manifest);
  }
  void release(const update_id& id) override { inner_->release(id); }
  result<void> intact(const update_id& id) const override { return inner_->intact(id); }
  void rank_set(std::int32_t rank) override { inner_->rank_set(rank); }
  std::string import_source(const update_id& id) const override {
    return inner_->import_source(id);
  }
  std::string relay_address() const override { return inner_->relay_address(); }
  void closing() override { inner_->closing(); }

 protected:
  /// Shared, so that work a wrapper defers (a release) may outlive the wrapper.
  std::shared_ptr<consumer_transport> inner_;
};

}  // namespace wsync
