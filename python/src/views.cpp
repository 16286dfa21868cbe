// The lease registry and the release-deferring transport wrappers (views.hpp).

#include "views.hpp"

#include <Python.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "common.hpp"
#include "wsync/transports/forwarding.hpp"

namespace wsync::py {

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

namespace {

struct registry {
  std::mutex mutex;
  std::map<update_id, std::size_t> live;  ///< leases per update
  std::map<update_id, std::vector<std::function<void()>>> waiting;
};

registry& leases() {
  static registry* r = new registry;  // never destroyed: leases may die at interpreter exit
  return *r;
}

// Every call passes through; a release waits for the update's views. Until it ran, the same
// update cannot be imported again: the transports key their imports by update id, so a second
// import would replace (local-clone: free) or double-count (shared-memory) what the live views
// of the first still read.
class lease_aware_consumer final : public forwarding_consumer {
 public:
  using forwarding_consumer::forwarding_consumer;

  void rank_set(std::int32_t rank) override {
    rank_ = rank;
    inner_->rank_set(rank);
  }

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    {
      std::lock_guard lock(deferred_->mutex);
      if (deferred_->ids.count(m.update_id) > 0) {
        return make_error(errc::illegal_transition,
                          "cannot import update " + m.update_id +
                              " again: it was released while tensors viewing its first import "
                              "are still alive; drop them first (" +
                              update_context(m.update_id, rank_) + ")");
      }
    }
    return inner_->import_segments(m);
  }

  void release(const update_id& id) override {
    {
      std::lock_guard lock(deferred_->mutex);
      deferred_->ids.insert(id);
    }
    release_when_unviewed(id, [inner = inner_, deferred = deferred_, id] {
      inner->release(id);
      std::lock_guard lock(deferred->mutex);
      deferred->ids.erase(id);
    });
  }

 private:
  struct pending {
    std::mutex mutex;
    std::set<update_id> ids;  ///< released, the release waiting for views
  };
  std::shared_ptr<pending> deferred_ = std::make_shared<pending>();
  std::int32_t rank_ = -1;
};

class lease_aware_publisher final : public forwarding_publisher {
 public:
  using forwarding_publisher::forwarding_publisher;
  void release(const update_id& id) override {
    release_when_unviewed(id, [inner = inner_, id] { inner->release(id); });
  }
};

}  // namespace

view_lease::view_lease(update_id id) : id_(std::move(id)) {
  auto& r = leases();
  std::lock_guard lock(r.mutex);
  ++r.live[id_];
}

view_lease::~view_lease() {
  std::vector<std::function<void()>> run;
  {
    auto& r = leases();
    std::lock_guard lock(r.mutex);
    auto it = r.live.find(id_);
    if (it == r.live.end() || --it->second > 0) return;
    r.live.erase(it);
    if (auto w = r.waiting.find(id_); w != r.waiting.end()) {
      run = std::move(w->second);
      r.waiting.erase(w);
    }
  }
  if (run.empty()) return;
  // The last view usually dies in Python (a tensor's deleter), holding the GIL; a device
  // release synchronises a stream. Other Python threads go on meanwhile: the releases touch
  // no Python object.
  // Only where this thread surely holds the GIL through its own thread state (not while the
  // interpreter shuts down, where saving it could be fatal).
  const bool finalizing = interpreter_finalizing();
#if PY_VERSION_HEX >= 0x030D0000
  PyThreadState* current = PyThreadState_GetUnchecked();
#else
  PyThreadState* current = _PyThreadState_UncheckedGet();
#endif
  const bool holds = Py_IsInitialized() && !finalizing && current != nullptr &&
                     PyGILState_GetThisThreadState() == current && PyGILState_Check();
  std::optional<gil_released> unlocked;  // parks if the shutdown starts during the release
  if (holds) unlocked.emplace();
  for (auto& f : run) f();  // outside the lock: a release may take a while
}

bool release_when_unviewed(const update_id& id, std::function<void()> release) {
  {
    auto& r = leases();
    std::lock_guard lock(r.mutex);
    if (r.live.count(id) > 0) {
      r.waiting[id].push_back(std::move(release));
      return false;
    }
  }
  release();
  return true;
}

std::vector<update_id> releases_pending() {
  auto& r = leases();
  std::lock_guard lock(r.mutex);
  std::vector<update_id> out;
  for (const auto& [id, fns] : r.waiting) out.push_back(id);
  return out;
}

std::unique_ptr<consumer_transport> lease_aware(std::unique_ptr<consumer_transport> inner) {
  return std::make_unique<lease_aware_consumer>(std::move(inner));
}

std::unique_ptr<publisher_transport> lease_aware(std::unique_ptr<publisher_transport> inner) {
  return std::make_unique<lease_aware_publisher>(std::move(inner));
}

}  // namespace wsync::py
