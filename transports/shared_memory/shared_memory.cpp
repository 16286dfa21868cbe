#include "shared_memory/shared_memory.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "shared_memory/peer_fd.hpp"
#include "shared_memory/slot.hpp"
#include "shared_memory/slot_fds.hpp"
#include "src/json_read.hpp"
#include "src/process.hpp"
#include "src/slot_ring.hpp"
#include "wsync/manifest/json_bounded.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {
using detail::process_start_time;
using shared_memory_detail::align_up;
using shared_memory_detail::capacity_quantum;
using shared_memory_detail::errno_text;
using shared_memory_detail::handle;
using shared_memory_detail::handle_parse;
using shared_memory_detail::header_bytes;
using shared_memory_detail::magic;
using shared_memory_detail::map_aligned;
using shared_memory_detail::name_prefix;
using shared_memory_detail::open_slots;
using shared_memory_detail::page;
using shared_memory_detail::slot;
using shared_memory_detail::slot_claim;
using shared_memory_detail::slot_create;
using shared_memory_detail::slot_destroy;
using shared_memory_detail::slot_fd;
using shared_memory_detail::slot_header;
using shared_memory_detail::slot_readers;
using shared_memory_detail::slot_unclaim;

namespace {

struct pool_config {
  std::uint64_t slots = 2;  // most slots the ring holds; created on first need
};

class shm_publisher final : public publisher_transport {
 public:
  explicit shm_publisher(pool_config cfg)
      : cfg_(std::move(cfg)),
        pool_id_(random_hex(8)),
        owner_start_(process_start_time(::getpid())) {}

  ~shm_publisher() override {
    for (auto& s : slots_) slot_destroy(*s);
  }

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds wait) override {
    std::uint64_t need = 0;  // page-aligned segments can be registered later
    auto offsets = slot_ring::layout(sizes, page, need);
    std::unique_lock lock(mutex_);
    for (const auto& s : slots_) {
      if (s->holder == id) {
        return make_error(errc::invalid_argument,
                          "shared-memory: update_id " + id + " acquired twice (field update_id)");
      }
    }
    // A slot too small is made again; a failed remake keeps the (now empty) entry: erasing it
    // would shift the indices consumers key their mappings by. A later acquire recreates it.
    auto picked = slot_ring::choose(
        slots_, need, cfg_.slots, lock, cv_, wait, "shared-memory", id, [&](slot& s) {
          slot_destroy(s);
          return slot_create(s, align_up(need + need / 8, capacity_quantum), owner_start_);
        });
    if (!picked) return picked.error();
    slot* chosen = *picked;
    if (auto ok = claim_or_replace(*chosen, need, id); !ok) return ok.error();
    chosen->holder = id;
    chosen->offsets = offsets;
    // The slot is about to be rewritten: bump the generation now, so a consumer holding the
    // previous handle is refused from here on, not only after expose(). Under the claim: a
    // reader that takes its hold after it sees the new generation.
    chosen->header()->generation.fetch_add(1, std::memory_order_acq_rel);
    slot_unclaim(*chosen);
    // The seqlock's writer side: a release RMW orders what came before it, not the slot's
    // bytes written after it. Without this fence a weakly ordered CPU (ARM) may show a reader
    // new bytes beside the old generation, and intact() would pass a torn copy.
#if !defined(__SANITIZE_THREAD__)
    std::atomic_thread_fence(std::memory_order_release);
#endif
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      spans.emplace_back(chosen->base + header_bytes + offsets[i], sizes[i]);
    }
    return spans;
  }

  result<std::string> expose(const update_id& id) override {
    std::lock_guard lock(mutex_);
    slot* s = find(id);
    if (!s) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + " was not acquired from shared-memory");
    }
    std::uint64_t gen = s->header()->generation.fetch_add(1, std::memory_order_acq_rel) + 1;
    std::size_t index = static_cast<std::size_t>(
        std::find_if(slots_.begin(), slots_.end(), [&](const auto& p) { return p.get() == s; }) -
        slots_.begin());
    nlohmann::json h = {{"pool", pool_id_},  {"slot", index},           {"name", s->name},
                        {"generation", gen}, {"capacity", s->capacity}, {"offsets", s->offsets}};
    return h.dump();
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    if (slot* s = find(id)) {
      s->holder.clear();
      cv_.notify_all();
    }
  }

 private:
  // Takes `s` for a rewrite. Every consumer released it, but a process may still read it: a rank
  // the coordinator took for dead (frozen past the heartbeat timeout, cut off) that still serves
  // views of it. Rewriting would change the weights under that reader, so the slot is left to it:
  // unlinked here, its memory lives until the reader unmaps it or exits, and a new slot takes its
  // place in the ring (its consumers see the new name and drop their old mapping once unused).
  // That costs one slot of memory per such reader while it reads. A hold can also be brief: a
  // stale import's, dropped microseconds after its generation check, or a leaving rank's, whose
  // process lets go as it exits: tries over a quarter of a second tell those from a reader that
  // stays, and cost that time once per slot left to a reader.
  result<void> claim_or_replace(slot& s, std::uint64_t need, const update_id& id) {
    for (auto pause = std::chrono::milliseconds(2);; pause *= 2) {
      if (slot_claim(s)) return {};
      if (errno != EWOULDBLOCK || pause > std::chrono::milliseconds(128)) break;
      std::this_thread::sleep_for(pause);
    }
    const int err = errno;
    const std::string read =
        "shared-memory: slot " + s.name + " is still read by " + slot_readers(s.fd) +
        " though every consumer released it" +
        (err == EWOULDBLOCK ? std::string() : " (flock: " + errno_text(err) + ")");
    // Made before the old one goes: without room for it (/dev/shm sized for the ring), the old
    // slot stays in the ring, to be claimed once its reader lets go.
    slot fresh;
    const std::uint64_t capacity =
        std::max(s.capacity, align_up(need + need / 8, capacity_quantum));
    if (auto made = slot_create(fresh, capacity, owner_start_); !made) {
      return make_error(made.error().code, read + ", and no new slot can take its place: " +
                                               made.error().message + " (update_id=" + id + ")");
    }
    log_warn(read +
             " (a consumer the coordinator took for dead, frozen or cut off; or Python tensor "
             "views kept past their release): left to that reader, a new slot takes its place "
             "(update_id=" +
             id + ")");
    slot_destroy(s);
    s = std::move(fresh);
    if (!slot_claim(s)) {  // nobody else knows this slot's name yet
      const int claim_err = errno;
      return make_error(errc::io_error, "shared-memory: flock of new slot " + s.name + " failed: " +
                                            errno_text(claim_err) + " (update_id=" + id + ")");
    }
    return {};
  }

  slot* find(const update_id& id) {
    for (auto& s : slots_) {
      if (s->holder == id) return s.get();
    }
    return nullptr;
  }

  pool_config cfg_;
  std::string pool_id_;
  std::uint64_t owner_start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<slot>> slots_;
};

class shm_consumer final : public consumer_transport {
 public:
  shm_consumer()
      : peers_(std::make_unique<shm_peer::registration>(
            [this](const std::string& name) { return descriptor_of(name); },
            [this] { return rank_.load(); })) {}

  ~shm_consumer() override {
    peers_.reset();  // first: no peer gets a descriptor that is about to close
    for (auto& [id, held] : held_) held.fd->unhold();  // other ranks may share the descriptors
    for (auto& [key, m] : maps_) m.unmap();
    for (auto& m : retired_) m.unmap();
  }

  void rank_set(std::int32_t rank) override { rank_ = rank; }

  std::string import_source(const update_id& id) const override {
    std::lock_guard lock(mutex_);
    for (const auto& [which, from] : sources_) {
      if (which == id) return from;
    }
    return {};
  }

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    auto h = handle_parse(m);
    if (!h) return h.error();
    std::unique_lock lock(mutex_);
    auto key = h->pool + "/" + std::to_string(h->slot);
    auto it = maps_.find(key);
    if (it != maps_.end() && it->second.name != h->name) {
      // The publisher replaced this slot with a larger one: drop the old mapping once unused.
      retire(it);
      it = maps_.end();
    }
    if (it == maps_.end()) {
      forget_vanished_locked();
      // Without the lock: mapping may ask peers, and a peer's request of this consumer takes it.
      lock.unlock();
      std::int32_t peer = -1;
      auto mapped = map(*h, m, peer);
      lock.lock();
      if (!mapped) return mapped.error();
      // Two imports of one consumer may overlap (a Python bridge's beside its executor's): one
      // that mapped this slot meanwhile wins, and this mapping goes rather than leak.
      if (auto won = maps_.find(key); won != maps_.end() && won->second.name == h->name) {
        mapped->unmap();
        it = won;
        peer = -1;
      } else {
        if (won != maps_.end()) retire(won);
        mapped->serial = ++serials_;
        it = maps_.emplace(key, *mapped).first;
      }
      if (peer >= 0) {
        sources_.emplace_back(m.update_id, "rank:" + std::to_string(peer) + " (shared memory)");
        if (sources_.size() > 64) sources_.pop_front();
      }
    }
    auto& mp = it->second;
    if (h->capacity > mp.map_bytes - header_bytes) {
      return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: capacity " +
                                                    std::to_string(h->capacity) +
                                                    " exceeds the mapped slot " + h->name + " (" +
                                                    update_context(m) + ")");
    }
    // Held before the generation is read: the publisher bumps it under its claim, so either it
    // sees this hold and leaves the slot alone, or the load below sees its bump.
    if (int err = mp.fd->hold(); err != 0) {
      if (err == EWOULDBLOCK) {
        return make_error(errc::unknown_update, "unknown update_id: " + m.update_id +
                                                    " is no longer in shared memory: its slot " +
                                                    h->name + " is being rewritten (" +
                                                    update_context(m) + ")");
      }
      return make_error(errc::io_error, "shared-memory: flock " + h->name + " failed: " +
                                            errno_text(err) + " (" + update_context(m) + ")");
    }
    const auto* header = reinterpret_cast<const slot_header*>(mp.base);
    std::uint64_t gen = header->generation.load(std::memory_order_acquire);
    if (gen != h->generation) {
      mp.fd->unhold();
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id +
                            " is no longer in shared memory: its slot now holds generation " +
                            std::to_string(gen) + ", the handle names " +
                            std::to_string(h->generation) + " (" + update_context(m) + ")");
    }
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < h->offsets.size(); ++i) {
      spans.emplace_back(mp.base + header_bytes + h->offsets[i], m.segments[i].nbytes);
    }
    ++mp.holds;
    if (auto again = held_.find(m.update_id); again != held_.end()) again->second.fd->unhold();
    held_[m.update_id] = held_import{key, mp.serial, header, h->generation, mp.fd};
    return spans;
  }

  result<void> intact(const update_id& id) const override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end()) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + " is not imported from shared-memory");
    }
    // A seqlock's reader side: the publisher bumps the generation before it rewrites a slot, so
    // a generation unchanged after the bytes were read means none of them was rewritten. The
    // fence keeps those reads before this load.
#if !defined(__SANITIZE_THREAD__)  // TSan refuses fences; it cannot see the other process anyway
    std::atomic_thread_fence(std::memory_order_acquire);
#endif
    return slot_ring::unchanged(id, "shared",
                                it->second.header->generation.load(std::memory_order_acquire),
                                it->second.generation);
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    // The very mapping the import counted on: the key's mapping may have been retired and the
    // same slot name mapped again since (a stale handle), so neither key nor name tells.
    const auto key = it->second.key;
    const auto serial = it->second.serial;
    it->second.fd->unhold();
    held_.erase(it);
    if (auto m = maps_.find(key); m != maps_.end() && m->second.serial == serial) {
      --m->second.holds;
      return;
    }
    for (auto r = retired_.begin(); r != retired_.end(); ++r) {
      if (r->serial != serial) continue;
      if (--r->holds == 0) {
        r->unmap();
        retired_.erase(r);
      }
      return;
    }
  }

 private:
  struct mapping {
    std::string name;
    const std::byte* base = nullptr;
    std::uint64_t map_bytes = 0;
    int holds = 0;
    std::shared_ptr<const slot_fd> fd;  ///< kept open, so that a peer on this node can be given it
    std::uint64_t serial = 0;           ///< which mapping an import holds (release finds it)
    void unmap() const { ::munmap(const_cast<std::byte*>(base), map_bytes); }
  };

  // Unmaps the cached slots this consumer does not hold whose names are gone (their publisher
  // exited or replaced them): a restarted publisher's new ring would otherwise add to the old
  // mappings and descriptors forever. A slot a rank still holds stays, for it and its peers.
  void forget_vanished_locked() {
    for (auto it = maps_.begin(); it != maps_.end();) {
      if (it->second.holds == 0 && ::access(("/dev/shm/" + it->second.name).c_str(), F_OK) != 0) {
        it->second.unmap();
        it = maps_.erase(it);
      } else {
        ++it;
      }
    }
  }

  // For a peer's request: a duplicate descriptor of slot `name` if this consumer maps it.
  int descriptor_of(const std::string& name) {
    std::lock_guard lock(mutex_);
    for (const auto& [key, mp] : maps_) {
      if (mp.name == name) return ::fcntl(mp.fd->fd, F_DUPFD_CLOEXEC, 0);
    }
    for (const auto& mp : retired_) {
      if (mp.name == name) return ::fcntl(mp.fd->fd, F_DUPFD_CLOEXEC, 0);
    }
    return -1;
  }

  void retire(std::unordered_map<std::string, mapping>::iterator it) {
    if (it->second.holds == 0) {
      it->second.unmap();
    } else {
      retired_.push_back(it->second);
    }
    maps_.erase(it);
  }

  // Maps a slot read-only and faults its pages in once (MAP_POPULATE), so later imports of the
  // same slot cost nothing but a generation check. 2 MiB-aligned, so the huge pages the
  // publisher made (slot_collapse) are mapped whole: the first verify then reads at the speed of
  // later ones.
  // When the publisher unlinked the slot (it exited), a consumer on this node that still maps it
  // can give it: `peer` is then that consumer's rank.
  result<mapping> map(const handle& h, const weight_update_manifest& m, std::int32_t& peer) {
    auto opened = open_slot(h, m, peer);
    if (!opened) return opened.error();
    auto fd = open_slots::instance().adopt(h.name, *opened);
    struct stat st {};
    if (::fstat(fd->fd, &st) != 0 ||
        static_cast<std::uint64_t>(st.st_size) < header_bytes + h.capacity) {
      return make_error(errc::invalid_manifest,
                        "invalid manifest: transport_handle: segment " + h.name +
                            " is smaller than the capacity the handle names (" + update_context(m) +
                            ")");
    }
    std::uint64_t bytes = header_bytes + h.capacity;
    void* p = map_aligned(fd->fd, bytes, PROT_READ, MAP_SHARED | MAP_POPULATE);
    int err = errno;
    if (p == MAP_FAILED) {
      return make_error(errc::io_error, "shared-memory: mmap " + h.name + " failed: " +
                                            errno_text(err) + " (" + update_context(m) + ")");
    }
    const auto* header = static_cast<const slot_header*>(p);
    if (std::memcmp(header->magic, magic, sizeof magic) != 0 || header->capacity != h.capacity) {
      ::munmap(p, bytes);
      return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + h.name +
                                                    " is not a wsync slot of the named capacity (" +
                                                    update_context(m) + ")");
    }
    return mapping{h.name, static_cast<const std::byte*>(p), bytes, 0, std::move(fd), 0};
  }

  // A new read-only descriptor of the slot: by name, or when the publisher unlinked it (it
  // exited), from a consumer on this node that still maps it (`peer` is then that one's rank).
  result<int> open_slot(const handle& h, const weight_update_manifest& m, std::int32_t& peer) {
    int fd = ::shm_open(("/" + h.name).c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd >= 0) return fd;
    int err = errno;
    if (err != ENOENT) {
      return make_error(errc::io_error, "shared-memory: shm_open " + h.name + " failed: " +
                                            errno_text(err) + " (" + update_context(m) + ")");
    }
    auto got = shm_peer::fetch(h.name, *peers_);
    if (!got) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id + ": shared-memory segment " + h.name +
                            " no longer exists (publisher released it or exited) and " +
                            got.error().message + " (" + update_context(m) + ")");
    }
    peer = got->rank;
    return own_description(got->fd);
  }

  // A descriptor a peer passed shares that peer's open file description, and with it the flock
  // that says who reads the slot: a lock taken through it would outlive this process while the
  // peer lives, and the peer's unlock would drop this process's. Opened anew through /proc, the
  // same memory gets a description of this process's own.
  static int own_description(int passed) {
    int own = ::open(("/proc/self/fd/" + std::to_string(passed)).c_str(), O_RDONLY | O_CLOEXEC);
    if (own < 0) return passed;  // no /proc: the lock is shared with the peer, the bytes are not
    ::close(passed);
    return own;
  }

  mutable std::mutex mutex_;
  std::unordered_map<std::string, mapping> maps_;  // "<pool>/<slot>" -> mapping
  std::vector<mapping> retired_;
  std::uint64_t serials_ = 0;
  /// An import this consumer holds: its mapping (by key and serial) and the slot generation it
  /// was imported at (the header stays mapped while it is held).
  struct held_import {
    std::string key;
    std::uint64_t serial = 0;
    const slot_header* header = nullptr;
    std::uint64_t generation = 0;
    std::shared_ptr<const slot_fd> fd;  ///< its hold keeps the publisher off the slot
  };
  std::unordered_map<update_id, held_import> held_;
  std::deque<std::pair<update_id, std::string>> sources_;  ///< recent imports a peer served
  std::atomic<std::int32_t> rank_{-1};
  std::unique_ptr<shm_peer::registration> peers_;  ///< last: built after, gone before the maps
};

constexpr transport_caps shm_caps{.cpu_memory = true,
                                  .gpu_memory = false,
                                  .cross_process = true,
                                  .cross_node = false,
                                  .zero_copy_import = true};

class shared_memory_transport final : public transport {
 public:
  explicit shared_memory_transport(pool_config cfg) : cfg_(std::move(cfg)) {}
  std::string_view name() const override { return "shared-memory"; }
  transport_caps caps() const override { return shm_caps; }
  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    auto swept = shm_sweep_orphans();
    if (!swept.empty()) {
      log_warn("shared-memory: removed " + std::to_string(swept.size()) +
               " segment(s) left by dead publishers, first: " + swept.front());
    }
    return std::unique_ptr<publisher_transport>(std::make_unique<shm_publisher>(cfg_));
  }
  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return std::unique_ptr<consumer_transport>(std::make_unique<shm_consumer>());
  }

 private:
  pool_config cfg_;
};

}  // namespace

transport_entry shared_memory_entry() {
  return {"shared-memory", "one node; pooled POSIX shared-memory slots, zero-copy import", shm_caps,
          [](const transport_options& options) -> result<std::unique_ptr<transport>> {
            options_reader reader("shared-memory", options);
            pool_config cfg;
            auto slots = reader.get_uint("slots", 2, 1, 64);
            if (!slots) return slots.error();
            cfg.slots = *slots;
            if (auto ok = reader.finish(); !ok) return ok.error();
            return std::unique_ptr<transport>(std::make_unique<shared_memory_transport>(cfg));
          }};
}

// --- the handle decoder (shared_memory.hpp) ------------------------------------------------

namespace shared_memory_detail {

result<handle> handle_parse(const weight_update_manifest& m) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + why + " (" +
                                                  update_context(m) + ")");
  };
  auto j = json_parse_bounded(m.transport_handle);
  if (j.is_discarded() || !j.is_object()) return bad("not a shared-memory handle");
  handle h;
  try {
    h.pool = j.at("pool").get<std::string>();
    h.slot = json_read::field<std::uint64_t>(j, "slot");
    h.name = j.at("name").get<std::string>();
    h.generation = json_read::field<std::uint64_t>(j, "generation");
    h.capacity = json_read::field<std::uint64_t>(j, "capacity");
    h.offsets = json_read::list<std::uint64_t>(j, "offsets");
  } catch (const std::exception& e) {
    return bad(std::string("shared-memory handle field: ") + e.what());
  }
  if (h.name.rfind(name_prefix, 0) != 0 || h.name.find('/') != std::string::npos) {
    return bad("segment name \"" + h.name + "\" is not a wsync shared-memory name");
  }
  if (auto why = slot_ring::segments_outside(h.offsets, h.capacity, m.segments); !why.empty()) {
    return bad(why);
  }
  return h;
}

}  // namespace shared_memory_detail
}  // namespace wsync
