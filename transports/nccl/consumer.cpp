// The nccl transport's consumer (nccl/sides.hpp): in each publisher's group, NCCL rank 1 + its
// place in the handle's members (a model published in shards has one group per publisher rank,
// and the consumer is in each). Imports of one group run one at a time (its broadcasts are in
// order); each receives headers until its own update's, dropping the bytes of updates this rank
// skipped.

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "nccl/handle.hpp"
#include "nccl/sides.hpp"

namespace wsync::nccl::detail {
namespace {

std::string ranks_text(const std::vector<std::int32_t>& ranks) {
  std::string s;
  for (auto r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

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

  // Joins and broadcasts watch closing_ (the flag a member keeps from its join), so an import
  // waiting for a publisher that never comes ends now; later ones are refused.
  void closing() override { closing_ = true; }

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
    block released;  // freed, when not pooled, after the lock (cudaFree may wait for the device)
    {
      std::lock_guard lock(mu_);
      auto it = held_.find(id);
      if (it == held_.end()) return;
      released = std::move(it->second);
      held_.erase(it);
    }
    // Imports are read on the default stream (transport.hpp): what the program queued there
    // (a copy out of a view, still behind its kernels) ends before a receive may reuse it.
    fabric_->reads_done();
    std::lock_guard lock(mu_);
    if (free_.size() < settings_.slots) free_.push_back(std::move(released));
  }

 private:
  // The state of publisher group `name`, made on first use; the least recently used group goes
  // when there are too many (a publisher that restarted has a new group).
  result<std::shared_ptr<group_state>> group_for(const std::string& name) {
    // An evicted group's communicator is finalized (up to seconds) after the lock, not under it.
    std::shared_ptr<group_state> evicted;
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
        evicted = std::move(oldest->second);  // an import still running keeps it alive
        groups_.erase(oldest);
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
    if (closing_) {
      return make_error(errc::io_error, "nccl: cancelled: the transport is closing");
    }
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
      auto joined = fabric_->join(h.id, world, nccl_rank, settings_.timeout, &closing_);
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
      auto ok = member.broadcast(g.header.data, hb.size(), 0, deadline);
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
        auto skipped = h;
        skipped.bytes = got->bytes;
        if (auto d = broadcast_slices(
                member, skipped, deadline,
                [&](const nccl_plan::slice&) -> result<std::byte*> { return g.scratch.data; });
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
    if (auto r = broadcast_slices(
            member, h, deadline,
            [&](const nccl_plan::slice& s) -> result<std::byte*> { return into->data + s.offset; });
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
  /// Read by the members' waits without a lock; before groups_, so it outlives their members.
  std::atomic<bool> closing_{false};

  std::mutex mu_;
  std::map<std::string, std::shared_ptr<group_state>> groups_;
  std::uint64_t uses_ = 0;
  std::map<update_id, block> held_;
  std::vector<block> free_;
};

}  // namespace

std::unique_ptr<consumer_transport> make_consumer(transport_settings settings,
                                                  std::shared_ptr<group_fabric> fabric) {
  return std::make_unique<nccl_consumer>(std::move(settings), std::move(fabric));
}

}  // namespace wsync::nccl::detail
