#pragma once
// How imported memory reaches Python without a copy, and why it never vanishes under a view.
//
// An import hands Python one `segment` object per segment: it exposes the bytes through the
// buffer protocol (read-only) and holds a `view_lease` on the update. torch.frombuffer keeps the
// segment object alive as long as any tensor made from it. While an update has a live lease,
// a release of that update — by its consumer or by a publisher in the same process — is
// deferred: it happens when the last lease goes. So a view reads the bytes of its own version
// until the program drops it; it never reads unmapped or reused memory.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "wsync/transports/transport.hpp"

namespace wsync::py {

/// Whether the interpreter is shutting down (no thread may take the GIL again).
bool interpreter_finalizing();

/// Keeps the releases of one update waiting while it exists.
class view_lease {
 public:
  explicit view_lease(update_id id);
  ~view_lease();
  view_lease(const view_lease&) = delete;
  view_lease& operator=(const view_lease&) = delete;
  const update_id& id() const { return id_; }

 private:
  update_id id_;
};

/// Runs `release` now when `id` has no live lease, else when its last lease goes. Returns true
/// when it ran now.
bool release_when_unviewed(const update_id& id, std::function<void()> release);

/// Updates whose release waits for views (for status and tests).
std::vector<update_id> releases_pending();

/// Wraps a transport half so that its release() waits for the update's views.
std::unique_ptr<consumer_transport> lease_aware(std::unique_ptr<consumer_transport> inner);
std::unique_ptr<publisher_transport> lease_aware(std::unique_ptr<publisher_transport> inner);

/// One imported segment as Python sees it (buffer protocol, read-only).
struct segment {
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  std::shared_ptr<view_lease> lease;
};

/// One imported segment in CUDA device memory: no buffer protocol (Python must not read it as
/// host bytes); torch views it through __cuda_array_interface__, which holds the object, and so
/// the lease, as long as any tensor made from it.
struct device_segment {
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  int device = 0;
  std::shared_ptr<view_lease> lease;
};

}  // namespace wsync::py
