#pragma once
// The slot pool: pre-faulted memory registered once, a ring of slots on each side of a transfer.
// Internal to transports/ucx/.

#include <ucp/api/ucp.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync::ucx_detail {

struct slot {
  std::byte* base = nullptr;
  std::uint64_t capacity = 0;
  ucp_mem_h memh = nullptr;
  std::string rkey;  // packed once, hex
  update_id holder;  // empty when free
  // Operations still touching it: sends reading it, receives given up on that UCX may yet
  // complete into it. Reused only at 0, so a late write can never land in another update.
  std::uint64_t busy = 0;
  /// Since when it is free (no holder) yet busy: what counts towards pinned.
  std::chrono::steady_clock::time_point free_busy_since;
  update_id last_holder;   ///< for the log, once released
  bool set_aside = false;  ///< counted as pinned (and logged once)
};

class slot_pool {
 public:
  // A slot released but still busy after `pinned_after` is taken as pinned by an operation UCX
  // never ends (a receive matched to a source that died): the pool then makes a slot in its
  // place, up to `max_slots` more, instead of refusing every later update.
  slot_pool(ucp_context_h ctx, std::string side, std::uint64_t max_slots,
            std::chrono::milliseconds pinned_after)
      : ctx_(ctx), side_(std::move(side)), max_slots_(max_slots), pinned_after_(pinned_after) {}
  ~slot_pool();

  // A free slot of at least `need` bytes for `id`, created or grown on demand, waiting up to
  // `wait` for one to come free.
  result<slot*> acquire(const update_id& id, std::uint64_t need, std::chrono::milliseconds wait);

  void release(const update_id& id);

  void busy_begin(slot* s);
  void busy_end(slot* s);

 private:
  result<void> create(slot& s, std::uint64_t capacity);
  void destroy(slot& s);

  ucp_context_h ctx_;
  std::string side_;
  // How many slots may exist now: max_slots_ plus one per pinned slot (at most max_slots_
  // more). Logs a slot the first time it is counted; `next` is when another may become pinned.
  std::uint64_t room_locked(std::chrono::steady_clock::time_point now,
                            std::chrono::steady_clock::time_point& next);

  std::uint64_t max_slots_;
  std::chrono::milliseconds pinned_after_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<slot>> slots_;
};

// Where each segment of an update lies in its slot (page-aligned), and in `*total` the bytes the
// slot needs.
std::vector<std::uint64_t> page_offsets(std::span<const std::uint64_t> sizes, std::uint64_t* total);

}  // namespace wsync::ucx_detail
