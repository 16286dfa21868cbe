#pragma once
// The two halves of the ucx transport, each owning one node: the publisher exposes updates from
// its slots, the consumer pulls them into its own (and serves them on as a relay). Definitions in
// publisher.cpp and consumer.cpp. Internal to transports/ucx/.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ucx/node.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync::ucx_detail {

// --- publisher half -----------------------------------------------------------------------------

class ucx_publisher final : public publisher_transport {
 public:
  explicit ucx_publisher(std::unique_ptr<node> n);

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds wait) override;
  result<std::string> expose(const update_id& id) override;
  void release(const update_id& id) override;

 private:
  struct held {
    slot* s;
    std::vector<std::uint64_t> offsets, nbytes;
  };
  std::unique_ptr<node> node_;
  process_id self_;  // this process, named in handles (see process_id)
  std::mutex mutex_;
  std::map<update_id, held> updates_;
};

// --- consumer half ------------------------------------------------------------------------------

class ucx_consumer final : public consumer_transport {
 public:
  explicit ucx_consumer(std::unique_ptr<node> n) : node_(std::move(n)) {}

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override;

  void release(const update_id& id) override { drop(id); }

  std::string relay_address() const override { return node_->address(); }

 private:
  void drop(const update_id& id);

  std::unique_ptr<node> node_;
};

}  // namespace wsync::ucx_detail
