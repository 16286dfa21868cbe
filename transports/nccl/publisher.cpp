// The nccl transport's publisher (nccl/sides.hpp): NCCL rank 0. expose() hands each update to a
// sender thread, which joins the group when the epoch is new and broadcasts the updates one
// after another in expose order, from a pooled slot or from the caller's lent tensors.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "nccl/handle.hpp"
#include "nccl/sides.hpp"
#include "src/slot_ring.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::nccl::detail {
namespace {

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
    closing();
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    work_.notify_all();
    sender_.join();
  }

  memory_location memory() const override { return fabric_->memory(); }

  // A join or broadcast in flight (peers that never come, or stopped) ends now, not at its
  // deadline: its waits watch closing_. A lent update's release then returns soon after.
  void closing() override { closing_ = true; }

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
    if (consumers.size() > nccl_handle::max_members) {
      return make_error(errc::invalid_argument, "nccl: more than " +
                                                    std::to_string(nccl_handle::max_members) +
                                                    " consumers for update_id=" + id +
                                                    " (one communicator holds them all)");
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
      auto joined = fabric_->join(j.h.id, world, 0, settings_.timeout, &closing_);
      if (!joined) {
        return "joining the group of " + std::to_string(world) + " (epoch " +
               std::to_string(j.h.epoch) + ") failed: " + joined.error().message;
      }
      member = std::move(*joined);
      member_epoch = j.h.epoch;
    }
    const auto hb = nccl_handle::header_encode(nccl_handle::header_of(j.h, j.id));
    auto ok = fabric_->write(header_.data, hb.data(), hb.size());
    if (ok) ok = member->broadcast(header_.data, hb.size(), 0, deadline);
    if (ok && j.slot) {
      ok = broadcast_slices(*member, j.h, deadline,
                            [&](const nccl_plan::slice& s) -> result<std::byte*> {
                              return j.slot->memory.data + s.offset;
                            });
    } else if (ok) {
      ok = broadcast_lent(*member, j, deadline);
    }
    if (ok) return {};
    member->abort(ok.error().message);
    return ok.error().message;
  }

  // A lent update: each slice of the wire is packed from the caller's tensors into one of
  // `buckets` staging buffers, in turn, and broadcast from there. The member runs copies and
  // broadcasts in order, so a buffer is packed again only after its last broadcast went out.
  result<void> broadcast_lent(group_member& member, const job& j, clock::time_point deadline) {
    const auto bucket = std::min(j.h.bytes, j.h.bucket_bytes);
    if (staging_.size() < j.h.buckets || staging_.front().nbytes < bucket) {
      staging_.clear();
      for (unsigned k = 0; k < j.h.buckets; ++k) {
        auto b = fabric_->allocate(std::max<std::uint64_t>(bucket, 1));
        if (!b) return b.error();
        staging_.push_back(std::move(*b));
      }
    }
    auto piece = j.lent.begin();  // slices come in wire order: pieces are passed once
    return broadcast_slices(
        member, j.h, deadline, [&](const nccl_plan::slice& s) -> result<std::byte*> {
          std::byte* into = staging_[s.stream].data;
          const auto end = s.offset + s.nbytes;
          while (piece != j.lent.end() && piece->at + piece->nbytes <= s.offset) ++piece;
          for (auto p = piece; p != j.lent.end() && p->at < end; ++p) {
            const auto from = std::max(p->at, s.offset);
            const auto to = std::min(p->at + p->nbytes, end);
            if (auto r = member.copy(into + (from - s.offset), p->data + (from - p->at), to - from);
                !r) {
              return r.error();
            }
          }
          return into;
        });
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
  std::atomic<bool> closing_{false};  ///< read by the sender's waits, without the lock
  std::thread sender_;                // last: starts once everything above is built
};

}  // namespace

std::unique_ptr<publisher_transport> make_publisher(transport_settings settings,
                                                    std::shared_ptr<group_fabric> fabric,
                                                    std::string group, block header) {
  return std::make_unique<nccl_publisher>(std::move(settings), std::move(fabric), std::move(group),
                                          std::move(header));
}

}  // namespace wsync::nccl::detail
