#pragma once
// NCCL's broadcast groups in host memory, for the nccl transport's tests on machines without a
// GPU: members are threads of one process sharing a host_fabric. A member's k-th broadcast is
// collective k of its group; it completes once every member queued it, when the root's bytes
// are copied to the others (so a member that never comes holds everyone up, as in NCCL). wait()
// blocks until every collective the member queued completed. A missed deadline, a failed join
// or an abort breaks the whole group, as ncclCommAbort makes the peers' collectives fail.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "wsync/transports/nccl_transport.hpp"

namespace wsync::testing {

class host_fabric final : public nccl::group_fabric {
 public:
  std::atomic<std::uint64_t> allocated_bytes{0};
  std::atomic<int> joins{0};
  std::atomic<int> members{0};       ///< joined and not yet destroyed
  std::atomic<int> reads_waited{0};  ///< reads_done() calls: releases before a reuse

  memory_location memory() const override { return {}; }
  void reads_done() override { ++reads_waited; }

  result<nccl::unique_id> make_id() override {
    nccl::unique_id id{};
    const auto n = ++ids_;
    std::memcpy(id.data(), &n, sizeof n);
    return id;
  }

  result<std::unique_ptr<nccl::group_member>> join(const nccl::unique_id& id, int world, int rank,
                                                   std::chrono::milliseconds timeout,
                                                   const std::atomic<bool>* cancel) override {
    ++joins;
    std::shared_ptr<group> g;
    {
      std::lock_guard lock(mu_);
      auto& slot = groups_[id];
      if (!slot) slot = std::make_shared<group>(world);
      g = slot;
    }
    std::unique_lock lock(g->mu);
    if (g->world != world) {
      return make_error(errc::invalid_argument, "host group: a world of " + std::to_string(world) +
                                                    " where its members said " +
                                                    std::to_string(g->world));
    }
    if (!g->joined.insert(rank).second) {
      return make_error(errc::invalid_argument,
                        "host group: rank " + std::to_string(rank) + " joined twice");
    }
    g->cv.notify_all();
    const auto got = g->wait(lock, std::chrono::steady_clock::now() + timeout, cancel, [&] {
      return !g->aborted.empty() || static_cast<int>(g->joined.size()) == g->world;
    });
    if (!g->aborted.empty()) {
      return make_error(errc::io_error, "host group: aborted while joining: " + g->aborted);
    }
    if (got == waited::cancelled) {
      g->abort_locked("rank " + std::to_string(rank) + ": cancelled while joining");
      return make_error(errc::io_error, "host group: " + g->aborted);
    }
    if (got == waited::timed_out) {
      g->abort_locked("rank " + std::to_string(rank) + ": the other members did not join");
      return make_error(errc::timeout, "host group rank " + std::to_string(rank) +
                                           ": the other members did not join within " +
                                           std::to_string(timeout.count()) + " ms");
    }
    return std::unique_ptr<nccl::group_member>(std::make_unique<member>(g, rank, members, cancel));
  }

  result<nccl::block> allocate(std::uint64_t nbytes) override {
    auto v = std::make_shared<std::vector<std::byte>>(nbytes, std::byte{0xee});
    allocated_bytes += nbytes;
    return nccl::block{v->data(), nbytes, v};
  }

  result<void> write(std::byte* dst, const void* src, std::uint64_t nbytes) override {
    std::memcpy(dst, src, nbytes);
    return {};
  }

  result<void> read(void* dst, const std::byte* src, std::uint64_t nbytes) override {
    std::memcpy(dst, src, nbytes);
    return {};
  }

  /// Breaks every group, as if the network went down under them.
  void abort_all(const std::string& why) {
    std::lock_guard lock(mu_);
    for (auto& [id, g] : groups_) {
      std::lock_guard glock(g->mu);
      g->abort_locked(why);
    }
  }

 private:
  struct collective {
    int root = -1;
    std::uint64_t nbytes = 0;
    std::map<int, std::byte*> posted;
    bool done = false;
  };

  enum class waited { done, timed_out, cancelled };

  struct group {
    explicit group(int w) : world(w) {}
    std::mutex mu;
    std::condition_variable cv;
    const int world;
    std::set<int> joined;
    std::vector<collective> ops;
    std::string aborted;
    void abort_locked(const std::string& why) {
      if (aborted.empty()) aborted = why;
      cv.notify_all();
    }
    // Waits for `done` until `deadline`, looking at `*cancel` (set by another thread, which
    // does not notify) every few milliseconds.
    template <class Pred>
    waited wait(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point deadline,
                const std::atomic<bool>* cancel, Pred done) {
      while (!done()) {
        if (cancel && cancel->load()) return waited::cancelled;
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) return waited::timed_out;
        cv.wait_for(lock, std::min<std::chrono::steady_clock::duration>(
                              deadline - now, std::chrono::milliseconds(5)));
      }
      return waited::done;
    }
  };

  class member final : public nccl::group_member {
   public:
    member(std::shared_ptr<group> g, int rank, std::atomic<int>& alive,
           const std::atomic<bool>* cancel)
        : g_(std::move(g)), rank_(rank), alive_(alive), cancel_(cancel) {
      ++alive_;
    }
    ~member() override { --alive_; }
    member(const member&) = delete;
    member& operator=(const member&) = delete;

    // Posting never waits here (every member's memory is at hand), so the deadline is unused.
    result<void> broadcast(std::byte* data, std::uint64_t nbytes, int root,
                           std::chrono::steady_clock::time_point /*deadline*/) override {
      std::lock_guard lock(g_->mu);
      if (!g_->aborted.empty()) return make_error(errc::io_error, "aborted: " + g_->aborted);
      const std::size_t k = posted_++;
      if (g_->ops.size() <= k) g_->ops.resize(k + 1);
      auto& op = g_->ops[k];
      if (op.posted.empty()) {
        op.root = root;
        op.nbytes = nbytes;
      } else if (op.root != root || op.nbytes != nbytes) {
        g_->abort_locked("broadcast " + std::to_string(k) + ": rank " + std::to_string(rank_) +
                         " posted " + std::to_string(nbytes) + " bytes from root " +
                         std::to_string(root) + ", another member " + std::to_string(op.nbytes) +
                         " from root " + std::to_string(op.root));
        return make_error(errc::io_error, "aborted: " + g_->aborted);
      }
      op.posted[rank_] = data;
      if (static_cast<int>(op.posted.size()) == g_->world) {
        const std::byte* from = op.posted.at(op.root);
        for (auto& [r, to] : op.posted) {
          if (r != op.root && op.nbytes > 0) std::memcpy(to, from, op.nbytes);
        }
        op.done = true;
        g_->cv.notify_all();
      }
      return {};
    }

    // In stream order: after every collective this member queued (which the peers may still
    // hold up), then at once.
    result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) override {
      if (auto r = wait(std::chrono::steady_clock::now() + std::chrono::seconds(60)); !r) return r;
      if (nbytes > 0) std::memcpy(dst, src, nbytes);
      return {};
    }

    result<void> wait(std::chrono::steady_clock::time_point deadline) override {
      std::unique_lock lock(g_->mu);
      auto all_done = [&] {
        for (std::size_t k = 0; k < posted_; ++k) {
          if (!g_->ops[k].done) return false;
        }
        return true;
      };
      const auto got =
          g_->wait(lock, deadline, cancel_, [&] { return !g_->aborted.empty() || all_done(); });
      if (!g_->aborted.empty()) {
        return make_error(errc::io_error, "a member failed: " + g_->aborted);
      }
      if (got == waited::cancelled) {
        g_->abort_locked("rank " + std::to_string(rank_) + ": cancelled: the transport is closing");
        return make_error(errc::io_error, g_->aborted);
      }
      if (got == waited::timed_out) {
        g_->abort_locked("rank " + std::to_string(rank_) +
                         ": the collectives did not complete by the deadline");
        return make_error(errc::timeout, g_->aborted);
      }
      return {};
    }

    void abort(const std::string& why) override {
      std::lock_guard lock(g_->mu);
      g_->abort_locked(why);
    }

    std::string broken() const override {
      std::lock_guard lock(g_->mu);
      return g_->aborted;
    }

   private:
    std::shared_ptr<group> g_;
    int rank_;
    std::atomic<int>& alive_;
    const std::atomic<bool>* cancel_;
    std::size_t posted_ = 0;
  };

  std::mutex mu_;
  std::map<nccl::unique_id, std::shared_ptr<group>> groups_;
  std::atomic<std::uint64_t> ids_{0};
};

}  // namespace wsync::testing
