#include "ucx/slot_pool.hpp"

#include <sys/mman.h>

#include <algorithm>

#include "ucx/ucx_common.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::ucx_detail {

slot_pool::~slot_pool() {
  for (auto& s : slots_) destroy(*s);
}

result<slot*> slot_pool::acquire(const update_id& id, std::uint64_t need,
                                 std::chrono::milliseconds wait) {
  need = std::max(need, page);
  std::unique_lock lock(mutex_);
  auto deadline = clock_type::now() + wait;
  while (true) {
    slot* fit = nullptr;
    slot* small = nullptr;
    for (auto& s : slots_) {
      if (!s->holder.empty() || s->busy) continue;
      if (s->capacity >= need && (!fit || s->capacity < fit->capacity)) fit = s.get();
      if (s->capacity < need) small = s.get();
    }
    auto next_pinned = deadline;
    const auto room = room_locked(clock_type::now(), next_pinned);
    if (!fit && (slots_.size() < room || small)) {
      if (!small) small = slots_.emplace_back(std::make_unique<slot>()).get();
      // Made with the lock let go: faulting a large slot in takes seconds, and the node's
      // thread takes this lock to serve every chunk (it would stall every transfer meanwhile).
      // The holder keeps the slot this caller's until then.
      small->holder = id;
      lock.unlock();
      destroy(*small);
      auto ok = create(*small, align_up(need + need / 8, slot_quantum));
      lock.lock();
      if (!ok) {
        small->holder.clear();
        cv_.notify_all();
        return make_error(ok.error().code, ok.error().message + " (update_id=" + id + ")");
      }
      return small;
    }
    if (fit) {
      fit->holder = id;
      return fit;
    }
    // Woken by a release, or when a busy slot would count as pinned.
    if (cv_.wait_until(lock, std::min(deadline, next_pinned)) == std::cv_status::timeout &&
        clock_type::now() >= deadline) {
      return make_error(errc::timeout, "ucx: no free " + side_ + " slot for update_id=" + id +
                                           " after " + std::to_string(wait.count()) + " ms: all " +
                                           std::to_string(slots_.size()) +
                                           " slots hold updates not yet released (option "
                                           "slots=" +
                                           std::to_string(max_slots_) + ")");
    }
  }
}

std::uint64_t slot_pool::room_locked(clock_type::time_point now, clock_type::time_point& next) {
  std::uint64_t pinned = 0;
  for (auto& s : slots_) {
    if (!s->holder.empty() || s->busy == 0) continue;
    if (now - s->free_busy_since < pinned_after_) {
      next = std::min(next, s->free_busy_since + pinned_after_);
      continue;
    }
    ++pinned;
    if (s->set_aside) continue;
    s->set_aside = true;
    log_warn("ucx: " + side_ + " slot of " + std::to_string(s->capacity) +
             " bytes (last held by update_id=" + s->last_holder + ") is still used by " +
             std::to_string(s->busy) + " transfer(s) " +
             std::to_string(
                 std::chrono::duration_cast<std::chrono::milliseconds>(now - s->free_busy_since)
                     .count()) +
             " ms after its release, which UCX has not ended; it is set aside, and a new slot "
             "may be made in its place (at most " +
             std::to_string(max_slots_) + " more than option slots)");
  }
  return max_slots_ + std::min(pinned, max_slots_);
}

void slot_pool::release(const update_id& id) {
  std::lock_guard lock(mutex_);
  for (auto& s : slots_) {
    if (s->holder == id) {
      s->holder.clear();
      s->last_holder = id;
      s->free_busy_since = clock_type::now();  // counts only while busy
    }
  }
  cv_.notify_all();
}

void slot_pool::busy_begin(slot* s) {
  std::lock_guard lock(mutex_);
  if (s->busy++ == 0 && s->holder.empty()) s->free_busy_since = clock_type::now();
}

void slot_pool::busy_end(slot* s) {
  std::lock_guard lock(mutex_);
  if (--s->busy != 0) return;
  if (s->set_aside) {
    s->set_aside = false;
    log_info("ucx: " + side_ + " slot set aside is free again (its last transfer ended)");
    // One made in its place is there now: past the ring's size, this one's memory goes.
    if (s->holder.empty() && slots_.size() > max_slots_) {
      destroy(*s);
      slots_.erase(
          std::find_if(slots_.begin(), slots_.end(), [&](const auto& p) { return p.get() == s; }));
    }
  }
  cv_.notify_all();
}

// Allocates, registers and pre-faults one slot: fresh pages cost ~0.3 GB/s to fault in here
// and a registration is not free either, so both happen once per slot, never per update.
// UCX allocates the memory itself: over shared-memory transports it then lives in a segment a
// peer on the same host can map, and an RMA get is a plain memcpy (~2x process_vm_readv).
result<void> slot_pool::create(slot& s, std::uint64_t capacity) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = nullptr;
  mp.length = capacity;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  auto made = [&]() -> result<void> {
    WSYNC_UCX_CHECK(ucp_mem_map(ctx_, &mp, &s.memh),
                    side_ + " slot of " + std::to_string(capacity) + " bytes");
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    WSYNC_UCX_CHECK(ucp_mem_query(s.memh, &attr), side_ + " slot");
    s.base = static_cast<std::byte*>(attr.address);
    s.capacity = capacity;
    // Huge pages where the kernel gives them to this memory (faulting in is ~30x faster).
    (void)::madvise(attr.address, capacity, MADV_HUGEPAGE);
    if (::madvise(attr.address, capacity, MADV_POPULATE_WRITE) != 0) {
      for (std::uint64_t off = 0; off < capacity; off += page) {
        static_cast<volatile std::byte*>(attr.address)[off] = std::byte{0};
      }
    }
    void* rkey = nullptr;
    std::size_t rkey_bytes = 0;
    WSYNC_UCX_CHECK(ucp_rkey_pack(ctx_, s.memh, &rkey, &rkey_bytes), side_ + " slot");
    s.rkey = hex_encode(rkey, rkey_bytes);
    ucp_rkey_buffer_release(rkey);
    return {};
  }();
  if (!made) destroy(s);
  return made;
}

void slot_pool::destroy(slot& s) {
  if (s.memh) ucp_mem_unmap(ctx_, s.memh);  // frees the memory UCX allocated
  s.memh = nullptr;
  s.base = nullptr;
  s.capacity = 0;
  s.rkey.clear();
}

std::vector<std::uint64_t> page_offsets(std::span<const std::uint64_t> sizes,
                                        std::uint64_t* total) {
  std::vector<std::uint64_t> offsets;
  std::uint64_t at = 0;
  for (auto n : sizes) {
    offsets.push_back(at);
    at = align_up(at + n, page);
  }
  *total = at;
  return offsets;
}

}  // namespace wsync::ucx_detail
