#pragma once
// The node: one UCX worker, its progress thread, what it serves and what it pulls. Both halves of
// the transport own one. Its member functions live in three files by concern:
//   node.cpp        the worker, its progress thread, the endpoint and rkey caches, sending
//   node_serve.cpp  serving fetches (a publisher's exposed updates, a relay's imports)
//   node_pull.cpp   pulling chunks, with failover to a source's fallbacks
// Internal to transports/ucx/.

#include <ucp/api/ucp.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ucx/handle.hpp"
#include "ucx/slot_pool.hpp"
#include "ucx/ucx_common.hpp"
#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync::ucx_detail {

// Active-message ids of our protocol: a consumer asks a source for one chunk, the source answers
// with the bytes (tag-matched) or with a failure.
inline constexpr unsigned am_fetch = 17;
inline constexpr unsigned am_fail = 18;
// Fetches a relay holds for updates it has not started importing yet; past this they are refused
// with try_again rather than queued without bound.
inline constexpr std::size_t max_early_fetches = 4096;
// Requesters waiting for one chunk that has not landed at a relay: a relay has a few children,
// so more is a misbehaving peer, refused with try_again.
inline constexpr std::size_t max_waiting_per_chunk = 256;
// A requester's worker address: UCX's are well under 1 KiB; anything far larger, or empty, is
// not one and is never handed to ucp_ep_create.
inline constexpr std::uint32_t max_worker_address_bytes = 16384;

// Header of an am_fetch: which chunk, and the tag the bytes must carry. The update id follows.
struct fetch_header {
  std::uint64_t tag;
  std::uint64_t offset;
  std::uint64_t length;
  std::uint32_t segment;
  std::uint32_t id_bytes;
  std::uint32_t address_bytes;  // the requester's worker address follows the id
  std::uint32_t reserved;
};
// Header of an am_fail: the tag of the refused fetch, our error code; the message follows.
struct fail_header {
  std::uint64_t tag;
  std::uint32_t code;
  std::uint32_t text_bytes;
};

struct fetch_request {
  update_id id;
  std::string requester;  // its worker address, hex
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint64_t tag = 0;
  ucp_ep_h reply_ep = nullptr;
  clock_type::time_point deadline;
};

// An update this node serves: a publisher's exposed slot, or what a consumer is importing.
struct served_update {
  slot* s = nullptr;
  std::vector<std::uint64_t> offsets;  // of each segment inside the slot
  std::vector<std::uint64_t> nbytes;
  std::uint64_t chunk = 0;
  std::vector<std::vector<std::uint64_t>> checksums;
  bool verify = false;  // relays check each chunk once, before its first forward
  std::vector<std::vector<std::uint8_t>> landed, verified;
  std::map<std::pair<std::uint32_t, std::uint64_t>, std::vector<fetch_request>> waiting;
};

// A chunk this node sends in answer to a fetch, until UCX ends it. A requester that gave up on
// the chunk never matches the send (a rendezvous then waits forever), so a send still running
// past its deadline is ended by closing its endpoint (see expire_sends).
struct chunk_send {
  class node* owner = nullptr;
  slot* s = nullptr;
  ucp_ep_h ep = nullptr;
  clock_type::time_point deadline;
};

struct pull_job;
struct pull_op {
  class node* owner = nullptr;
  std::shared_ptr<pull_job> job;
  std::size_t lane = 0;
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  std::uint64_t tag = 0;
  void* request = nullptr;
  ucp_rkey_h rkey = nullptr;  // a get's remote key: kept until the get ends (see rkey_done)
  // UCX may complete an operation inside the call that starts it: the callback then only
  // records the status here, and the issuing code finishes the op after the call returns.
  bool issuing = false;
  std::optional<ucs_status_t> inline_status;
  // Given up on (its source died with it matched, and UCX never ends it): its chunk was pulled
  // again elsewhere, and the callback, should it ever come, only frees it.
  bool abandoned = false;
};

using chunk_ref = std::pair<std::uint32_t, std::uint64_t>;  // (segment, offset)

// One stripe of an import: the chunks it pulls from one source (and that source's fallbacks).
struct pull_lane {
  std::vector<std::string> sources;  // hex addresses: the source, then its fallbacks
  std::size_t source = 0;            // the one pulled from now
  bool switching = false;            // waiting for the old source's operations to end
  clock_type::time_point switching_since;
  ucp_ep_h ep = nullptr;
  bool get = false;
  std::string rkey_hex;  // get only
  ucp_rkey_h rkey = nullptr;
  process_id publisher;  // get only: the publisher's process, when its handle names it
  std::vector<std::uint64_t> bases;
  std::vector<chunk_ref> order, retry;  // its chunks; those to pull again after a switch
  std::size_t next = 0, inflight = 0;
  std::vector<pull_op*> ops;
};

struct pull_job {
  update_id id;
  std::string context;  // "update_id=... rank=..." for messages
  slot* landing = nullptr;
  std::vector<std::uint64_t> offsets, nbytes;
  std::uint64_t chunk = 0;
  std::vector<pull_lane> lanes;  // one per stripe; chunk i of the update is lane i % lanes
  std::size_t total = 0, done = 0;
  std::uint64_t window = 1;  // chunks in flight per lane
  std::optional<error> failure;
  std::promise<result<void>> finished;

  std::size_t inflight() const {
    std::size_t n = 0;
    for (const auto& l : lanes) n += l.inflight;
    return n;
  }
};

class node {
 public:
  static result<std::unique_ptr<node>> create(const ucx_settings& cfg, std::string side,
                                              bool relay);
  ~node();

  const std::string& address() const { return address_; }
  slot_pool& pool() { return *pool_; }
  const ucx_settings& settings() const { return cfg_; }

  /// Runs `f` on the worker thread and returns its result; never call from that thread.
  template <class F>
  auto call(F&& f) -> decltype(f()) {
    std::packaged_task<decltype(f())()> task(std::forward<F>(f));
    auto done = task.get_future();
    {
      std::lock_guard lock(tasks_mutex_);
      tasks_.emplace_back([&task] { task(); });
    }
    tasks_cv_.notify_all();
    return done.get();
  }

  // --- worker-thread side: serving (node_serve.cpp) -------------------------------------------

  void serve_add(const update_id& id, served_update u);
  void serve_remove(const update_id& id);

  // --- worker-thread side: pulling (node_pull.cpp) -------------------------------------------

  // Starts pulling `job`; its promise is set once every chunk landed or the job failed and no
  // operation is left in flight.
  void pull_start(const std::shared_ptr<pull_job>& job);

  // The source a lane pulls from failed (refused a chunk, went away, could not be reached):
  // the lane goes on from its next source, keeping every chunk that already landed, or the
  // job fails with `why` when this was the last one.
  void source_failed(pull_job& job, std::size_t i, error why);

  // Fails a job from outside (its caller gave up); operations in flight are cancelled.
  void pull_abort(const std::shared_ptr<pull_job>& job, error why);

  // --- callbacks from UCX (worker thread) ----------------------------------------------------

  // node_pull.cpp
  static void on_recv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                      void* user);
  static void on_get(void* request, ucs_status_t status, void* user);
  static void op_completed(pull_op* op, ucs_status_t status);
  static ucs_status_t on_fail(void* arg, const void* header, std::size_t header_bytes, void*,
                              std::size_t, const ucp_am_recv_param_t*);
  // node_serve.cpp
  static ucs_status_t on_fetch(void* arg, const void* header, std::size_t header_bytes, void*,
                               std::size_t, const ucp_am_recv_param_t* param);
  // node.cpp
  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status);

 private:
  node(const ucx_settings& cfg, std::string side, bool relay)
      : cfg_(cfg), side_(std::move(side)), relay_(relay) {}

  // --- node.cpp: the worker, its thread, endpoints and remote keys, sending ------------------

  result<void> init();
  void loop();
  void shutdown();
  void close_endpoint(ucp_ep_h ep, bool force);
  void close_failed_endpoints();
  // Takes `ep` out of the address table and has the loop close it; false when it is closing
  // already.
  bool retire_endpoint(ucp_ep_h ep);
  // Forgets `ep` (it failed, or its peer stopped taking what we send): it is closed from the
  // loop, fetches it asked for are dropped and lanes pulling through it go on from their next
  // source, told `why`.
  bool drop_endpoint(ucp_ep_h ep, const std::string& why);  // false: closing already
  // Whether anything but `job` still uses `ep`: another job's lane, a send, a held fetch.
  bool endpoint_shared(ucp_ep_h ep, const pull_job* job) const;
  result<ucp_ep_h> endpoint(const std::string& address, const std::string& context);
  result<ucp_rkey_h> remote_key(ucp_ep_h ep, const std::string& packed, const std::string& context);
  // A remote key outlives every get that uses it (UCX: destroyed only once they ended): gets
  // count their key in and out, and a key forgotten with gets still running is destroyed when
  // the last one ends.
  void rkey_used(ucp_rkey_h rkey);
  void rkey_done(ucp_rkey_h rkey);
  void forget_rkeys(ucp_ep_h ep);
  // Over shared memory UCX reports no dead peer, and the keys of a publisher that exited keep
  // its slots mapped here (the whole ring: the model's size, twice). So the publisher's process
  // is watched where its handle names one this node can check, and once it exited, an
  // endpoint to it that nothing uses is closed and its keys go.
  void watch_publisher(ucp_ep_h ep, const pull_lane& lane);
  void forget_exited_publishers();
  result<void> send_am(ucp_ep_h ep, unsigned id, std::string header, std::uint32_t flags,
                       const std::string& context);

  // --- node_serve.cpp: serving ---------------------------------------------------------------

  void answer_fetches();
  void forget_requests_of(ucp_ep_h ep);
  void chunk_landed(const update_id& id, std::uint32_t segment, std::uint64_t offset);
  void serve(const fetch_request& r);
  void serve(served_update& u, const fetch_request& r);
  void refuse(const fetch_request& r, errc code, const std::string& text);
  void expire_early(clock_type::time_point now);
  /// Refuses fetches that waited at this relay for a chunk longer than early_patience().
  void expire_waiting(clock_type::time_point now);
  // How long a fetch for an update this relay has not started waits: half the timeout.
  std::chrono::milliseconds early_patience() const {
    return std::chrono::milliseconds(cfg_.timeout_ms / 2);
  }
  void expire_sends(clock_type::time_point now);

  // --- node_pull.cpp: pulling ----------------------------------------------------------------

  void switch_sources();
  void pull_more(const std::shared_ptr<pull_job>& shared);
  result<void> send_fetch(const pull_job& job, const pull_lane& lane, const pull_op& op);
  void op_done(pull_op* op, ucs_status_t status);
  void op_account(pull_op* op, ucs_status_t status);
  void pull_cancel(pull_job& job, std::size_t i, bool force_endpoint);
  void abandon_inflight(pull_job& job, pull_lane& lane, bool retry);
  void pull_check_done(const std::shared_ptr<pull_job>& job);

  ucx_settings cfg_;
  std::string side_;
  bool relay_;
  ucp_context_h ctx_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  std::string address_bytes_;  // the same, binary, as fetches carry it
  std::unique_ptr<slot_pool> pool_;

  std::thread thread_;
  std::mutex tasks_mutex_;
  std::condition_variable tasks_cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;

  // Worker thread only, from here on.
  std::map<std::string, ucp_ep_h> eps_;
  std::vector<ucp_ep_h> closing_;
  std::map<update_id, served_update> served_;
  std::deque<fetch_request> early_;
  std::vector<fetch_request> incoming_;  // fetches received, answered from the loop
  std::vector<std::shared_ptr<pull_job>> jobs_;
  std::unordered_map<std::uint64_t, pull_op*> ops_by_tag_;
  struct cached_rkey {
    ucp_ep_h ep;
    std::string packed;
    ucp_rkey_h rkey;
    std::size_t gets = 0;    // running gets that use it
    bool forgotten = false;  // its endpoint closed: never handed out again
  };
  static constexpr std::size_t max_rkeys = 64;
  std::vector<cached_rkey> rkeys_;
  std::unordered_map<ucp_ep_h, process_id> publishers_;  // see watch_publisher
  clock_type::time_point publishers_checked_at_{};
  std::uint64_t next_tag_ = 1;
  std::uint64_t sends_in_flight_ = 0;  // active messages and chunk sends
  std::unordered_set<chunk_send*> chunk_sends_;
  // When a chunk send on each endpoint last completed: a peer still taking chunks is slow, not
  // gone, and its endpoint is not closed for one late send.
  std::unordered_map<ucp_ep_h, clock_type::time_point> sends_done_at_;
};

// What a node serves of an update in `s`: a publisher's (`landed`: every chunk is there, none
// needs checking) or a relay's import (chunks are served as they land, each checked once).
served_update served_from(slot* s, std::vector<std::uint64_t> offsets,
                          std::vector<std::uint64_t> nbytes, std::uint64_t chunk,
                          std::vector<std::vector<std::uint64_t>> checksums, bool landed);

}  // namespace wsync::ucx_detail
