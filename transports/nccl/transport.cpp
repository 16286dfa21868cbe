// The nccl transport (wsync/transports/nccl_transport.hpp): the publisher's sender thread and the
// consumer's receive loop, over any group_fabric. Pure C++: CI runs it on the host fabric.

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "nccl/handle.hpp"
#include "nccl/plan.hpp"
#include "src/slot_ring.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/transports/nccl_transport.hpp"

namespace wsync::nccl {
namespace {

using clock = std::chrono::steady_clock;

std::string ranks_text(const std::vector<std::int32_t>& ranks) {
  std::string s;
  for (auto r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

result<std::vector<std::int32_t>> ranks_parse(const std::string& text) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_argument, "nccl option consumers: \"" + text + "\": " + why);
  };
  std::vector<std::int32_t> out;
  std::set<std::int32_t> seen;
  std::size_t at = 0;
  while (at <= text.size()) {
    const auto comma = std::min(text.find(',', at), text.size());
    std::int32_t r = 0;
    const char* first = text.data() + at;
    const char* last = text.data() + comma;
    auto [end, ec] = std::from_chars(first, last, r);
    if (first == last || ec != std::errc{} || end != last || r < 0) {
      return bad("expected comma-separated consumer ranks (non-negative integers)");
    }
    if (!seen.insert(r).second) return bad("rank " + std::to_string(r) + " twice");
    out.push_back(r);
    at = comma + 1;
  }
  if (out.size() > 65535) return bad("more than 65535 ranks");
  return out;
}

// Queues rank 0's broadcasts of `bytes` in slices of at most bucket_bytes, waiting after every
// `buckets` of them and at the end. Each slice lands at `data` + its offset, or, with `drop`, at
// `data` itself: a scratch buffer of one slice, for an update this rank skipped.
result<void> broadcast_slices(group_member& member, std::byte* data, std::uint64_t bytes,
                              std::uint64_t bucket_bytes, unsigned buckets, bool drop,
                              clock::time_point deadline) {
  const std::uint64_t total[] = {bytes};
  auto slices = nccl_plan::segment_slices(total, bucket_bytes, buckets);
  if (!slices) return slices.error();
  for (const auto& s : *slices) {
    if (auto r = member.broadcast(drop ? data : data + s.offset, s.nbytes, 0); !r) return r;
    if (s.stream + 1 == buckets) {
      if (auto r = member.wait(deadline); !r) return r;
    }
  }
  return member.wait(deadline);
}

// ---------------------------------------------------------------------------------------------
// Publisher: rank 0. expose() hands the update to the sender thread, which joins the group when
// the epoch is new and broadcasts updates one after another in expose order.

/// A lent tensor's bytes and where they go on the wire.
struct wire_piece {
  std::uint64_t at = 0;
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
};

struct pub_slot {
  block memory;
  std::uint64_t capacity = 0;
  std::string holder;     ///< the update it holds; empty when free
  bool sending = false;   ///< the sender thread still reads it
  bool released = false;  ///< release() came while sending
};

class nccl_publisher final : public publisher_transport {
 public:
  nccl_publisher(transport_settings settings, std::shared_ptr<group_fabric> fabric,
                 std::string group, block header)
      : settings_(std::move(settings)),
        fabric_(std::move(fabric)),
        group_(std::move(group)),
        header_(std::move(header)),
        sender_([this] { run(); }) {}

  ~nccl_publisher() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    work_.notify_all();
    sender_.join();
  }

  memory_location memory() const override { return fabric_->memory(); }

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> segment_bytes,
                                                    std::chrono::milliseconds wait) override {
    std::uint64_t need = 0;
    auto offsets = slot_ring::layout(segment_bytes, tensor_alignment, need);
    std::unique_lock lock(mu_);
    if (pending_.count(id)) {
      return make_error(errc::invalid_argument, "nccl: update_id=" + id + " was acquired already");
    }
    auto slot = slot_ring::choose(slots_, need, settings_.slots, lock, freed_, wait, "nccl", id,
                                  [&](pub_slot& s) -> result<void> {
                                    s.memory = {};
                                    s.capacity = 0;
                                    auto b = fabric_->allocate(need);
                                    if (!b) return b.error();
                                    s.memory = std::move(*b);
                                    s.capacity = need;
                                    return {};
                                  });
    if (!slot) return slot.error();
    (*slot)->holder = id;
    (*slot)->released = false;
    pending_[id] = {*slot, need, {}, false, {}};
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < segment_bytes.size(); ++i) {
      spans.emplace_back((*slot)->memory.data + offsets[i], segment_bytes[i]);
    }
    return spans;
  }

  bool can_lend() const override { return true; }

  result<void> lend(const update_id& id, std::span<const std::uint64_t> segment_bytes,
                    std::vector<lent_range> ranges) override {
    std::uint64_t need = 0;
    const auto offsets = slot_ring::layout(segment_bytes, tensor_alignment, need);
    std::vector<wire_piece> pieces;
    for (const auto& r : ranges) {
      if (r.segment >= offsets.size() || r.offset > segment_bytes[r.segment] ||
          r.nbytes > segment_bytes[r.segment] - r.offset) {
        return make_error(errc::invalid_argument, "nccl: a lent range lies outside segment " +
                                                      std::to_string(r.segment) +
                                                      " of update_id=" + id);
      }
      if (r.nbytes > 0) pieces.push_back({offsets[r.segment] + r.offset, r.data, r.nbytes});
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const wire_piece& a, const wire_piece& b) { return a.at < b.at; });
    std::lock_guard lock(mu_);
    if (pending_.count(id)) {
      return make_error(errc::invalid_argument, "nccl: update_id=" + id + " was acquired already");
    }
    pending_[id] = {nullptr, need, {}, false, std::move(pieces)};
    return {};
  }

  result<void> lent_wait(const update_id& id, std::chrono::milliseconds wait) override {
    std::unique_lock lock(mu_);
    if (!lent_done_.wait_for(lock, wait, [&] { return !lending_.count(id); })) {
      return make_error(errc::timeout, "nccl: the broadcast of update_id=" + id +
                                           " still reads the lent tensors after " +
                                           std::to_string(wait.count()) + " ms");
    }
    return {};
  }

  result<void> consumers_set(const update_id& id,
                             std::span<const std::int32_t> consumers) override {
    std::lock_guard lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end() || it->second.exposed) {
      return make_error(errc::unknown_update,
                        "unknown update_id " + id + ": nccl has no unexposed update by that id");
    }
    if (consumers.size() > 65535) {
      return make_error(errc::invalid_argument, "nccl: more than 65535 consumers for update_id=" +
                                                    id + " (one communicator holds them all)");
    }
    it->second.members.assign(consumers.begin(), consumers.end());
    return {};
  }

  result<std::string> expose(const update_id& id) override {
    std::lock_guard lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end() || it->second.exposed) {
      return make_error(errc::unknown_update,
                        "unknown update_id " + id + ": nccl has no unexposed update by that id");
    }
    // The update's consumers when the caller named them (the coordinator's live view), else the
    // consumers option. A new set, or an aborted communicator, takes a new one: a new epoch.
    const auto& members = it->second.members.empty() ? settings_.consumers : it->second.members;
    if (epoch_ == 0 || broken_upto_ >= epoch_ || members != members_) {
      auto made = fabric_->make_id();
      if (!made) return made.error();
      id_ = *made;
      members_ = members;
      ++epoch_;
    }
    nccl_handle::handle h{group_,
                          epoch_,
                          id_,
                          members_,
                          next_sequence_++,
                          it->second.bytes,
                          settings_.bucket_bytes,
                          settings_.buckets};
    it->second.exposed = true;
    if (it->second.slot) {
      it->second.slot->sending = true;
    } else {
      lending_.insert(id);
    }
    jobs_.push_back({id, h, it->second.slot, it->second.lent});
    work_.notify_all();
    return nccl_handle::encode(h);
  }

  void release(const update_id& id) override {
    std::unique_lock lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    pub_slot* slot = it->second.slot;
    pending_.erase(it);
    if (!slot) {  // lent: the caller may free its tensors once this returns
      lent_done_.wait(lock, [&] { return !lending_.count(id); });
      return;
    }
    if (slot->sending) {
      slot->released = true;  // the sender frees it when done
    } else {
      slot->holder.clear();
      freed_.notify_all();
    }
  }

 private:
  struct pending {
    pub_slot* slot = nullptr;  ///< null: lent
    std::uint64_t bytes = 0;
    std::vector<std::int32_t> members;  ///< from consumers_set(); empty: the option's
    bool exposed = false;
    std::vector<wire_piece> lent;  ///< lend(): the caller's bytes, by place on the wire
  };
  struct job {
    update_id id;
    nccl_handle::handle h;
    pub_slot* slot = nullptr;
    std::vector<wire_piece> lent;  ///< when slot is null
  };

  void run() {
    std::unique_ptr<group_member> member;
    std::uint64_t member_epoch = 0;
    for (;;) {
      job j;
      std::string dead;  // why the job's epoch is over before it starts
      {
        std::unique_lock lock(mu_);
        work_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (stopping_) break;
        j = std::move(jobs_.front());
        jobs_.pop_front();
        if (j.h.epoch <= broken_upto_) dead = broken_why_;
      }
      std::string failure = dead.empty() ? send(j, member, member_epoch) : dead;
      std::lock_guard lock(mu_);
      if (!failure.empty()) {
        if (j.h.epoch > broken_upto_) {
          broken_upto_ = j.h.epoch;
          broken_why_ = failure;
        }
        log_warn("nccl: the broadcast of update_id=" + j.id + " (sequence " +
                 std::to_string(j.h.sequence) + ", epoch " + std::to_string(j.h.epoch) +
                 ") failed: " + failure);
      }
      done_locked(j);
    }
    std::lock_guard lock(mu_);
    for (auto& j : jobs_) done_locked(j);
  }

  // The sender no longer reads the job's memory.
  void done_locked(job& j) {
    if (!j.slot) {
      lending_.erase(j.id);
      lent_done_.notify_all();
      return;
    }
    j.slot->sending = false;
    if (j.slot->released) {
      j.slot->released = false;
      j.slot->holder.clear();
      freed_.notify_all();
    }
  }

  // Sends one update; "" or why it failed (the communicator is then aborted).
  std::string send(const job& j, std::unique_ptr<group_member>& member,
                   std::uint64_t& member_epoch) {
    const auto deadline = clock::now() + settings_.timeout;
    const int world = static_cast<int>(j.h.members.size()) + 1;
    if (!member || member_epoch != j.h.epoch) {
      member.reset();
      auto joined = fabric_->join(j.h.id, world, 0, settings_.timeout);
      if (!joined) {
        return "joining the group of " + std::to_string(world) + " (epoch " +
               std::to_string(j.h.epoch) + ") failed: " + joined.error().message;
      }
      member = std::move(*joined);
      member_epoch = j.h.epoch;
    }
    const auto hb = nccl_handle::header_encode(nccl_handle::header_of(j.h, j.id));
    auto ok = fabric_->write(header_.data, hb.data(), hb.size());
    if (ok) ok = member->broadcast(header_.data, hb.size(), 0);
    if (ok && j.slot) {
      ok = broadcast_slices(*member, j.slot->memory.data, j.h.bytes, j.h.bucket_bytes, j.h.buckets,
                            false, deadline);
    } else if (ok) {
      ok = broadcast_packed(*member, j, deadline);
    }
    if (ok) return {};
    member->abort(ok.error().message);
    return ok.error().message;
  }

  // A lent update: each slice of the wire is packed from the caller's tensors into one of
  // `buckets` staging buffers, in turn, and broadcast from there. The member runs copies and
  // broadcasts in order, so a buffer is packed again only after its last broadcast went out.
  result<void> broadcast_packed(group_member& member, const job& j, clock::time_point deadline) {
    const std::uint64_t total[] = {j.h.bytes};
    auto slices = nccl_plan::segment_slices(total, j.h.bucket_bytes, j.h.buckets);
    if (!slices) return slices.error();
    const auto bucket = std::min(j.h.bytes, j.h.bucket_bytes);
    if (staging_.size() < j.h.buckets || staging_.front().nbytes < bucket) {
      staging_.clear();
      for (unsigned k = 0; k < j.h.buckets; ++k) {
        auto b = fabric_->allocate(std::max<std::uint64_t>(bucket, 1));
        if (!b) return b.error();
        staging_.push_back(std::move(*b));
      }
    }
    auto piece = j.lent.begin();
    for (const auto& s : *slices) {
      std::byte* into = staging_[s.stream].data;
      const auto end = s.offset + s.nbytes;
      while (piece != j.lent.end() && piece->at + piece->nbytes <= s.offset) ++piece;
      for (auto p = piece; p != j.lent.end() && p->at < end; ++p) {
        const auto from = std::max(p->at, s.offset);
        const auto to = std::min(p->at + p->nbytes, end);
        if (auto r = member.copy(into + (from - s.offset), p->data + (from - p->at), to - from);
            !r) {
          return r;
        }
      }
      if (auto r = member.broadcast(into, s.nbytes, 0); !r) return r;
      if (s.stream + 1 == j.h.buckets) {
        if (auto r = member.wait(deadline); !r) return r;
      }
    }
    return member.wait(deadline);
  }

  const transport_settings settings_;
  const std::shared_ptr<group_fabric> fabric_;
  const std::string group_;
  const block header_;
  std::vector<block> staging_;  ///< the sender's: lent updates' bucket buffers

  std::mutex mu_;
  std::condition_variable freed_;
  std::condition_variable work_;
  std::vector<std::unique_ptr<pub_slot>> slots_;
  std::set<update_id> lending_;  ///< lent updates the sender may still read
  std::condition_variable lent_done_;
  std::map<update_id, pending> pending_;
  std::deque<job> jobs_;
  std::uint64_t next_sequence_ = 1;
  std::uint64_t epoch_ = 0;
  unique_id id_{};
  std::vector<std::int32_t> members_;  ///< the current epoch's consumers
  std::uint64_t broken_upto_ = 0;      ///< every epoch up to this one was aborted
  std::string broken_why_;
  bool stopping_ = false;
  std::thread sender_;  // last: starts once everything above is built
};

// ---------------------------------------------------------------------------------------------
// Consumer: in each publisher's group, NCCL rank 1 + its place in the handle's members (a model
// published in shards has one group per publisher rank, and the consumer is in each). Imports
// of one group run one at a time (its broadcasts are in order); each receives headers until its
// own update's, dropping the bytes of updates this rank skipped.

/// A consumer keeps the communicators of this many publisher groups it used last.
constexpr std::size_t max_groups = 64;

struct group_state {
  std::mutex importing;  // one import at a time; guards everything below
  std::unique_ptr<group_member> member;
  std::uint64_t epoch = 0;
  std::uint64_t next_sequence = 0;        ///< after the last header received; 0: none yet
  error join_failed{errc::io_error, ""};  ///< why member is empty for this epoch
  block header;                           ///< where headers land
  block scratch;                          ///< where dropped updates land
  std::uint64_t used = 0;                 ///< when it was last used, for eviction
};

class nccl_consumer final : public consumer_transport {
 public:
  nccl_consumer(transport_settings settings, std::shared_ptr<group_fabric> fabric)
      : settings_(std::move(settings)), fabric_(std::move(fabric)) {}

  memory_location memory() const override { return fabric_->memory(); }

  void rank_set(std::int32_t rank) override { rank_ = rank; }

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    auto h = nccl_handle::parse(m);
    if (!h) return h.error();
    const std::string ctx = " (" + update_context(m.update_id, rank_) + ")";
    const auto place = std::find(h->members.begin(), h->members.end(), rank_);
    if (place == h->members.end()) {
      forget_if_older(h->group, h->epoch);  // its publisher moved on without this rank
      return make_error(errc::invalid_argument,
                        "nccl: transport_handle.members: rank " + std::to_string(rank_) +
                            " is not a member of this update's group (members " +
                            ranks_text(h->members) + ")" + ctx);
    }
    auto g = group_for(h->group);
    if (!g) return make_error(g.error().code, g.error().message + ctx);
    std::lock_guard importing((*g)->importing);
    auto received = receive(**g, *h, static_cast<int>(place - h->members.begin()) + 1, m.update_id);
    if (!received) return make_error(received.error().code, received.error().message + ctx);
    std::uint64_t bytes = 0;
    const auto offsets = nccl_handle::wire_layout(m.segments, bytes);
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < m.segments.size(); ++i) {
      spans.emplace_back(received->data + offsets[i], m.segments[i].nbytes);
    }
    std::lock_guard lock(mu_);
    held_[m.update_id] = std::move(*received);
    return spans;
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mu_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    if (free_.size() < settings_.slots) free_.push_back(std::move(it->second));
    held_.erase(it);
  }

 private:
  // The state of publisher group `name`, made on first use; the least recently used group goes
  // when there are too many (a publisher that restarted has a new group).
  result<std::shared_ptr<group_state>> group_for(const std::string& name) {
    std::lock_guard lock(mu_);
    auto& g = groups_[name];
    if (!g) {
      auto header = fabric_->allocate(nccl_handle::header_bytes);
      if (!header) {
        groups_.erase(name);
        return header.error();
      }
      g = std::make_shared<group_state>();
      g->header = std::move(*header);
      if (groups_.size() > max_groups) {
        auto oldest = groups_.end();
        for (auto it = groups_.begin(); it != groups_.end(); ++it) {
          if (it->first != name &&
              (oldest == groups_.end() || it->second->used < oldest->second->used)) {
            oldest = it;
          }
        }
        groups_.erase(oldest);  // an import still running keeps its state alive
      }
    }
    g->used = ++uses_;
    return g;
  }

  // Lets go of the communicator of publisher group `name` when it is of an epoch before
  // `epoch` (and no import of it is running).
  void forget_if_older(const std::string& name, std::uint64_t epoch) {
    std::shared_ptr<group_state> g;
    {
      std::lock_guard lock(mu_);
      auto it = groups_.find(name);
      if (it == groups_.end()) return;
      g = it->second;
    }
    {
      std::unique_lock importing(g->importing, std::try_to_lock);
      if (!importing || g->epoch >= epoch) return;
    }
    std::lock_guard lock(mu_);
    if (auto it = groups_.find(name); it != groups_.end() && it->second == g) groups_.erase(it);
  }

  // Joins the handle's epoch when it is new, receives headers (dropping skipped updates) until
  // the one of `h`, then its bytes.
  result<block> receive(group_state& g, const nccl_handle::handle& h, int nccl_rank,
                        const update_id& id) {
    const auto deadline = clock::now() + settings_.timeout;
    if (h.epoch < g.epoch) {
      return make_error(errc::io_error, "nccl: this update's broadcast (epoch " +
                                            std::to_string(h.epoch) +
                                            ") was abandoned: its publisher moved on to epoch " +
                                            std::to_string(g.epoch));
    }
    if (h.epoch != g.epoch) {
      g.member.reset();
      g.epoch = h.epoch;
      g.next_sequence = 0;
      const int world = static_cast<int>(h.members.size()) + 1;
      auto joined = fabric_->join(h.id, world, nccl_rank, settings_.timeout);
      if (!joined) {
        g.join_failed = joined.error();
        return make_error(joined.error().code, "nccl: joining the publisher's group (epoch " +
                                                   std::to_string(h.epoch) +
                                                   ") failed: " + joined.error().message);
      }
      g.member = std::move(*joined);
    }
    if (!g.member) {  // this epoch's join failed already: its root gave up on it too
      return make_error(g.join_failed.code, "nccl: the publisher's group (epoch " +
                                                std::to_string(g.epoch) +
                                                ") could not be joined: " + g.join_failed.message);
    }
    if (auto why = g.member->broken(); !why.empty()) {
      return make_error(errc::io_error, "nccl: the group (epoch " + std::to_string(g.epoch) +
                                            ") was aborted: " + why +
                                            "; the publisher builds a new one at its next update");
    }
    if (h.sequence < g.next_sequence) {
      return make_error(errc::invalid_argument, "nccl: transport_handle.sequence " +
                                                    std::to_string(h.sequence) +
                                                    " was broadcast already (this rank is at " +
                                                    std::to_string(g.next_sequence) + ")");
    }
    auto& member = *g.member;
    auto fail = [&](const error& e) -> error {
      member.abort(e.message);
      return e;
    };
    const auto want = nccl_handle::header_of(h, id);
    for (;;) {
      nccl_handle::header_block hb{};
      auto ok = member.broadcast(g.header.data, hb.size(), 0);
      if (ok) ok = member.wait(deadline);
      if (ok) ok = fabric_->read(hb.data(), g.header.data, hb.size());
      if (!ok) return fail(ok.error());
      auto got = nccl_handle::header_decode(hb);
      if (!got) return fail(got.error());
      g.next_sequence = got->sequence + 1;
      if (got->sequence < want.sequence) {  // an update this rank skipped: drop its bytes
        const auto slice = std::min(got->bytes, h.bucket_bytes);
        if (g.scratch.nbytes < slice) {
          g.scratch = {};
          auto b = fabric_->allocate(std::max<std::uint64_t>(slice, 1));
          if (!b) return fail(b.error());
          g.scratch = std::move(*b);
        }
        if (auto d = broadcast_slices(member, g.scratch.data, got->bytes, h.bucket_bytes, h.buckets,
                                      true, deadline);
            !d) {
          return fail(d.error());
        }
        continue;
      }
      if (*got != want) {
        return fail({errc::io_error, "nccl: out of step with the publisher: it sent sequence " +
                                         std::to_string(got->sequence) + " (" +
                                         std::to_string(got->bytes) + " bytes) where sequence " +
                                         std::to_string(want.sequence) + " (" +
                                         std::to_string(want.bytes) + " bytes) was expected"});
      }
      break;
    }
    auto into = pooled(h.bytes);
    if (!into) return fail(into.error());
    if (auto r = broadcast_slices(member, into->data, h.bytes, h.bucket_bytes, h.buckets, false,
                                  deadline);
        !r) {
      return fail(r.error());
    }
    return into;
  }

  result<block> pooled(std::uint64_t bytes) {
    {
      std::lock_guard lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->nbytes >= bytes && (best == free_.end() || it->nbytes < best->nbytes)) best = it;
      }
      if (best != free_.end()) {
        block b = std::move(*best);
        free_.erase(best);
        return b;
      }
    }
    return fabric_->allocate(std::max<std::uint64_t>(bytes, 1));
  }

  const transport_settings settings_;
  const std::shared_ptr<group_fabric> fabric_;
  std::int32_t rank_ = 0;

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<group_state>> groups_;
  std::uint64_t uses_ = 0;
  std::map<update_id, block> held_;
  std::vector<block> free_;
};

transport_caps caps_for(const memory_location& where) {
  return {.cpu_memory = where.host(),
          .gpu_memory = !where.host(),
          .cross_process = true,
          .cross_node = true,
          .zero_copy_import = false,
          .collective = true};
}

class nccl_transport final : public transport {
 public:
  nccl_transport(transport_settings settings, std::shared_ptr<group_fabric> fabric)
      : settings_(std::move(settings)), fabric_(std::move(fabric)) {}
  std::string_view name() const override { return "nccl"; }
  transport_caps caps() const override { return caps_for(fabric_->memory()); }

  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    auto group = random_hex(8);
    if (group.empty()) return make_error(errc::io_error, "nccl: the kernel gave no random bytes");
    auto header = fabric_->allocate(nccl_handle::header_bytes);
    if (!header) return header.error();
    return std::unique_ptr<publisher_transport>(
        std::make_unique<nccl_publisher>(settings_, fabric_, std::move(group), std::move(*header)));
  }

  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return std::unique_ptr<consumer_transport>(std::make_unique<nccl_consumer>(settings_, fabric_));
  }

 private:
  const transport_settings settings_;
  const std::shared_ptr<group_fabric> fabric_;
};

}  // namespace

result<transport_settings> settings_read(const transport_options& options) {
  options_reader reader("nccl", options);
  transport_settings s;
  auto consumers = ranks_parse(reader.get_string("consumers", "0"));
  if (!consumers) return consumers.error();
  s.consumers = std::move(*consumers);
  auto device = reader.get_uint("device", 0, 0, 1023);
  if (!device) return device.error();
  auto slots = reader.get_uint("slots", 2, 1, 64);
  if (!slots) return slots.error();
  auto bucket_bytes = reader.get_uint("bucket_bytes", std::uint64_t{256} << 20,
                                      std::uint64_t{1} << 20, std::uint64_t{16} << 30);
  if (!bucket_bytes) return bucket_bytes.error();
  auto buckets = reader.get_uint("buckets", 2, 1, 16);
  if (!buckets) return buckets.error();
  auto timeout = reader.get_uint("timeout_ms", 60000, 1, 3600000);
  if (!timeout) return timeout.error();
  if (auto ok = reader.finish(); !ok) return ok.error();
  s.device = static_cast<int>(*device);
  s.slots = *slots;
  s.bucket_bytes = *bucket_bytes;
  s.buckets = static_cast<unsigned>(*buckets);
  s.timeout = std::chrono::milliseconds(*timeout);
  return s;
}

result<std::unique_ptr<transport>> make_transport(const transport_options& options,
                                                  const fabric_factory& make_fabric) {
  auto settings = settings_read(options);
  if (!settings) return settings.error();
  auto fabric = make_fabric(settings->device);
  if (!fabric) return fabric.error();
  return std::unique_ptr<transport>(
      std::make_unique<nccl_transport>(std::move(*settings), std::move(*fabric)));
}

}  // namespace wsync::nccl
