#pragma once
// The pooled-slot ring shared by the transports that allocate memory once and reuse it
// (shared-memory, cuda-ipc, cuda-vmm): which slot an update gets, when the ring grows, when a
// free slot too small for it is replaced, how long to wait for one to come free, and what the
// reader of a slot's generation (its seqlock) concludes.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync::slot_ring {

/// Segment offsets inside a slot, each segment starting at a multiple of `alignment`; `need`
/// receives the bytes the slot must have (at least one alignment unit).
inline std::vector<std::uint64_t> layout(std::span<const std::uint64_t> sizes,
                                         std::uint64_t alignment, std::uint64_t& need) {
  std::vector<std::uint64_t> offsets;
  need = 0;
  for (auto n : sizes) {
    offsets.push_back(need);
    need = (need + n + alignment - 1) / alignment * alignment;
  }
  if (need < alignment) need = alignment;
  return offsets;
}

/// Why a handle's segment `offsets` do not fit a slot of `capacity` bytes holding the manifest's
/// segments ("segment 2 lies outside the slot"), or "" when every one does. Handle decoders use
/// it, so a consumer never maps past a slot.
inline std::string segments_outside(std::span<const std::uint64_t> offsets, std::uint64_t capacity,
                                    const std::vector<segment_descriptor>& segments) {
  if (offsets.size() != segments.size()) {
    return std::to_string(offsets.size()) + " offsets for " + std::to_string(segments.size()) +
           " segments";
  }
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    if (offsets[i] > capacity || segments[i].nbytes > capacity - offsets[i]) {
      return "segment " + std::to_string(i) + " lies outside the slot";
    }
  }
  return {};
}

/// A free slot of `slots` for `need` bytes, under `lock`: the smallest free one that is large
/// enough; else a new one while the ring has fewer than `max`, or a free one too small, made
/// again by `remake(slot)` (which frees what the slot had and allocates anew); else waits on
/// `freed` until `deadline`. Slot needs `holder` (empty when free) and `capacity`.
/// errc::timeout names `who`, the update, how many slots hold what, and `max`.
template <class Slot, class Remake>
result<Slot*> choose(std::vector<std::unique_ptr<Slot>>& slots, std::uint64_t need,
                     std::uint64_t max, std::unique_lock<std::mutex>& lock,
                     std::condition_variable& freed, std::chrono::milliseconds wait,
                     const std::string& who, const std::string& id, Remake remake) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    Slot* chosen = nullptr;
    Slot* small_free = nullptr;
    for (auto& s : slots) {
      if (!s->holder.empty()) continue;
      if (s->capacity >= need && (!chosen || s->capacity < chosen->capacity)) chosen = s.get();
      if (s->capacity < need) small_free = s.get();
    }
    if (chosen) return chosen;
    if (slots.size() < max || small_free) {
      if (!small_free) {
        slots.push_back(std::make_unique<Slot>());
        small_free = slots.back().get();
      }
      if (auto ok = remake(*small_free); !ok) {
        return make_error(ok.error().code, ok.error().message + " (update_id=" + id + ")");
      }
      return small_free;
    }
    if (freed.wait_until(lock, deadline) == std::cv_status::timeout) {
      return make_error(errc::timeout, who + ": no free slot for update_id=" + id + " after " +
                                           std::to_string(wait.count()) + " ms: all " +
                                           std::to_string(slots.size()) +
                                           " slots hold updates not yet released by every "
                                           "consumer (option slots=" +
                                           std::to_string(max) + ")");
    }
  }
}

/// The reader's side of a slot's seqlock, once the reader has fenced its reads and loaded the
/// slot's generation `now`: the publisher bumps the generation before it rewrites a slot, so
/// `now` equal to the import's `had` means no byte read was rewritten. `memory` names where
/// ("shared", "cuda-ipc").
inline result<void> unchanged(const std::string& id, const std::string& memory, std::uint64_t now,
                              std::uint64_t had) {
  if (now == had) return {};
  return make_error(errc::unknown_update,
                    "unknown update_id: " + id + " was rewritten in " + memory +
                        " memory while it was read: its slot now holds generation " +
                        std::to_string(now) + ", the import had " + std::to_string(had) +
                        " (update_id=" + id + ")");
}

}  // namespace wsync::slot_ring
