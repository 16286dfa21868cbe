// The lease registry and the release-deferring transport wrappers (views.hpp).

#include "views.hpp"

#include <map>
#include <mutex>
#include <vector>

#include "wsync/transports/forwarding.hpp"

namespace wsync::py {
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

// Every call passes through; a release waits for the update's views.
class lease_aware_consumer final : public forwarding_consumer {
 public:
  using forwarding_consumer::forwarding_consumer;
  void release(const update_id& id) override {
    release_when_unviewed(id, [inner = inner_, id] { inner->release(id); });
  }
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
