#pragma once
// A shared-memory slot: its header, how it is made, mapped and given back, and the sweep of
// slots whose owner is gone (shared_memory.hpp's public functions, in slot.cpp).

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync::shared_memory_detail {

constexpr std::uint64_t page = 4096;
constexpr std::uint64_t header_bytes = page;
constexpr std::uint64_t huge_page = std::uint64_t{2} << 20;
constexpr std::uint64_t capacity_quantum = huge_page;
constexpr char magic[8] = {'W', 'S', 'Y', 'N', 'C', 'S', 'L', 'T'};

constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

// First page of every slot: who owns it (for the orphan sweep) and which exposure it holds (so a
// consumer never imports a slot that was already rewritten for a newer update).
struct slot_header {
  char magic[8];
  std::uint32_t layout;
  std::int32_t owner_pid;
  std::uint64_t owner_start;  // start time of owner_pid, /proc/<pid>/stat field 22
  std::uint64_t capacity;     // data bytes after the header
  std::atomic<std::uint64_t> generation;
  std::uint64_t owner_pidns;  // PID namespace of owner_pid (0: unknown, an older slot)
};
static_assert(sizeof(slot_header) <= header_bytes);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

std::string errno_text(int err);

// Maps `bytes` of `fd` from offset 0 at a 2 MiB-aligned address, so that every 2 MiB page of the
// object can be mapped whole (one PMD entry instead of 512 PTEs). MAP_FAILED with errno on failure.
void* map_aligned(int fd, std::uint64_t bytes, int prot, int flags);

struct slot {
  std::string name;  // without the leading '/'
  std::byte* base = nullptr;
  std::uint64_t map_bytes = 0;
  std::uint64_t capacity = 0;
  int fd = -1;       ///< the publisher's own open file description: its flock claims the slot
  update_id holder;  // empty when free
  std::vector<std::uint64_t> offsets;
  slot_header* header() const { return reinterpret_cast<slot_header*>(base); }
};

// Unmaps and unlinks the slot; it is empty afterwards (a later slot_create may fill it again).
void slot_destroy(slot& s);

// Creates, sizes, maps and pre-faults one slot. Fresh pages cost ~0.3 GB/s to fault in here, so
// this happens once per slot, never per update.
result<void> slot_create(slot& s, std::uint64_t capacity, std::uint64_t owner_start);

// A consumer process holds a shared flock on a slot while any of its ranks reads it
// (slot_fd::hold); the publisher rewrites a slot only under an exclusive one. The kernel drops a
// reader's lock when the reader exits, so a frozen reader keeps its slot and a dead one gives it
// back.

/// Takes `s` for a rewrite: true when no process reads it, and then none can start to until
/// slot_unclaim. False with errno set (EWOULDBLOCK: a reader holds it).
bool slot_claim(const slot& s);
void slot_unclaim(const slot& s);

/// The processes that hold slot descriptor `fd` for reading, from /proc/locks ("pid 812, pid
/// 907"; "an unknown process" when none is listed, e.g. one in another PID namespace).
std::string slot_readers(int fd);

}  // namespace wsync::shared_memory_detail
