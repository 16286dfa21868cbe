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
};

class slot_pool {
 public:
  slot_pool(ucp_context_h ctx, std::string side, std::uint64_t max_slots)
      : ctx_(ctx), side_(std::move(side)), max_slots_(max_slots) {}
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
  std::uint64_t max_slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<slot>> slots_;
};

// Where each segment of an update lies in its slot (page-aligned), and in `*total` the bytes the
// slot needs.
std::vector<std::uint64_t> page_offsets(std::span<const std::uint64_t> sizes, std::uint64_t* total);

}  // namespace wsync::ucx_detail
