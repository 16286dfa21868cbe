#include "ucx/ucx.hpp"

#include <sys/mman.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unordered_map>

#include "ucx/handle.hpp"
#include "ucx/slot_pool.hpp"
#include "ucx/ucx_common.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {
namespace ucx_detail {

// Active-message ids of our protocol: a consumer asks a source for one chunk, the source answers
// with the bytes (tag-matched) or with a failure.
constexpr unsigned am_fetch = 17;
constexpr unsigned am_fail = 18;
// Fetches a relay holds for updates it has not started importing yet; past this they are refused
// with try_again rather than queued without bound.
constexpr std::size_t max_early_fetches = 4096;

// --- the node: one UCX worker, its progress thread, what it serves and what it pulls ---------

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
                                              bool relay) {
    std::unique_ptr<node> n(new node(cfg, std::move(side), relay));
    if (auto ok = n->init(); !ok) return ok.error();
    n->thread_ = std::thread([p = n.get()] { p->loop(); });
    return n;
  }

  ~node() {
    if (thread_.joinable()) {
      {
        std::lock_guard lock(tasks_mutex_);
        stop_ = true;
      }
      tasks_cv_.notify_all();
      thread_.join();
    }
    // The worker first (it ends whatever UCX still holds, which may touch the slots), then the
    // slots, unregistered while the context still exists.
    if (worker_) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    pool_.reset();
    if (ctx_) ucp_cleanup(ctx_);
  }

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

  // --- worker-thread side: serving -----------------------------------------------------------

  void serve_add(const update_id& id, served_update u) {
    auto& entry = served_[id] = std::move(u);
    for (auto it = early_.begin(); it != early_.end();) {
      if (it->id == id) {
        serve(entry, *it);
        it = early_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void serve_remove(const update_id& id) {
    auto it = served_.find(id);
    if (it == served_.end()) return;
    for (auto& [key, requests] : it->second.waiting) {
      for (auto& r : requests) {
        refuse(r, errc::unknown_update,
               "unknown update_id: " + id + " was released by the " + side_ + " before chunk " +
                   std::to_string(r.offset / it->second.chunk) + " of segment " +
                   std::to_string(r.segment) + " arrived");
      }
    }
    served_.erase(it);
  }

  // --- worker-thread side: pulling -----------------------------------------------------------

  // Starts pulling `job`; its promise is set once every chunk landed or the job failed and no
  // operation is left in flight.
  void pull_start(const std::shared_ptr<pull_job>& job) {
    jobs_.push_back(job);
    for (std::size_t i = 0; i < job->lanes.size(); ++i) {
      auto& lane = job->lanes[i];
      if (auto ep = endpoint(lane.sources[0], job->context); !ep) {
        source_failed(*job, i, ep.error());
      } else {
        lane.ep = *ep;
        if (lane.get) {
          auto rkey = remote_key(lane.ep, lane.rkey_hex, job->context);
          if (!rkey) job->failure = rkey.error();
          if (rkey) lane.rkey = *rkey;
        }
      }
    }
    pull_more(job);
    pull_check_done(job);
  }

  // The source a lane pulls from failed (refused a chunk, went away, could not be reached):
  // the lane goes on from its next source, keeping every chunk that already landed, or the
  // job fails with `why` when this was the last one.
  void source_failed(pull_job& job, std::size_t i, error why) {
    auto& lane = job.lanes[i];
    if (job.failure || lane.switching) return;
    if (lane.source + 1 >= lane.sources.size()) {
      job.failure = std::move(why);
      for (std::size_t k = 0; k < job.lanes.size(); ++k) pull_cancel(job, k, false);
      return;
    }
    lane.switching_since = clock_type::now();
    log_warn("ucx: " + side_ + ": source " + std::to_string(lane.source) + " of update_id " +
             job.id + (job.lanes.size() > 1 ? " stripe " + std::to_string(i) : "") + " failed (" +
             why.message + "); pulling the remaining chunks from source " +
             std::to_string(lane.source + 1));
    lane.switching = true;
    pull_cancel(job, i, false);
  }

  // Fails a job from outside (its caller gave up); operations in flight are cancelled.
  void pull_abort(const std::shared_ptr<pull_job>& job, error why) {
    if (job->failure) return;
    job->failure = std::move(why);
    for (std::size_t k = 0; k < job->lanes.size(); ++k) pull_cancel(*job, k, true);
    pull_check_done(job);
  }

  // --- callbacks from UCX (worker thread) ----------------------------------------------------

  static void on_recv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                      void* user) {
    auto* op = static_cast<pull_op*>(user);
    bool short_read = status == UCS_OK && info->length != op->length;
    ucp_request_free(request);
    op_completed(op, short_read ? UCS_ERR_MESSAGE_TRUNCATED : status);
  }

  static void on_get(void* request, ucs_status_t status, void* user) {
    ucp_request_free(request);
    op_completed(static_cast<pull_op*>(user), status);
  }

  static void op_completed(pull_op* op, ucs_status_t status) {
    if (op->abandoned) {
      // UCX may end it only when the worker is destroyed, after the slots are gone.
      if (op->owner->pool_) op->owner->pool_->busy_end(op->job->landing);
      delete op;
    } else if (op->issuing) {
      op->inline_status = status;
    } else {
      op->owner->op_done(op, status);
    }
  }

  static ucs_status_t on_fetch(void* arg, const void* header, std::size_t header_bytes, void*,
                               std::size_t, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<node*>(arg);
    fetch_header h;
    if (header_bytes < sizeof h) {
      log_warn("ucx: " + self->side_ + " dropped a malformed fetch request");
      return UCS_OK;
    }
    std::memcpy(&h, header, sizeof h);
    if (header_bytes != sizeof h + h.id_bytes + h.address_bytes) {
      log_warn("ucx: " + self->side_ + " dropped a fetch request of the wrong length");
      return UCS_OK;
    }
    // Answered from the loop, outside this callback, through an endpoint of our own to the
    // requester: UCX's reply endpoint is freed when the requester dies, and a relay may hold
    // a fetch for a long time before the chunk lands.
    const char* text = static_cast<const char*>(header) + sizeof h;
    fetch_request r;
    r.id.assign(text, h.id_bytes);
    r.requester = hex_encode(text + h.id_bytes, h.address_bytes);
    r.segment = h.segment;
    r.offset = h.offset;
    r.length = h.length;
    r.tag = h.tag;
    r.deadline = clock_type::now() + std::chrono::milliseconds(self->cfg_.timeout_ms);
    self->incoming_.push_back(std::move(r));
    (void)param;
    return UCS_OK;
  }

  static ucs_status_t on_fail(void* arg, const void* header, std::size_t header_bytes, void*,
                              std::size_t, const ucp_am_recv_param_t*) {
    auto* self = static_cast<node*>(arg);
    fail_header h;
    if (header_bytes < sizeof h) return UCS_OK;
    std::memcpy(&h, header, sizeof h);
    if (header_bytes != sizeof h + h.text_bytes) return UCS_OK;
    std::string text(static_cast<const char*>(header) + sizeof h, h.text_bytes);
    auto it = self->ops_by_tag_.find(h.tag);
    if (it == self->ops_by_tag_.end()) return UCS_OK;  // the job already gave up
    auto job = it->second->job;
    self->source_failed(*job, it->second->lane,
                        make_error(static_cast<errc>(h.code), text + " (" + job->context + ")"));
    return UCS_OK;
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<node*>(arg);
    for (auto it = self->eps_.begin(); it != self->eps_.end(); ++it) {
      if (it->second != ep) continue;
      self->eps_.erase(it);
      self->closing_.push_back(ep);
      self->forget_requests_of(ep);
      for (auto job : std::vector(self->jobs_)) {  // a copy: a job may end meanwhile
        for (std::size_t i = 0; i < job->lanes.size(); ++i) {
          if (job->lanes[i].ep != ep) continue;
          // Tag receives are the worker's, not the endpoint's: source_failed cancels them.
          self->source_failed(
              *job, i,
              make_error(errc::io_error, "ucx: connection to the source of update_id " + job->id +
                                             " failed: " + ucs_status_string(status) + " (" +
                                             job->context + ")"));
        }
      }
      break;
    }
  }

 private:
  node(const ucx_settings& cfg, std::string side, bool relay)
      : cfg_(cfg), side_(std::move(side)), relay_(relay) {}

  result<void> init() {
    ucp_config_t* config = nullptr;
    WSYNC_UCX_CHECK(ucp_config_read(nullptr, nullptr, &config), side_);
    auto modify = [&](const char* key, const std::string& value, const char* option) {
      if (value.empty()) return result<void>{};
      ucs_status_t st = ucp_config_modify(config, key, value.c_str());
      if (st == UCS_OK) return result<void>{};
      return result<void>(make_error(errc::invalid_argument, std::string("ucx option ") + option +
                                                                 ": UCX refused \"" + value +
                                                                 "\": " + ucs_status_string(st)));
    };
    auto configured = [&]() -> result<void> {
      if (auto ok = modify("TLS", cfg_.tls, "tls"); !ok) return ok;
      if (auto ok = modify("NET_DEVICES", cfg_.devices, "devices"); !ok) return ok;
      return modify("RNDV_THRESH", cfg_.rndv_thresh, "rndv_thresh");
    }();
    if (!configured) {
      ucp_config_release(config);
      return configured;
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_RMA;
    params.mt_workers_shared = 1;  // slots are registered from the caller's thread
    ucs_status_t st = ucp_init(&params, config, &ctx_);
    ucp_config_release(config);
    if (st != UCS_OK) {
      ctx_ = nullptr;
      return status_error("ucp_init", st, side_ + ", tls=\"" + cfg_.tls + "\"");
    }
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    WSYNC_UCX_CHECK(ucp_worker_create(ctx_, &wp, &worker_), side_);
    ucp_address_t* addr = nullptr;
    std::size_t addr_bytes = 0;
    WSYNC_UCX_CHECK(ucp_worker_get_address(worker_, &addr, &addr_bytes), side_);
    address_ = hex_encode(addr, addr_bytes);
    address_bytes_.assign(reinterpret_cast<const char*>(addr), addr_bytes);
    ucp_worker_release_address(worker_, addr);
    for (auto [id, cb] :
         {std::pair{am_fetch, &node::on_fetch}, std::pair{am_fail, &node::on_fail}}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      hp.id = id;
      hp.cb = cb;
      hp.arg = this;
      hp.flags = UCP_AM_FLAG_WHOLE_MSG;
      WSYNC_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_, &hp), side_);
    }
    pool_ = std::make_unique<slot_pool>(ctx_, side_, cfg_.slots);
    return {};
  }

  // The progress loop: spins while UCX reports progress, then naps: 50 us while transfers are in
  // flight, 1 ms when idle, so a fetch that arrives at an idle node waits at most that long.
  void loop() {
    auto busy_at = clock_type::now();
    auto swept_at = busy_at;
    while (true) {
      std::deque<std::function<void()>> tasks;
      bool stopping = false;
      {
        std::lock_guard lock(tasks_mutex_);
        tasks.swap(tasks_);
        stopping = stop_;
      }
      for (auto& t : tasks) t();
      if (stopping) break;
      unsigned events = 0;
      // A bounded drain: fetches that arrived are answered between rounds, not after the
      // send queue ran dry.
      for (int round = 0; round < 8 && ucp_worker_progress(worker_); ++round) ++events;
      close_failed_endpoints();
      answer_fetches();
      switch_sources();
      auto now = clock_type::now();
      if (now - swept_at > std::chrono::milliseconds(100)) {
        expire_early(now);
        for (auto job : std::vector(jobs_)) pull_check_done(job);
        swept_at = now;
      }
      if (events || !tasks.empty()) {
        busy_at = now;
        continue;
      }
      if (now - busy_at < std::chrono::microseconds(200)) continue;
      // Quiet for a while: nap, briefly while transfers are in flight (a slow link, or many
      // ranks sharing two cores, must not be starved by a spinning thread), longer when idle.
      bool active = !jobs_.empty() || sends_in_flight_;
      std::unique_lock lock(tasks_mutex_);
      tasks_cv_.wait_for(lock,
                         active ? std::chrono::microseconds(50) : std::chrono::milliseconds(1),
                         [&] { return !tasks_.empty() || stop_; });
    }
    shutdown();
  }

  void shutdown() {
    for (auto job : std::vector(jobs_)) {
      if (!job->failure) job->failure = make_error(errc::io_error, "ucx: " + side_ + " shut down");
      for (std::size_t k = 0; k < job->lanes.size(); ++k) pull_cancel(*job, k, true);
    }
    for (auto& [id, u] : served_) {
      for (auto& [key, requests] : u.waiting) {
        for (auto& r : requests)
          refuse(r, errc::unknown_update,
                 "unknown update_id: " + id + ": the " + side_ + " shut down");
      }
    }
    served_.clear();
    for (auto& r : early_) {
      refuse(r, errc::unknown_update,
             "unknown update_id: " + r.id + ": the " + side_ + " shut down before importing it");
    }
    early_.clear();
    std::vector<ucp_ep_h> eps;
    for (auto& [addr, ep] : eps_) eps.push_back(ep);
    eps_.clear();
    for (auto ep : eps) close_endpoint(ep, false);
    // Give operations in flight a bounded time to finish now that their endpoints are gone.
    auto deadline = clock_type::now() + std::chrono::seconds(2);
    while ((!jobs_.empty() || sends_in_flight_) && clock_type::now() < deadline) {
      ucp_worker_progress(worker_);
      for (auto job : std::vector(jobs_)) pull_check_done(job);
    }
    close_failed_endpoints();
  }

  void close_endpoint(ucp_ep_h ep, bool force) {
    forget_rkeys(ep);
    forget_requests_of(ep);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(ep, &p);
    if (req == nullptr || ptr_is_error(req)) return;
    auto deadline = clock_type::now() + std::chrono::seconds(1);
    while (ucp_request_check_status(req) == UCS_INPROGRESS && clock_type::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (ucp_request_check_status(req) == UCS_INPROGRESS && !force) {
      ucp_request_free(req);
      return close_endpoint(ep, true);
    }
    ucp_request_free(req);
  }

  void close_failed_endpoints() {
    while (!closing_.empty()) {
      auto ep = closing_.back();
      closing_.pop_back();
      close_endpoint(ep, true);
    }
  }

  result<ucp_ep_h> endpoint(const std::string& address, const std::string& context) {
    if (auto it = eps_.find(address); it != eps_.end()) return it->second;
    auto bytes = hex_decode(address);
    if (!bytes) return make_error(errc::invalid_argument, "ucx: source address is not hex");
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(bytes->data());
    // UCX 1.13's shared-memory transports cannot report a dead peer and refuse endpoints that
    // ask them to; over those, the import's own timeout is what catches a dead source.
    if (!ucx_tls_shared_memory_only(cfg_.tls)) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &node::on_ep_error;
      ep.err_handler.arg = this;
    }
    ucp_ep_h h = nullptr;
    WSYNC_UCX_CHECK(ucp_ep_create(worker_, &ep, &h),
                    side_ + " connecting to its source, " + context);
    eps_[address] = h;
    return h;
  }

  // The unpacked remote key of a publisher slot, kept while the endpoint lives: over shared
  // memory, unpacking attaches the publisher's segment, and a fresh attachment faults every page
  // in again (~0.3 GB/s here) where a kept one is read at memcpy speed.
  result<ucp_rkey_h> remote_key(ucp_ep_h ep, const std::string& packed,
                                const std::string& context) {
    for (auto& r : rkeys_) {
      if (r.ep == ep && r.packed == packed) return r.rkey;
    }
    auto bytes = hex_decode(packed);
    ucp_rkey_h rkey = nullptr;
    WSYNC_UCX_CHECK(ucp_ep_rkey_unpack(ep, bytes->data(), &rkey), context);
    rkeys_.push_back({ep, packed, rkey});
    // A publisher reuses a ring of a few slots; far more keys than that are stale ones.
    for (auto it = rkeys_.begin(); rkeys_.size() > max_rkeys && it != rkeys_.end();) {
      bool in_use = std::any_of(jobs_.begin(), jobs_.end(), [&](auto& j) {
        return std::any_of(j->lanes.begin(), j->lanes.end(),
                           [&](const pull_lane& l) { return l.rkey == it->rkey; });
      });
      if (in_use || it->rkey == rkey) {
        ++it;
        continue;
      }
      ucp_rkey_destroy(it->rkey);
      it = rkeys_.erase(it);
    }
    return rkey;
  }

  void forget_rkeys(ucp_ep_h ep) {
    for (auto it = rkeys_.begin(); it != rkeys_.end();) {
      if (it->ep != ep) {
        ++it;
        continue;
      }
      ucp_rkey_destroy(it->rkey);
      it = rkeys_.erase(it);
    }
  }

  // Moves jobs whose source failed to their next source, once nothing is in flight to the old
  // one. Runs from the loop, outside UCX callbacks: UCX must not be asked for a new endpoint
  // while it is still failing the old one.
  void switch_sources() {
    for (auto job : std::vector(jobs_)) {  // a copy: a job may end meanwhile
      bool switched = false;
      for (auto& lane : job->lanes) {
        if (!lane.switching || job->failure) continue;
        if (lane.inflight) {
          // A receive matched to a source that then died is not always ended by UCX: after a
          // grace period, pull those chunks again from the next source. The bytes are the same
          // whoever sends them, so a late arrival cannot change what lands, and the landing
          // slot stays busy until every given-up receive ended, so it cannot land in a later
          // update either.
          if (clock_type::now() - lane.switching_since < std::chrono::milliseconds(200)) continue;
          for (auto* op : lane.ops) {
            op->abandoned = true;
            pool_->busy_begin(job->landing);
            ops_by_tag_.erase(op->tag);
            lane.retry.emplace_back(op->segment, op->offset);
          }
          lane.ops.clear();
          lane.inflight = 0;
        }
        lane.switching = false;
        lane.get = false;  // fallbacks are relays, or publishers reached through relay handles
        auto ep = endpoint(lane.sources[++lane.source], job->context);
        lane.ep = ep ? *ep : nullptr;
        if (!ep)
          source_failed(*job, static_cast<std::size_t>(&lane - job->lanes.data()), ep.error());
        switched = true;
      }
      if (!switched) continue;
      pull_more(job);
      pull_check_done(job);
    }
  }

  // Serves the fetches received since the last turn of the loop.
  void answer_fetches() {
    auto fetches = std::move(incoming_);
    incoming_.clear();
    for (auto& r : fetches) {
      auto ep = endpoint(r.requester, "answering a fetch of update_id " + r.id);
      if (!ep) {
        log_warn("ucx: " + side_ + " cannot answer a fetch: " + ep.error().message);
        continue;
      }
      r.reply_ep = *ep;
      serve(r);
    }
  }

  // Forgets the fetches a dead peer was waiting for.
  void forget_requests_of(ucp_ep_h ep) {
    auto of = [&](const fetch_request& r) {
      return r.reply_ep == ep;
    };
    for (auto& [id, u] : served_) {
      for (auto& [key, requests] : u.waiting) {
        requests.erase(std::remove_if(requests.begin(), requests.end(), of), requests.end());
      }
    }
    early_.erase(std::remove_if(early_.begin(), early_.end(), of), early_.end());
  }

  // Keeps `window` chunks of every lane of the job in flight.
  void pull_more(const std::shared_ptr<pull_job>& shared) {
    auto& job = *shared;
    for (std::size_t i = 0; i < job.lanes.size(); ++i) {
      auto& lane = job.lanes[i];
      while (!job.failure && !lane.switching && lane.inflight < job.window &&
             (!lane.retry.empty() || lane.next < lane.order.size())) {
        chunk_ref chunk;
        if (lane.retry.empty()) {
          chunk = lane.order[lane.next++];
        } else {
          chunk = lane.retry.back();
          lane.retry.pop_back();
        }
        auto [seg, off] = chunk;
        auto* op = new pull_op{this,        shared,  i,
                               seg,         off,     std::min(job.chunk, job.nbytes[seg] - off),
                               next_tag_++, nullptr, false,
                               std::nullopt};
        lane.ops.push_back(op);
        ++lane.inflight;
        op->issuing = true;
        std::byte* dst = job.landing->base + job.offsets[seg] + off;
        ucp_request_param_t p{};
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        p.user_data = op;
        p.memh = job.landing->memh;
        void* req = nullptr;
        if (lane.get) {
          p.cb.send = &node::on_get;
          req = ucp_get_nbx(lane.ep, dst, op->length, lane.bases[seg] + off, lane.rkey, &p);
        } else {
          p.cb.recv = &node::on_recv;
          req = ucp_tag_recv_nbx(worker_, dst, op->length, op->tag, ~ucp_tag_t{0}, &p);
        }
        op->issuing = false;
        if (ptr_is_error(req)) {
          source_failed(job, i,
                        status_error(lane.get ? "ucp_get_nbx" : "ucp_tag_recv_nbx", ptr_status(req),
                                     job.context));
          op_account(op, UCS_ERR_CANCELED);
          continue;
        }
        if (op->inline_status) {
          op_account(op, *op->inline_status);
          continue;
        }
        op->request = req;
        if (!lane.get) {
          // The receive is posted before the fetch goes out, so the bytes never wait unexpected.
          ops_by_tag_[op->tag] = op;
          if (auto ok = send_fetch(job, lane, *op); !ok) source_failed(job, i, ok.error());
        }
      }
    }
  }

  result<void> send_fetch(const pull_job& job, const pull_lane& lane, const pull_op& op) {
    fetch_header h{op.tag,
                   op.offset,
                   op.length,
                   op.segment,
                   static_cast<std::uint32_t>(job.id.size()),
                   static_cast<std::uint32_t>(address_bytes_.size()),
                   0};
    std::string buf(reinterpret_cast<const char*>(&h), sizeof h);
    return send_am(lane.ep, am_fetch, buf + job.id + address_bytes_, 0, job.context);
  }

  // Sends an active message made of `header` alone; UCX reads it until the send completes.
  result<void> send_am(ucp_ep_h ep, unsigned id, std::string header, std::uint32_t flags,
                       const std::string& context) {
    struct am_send {
      node* owner;
      std::string header;
    };
    auto* ctx = new am_send{this, std::move(header)};
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = flags;
    p.user_data = ctx;
    p.cb.send = [](void* request, ucs_status_t, void* user) {
      auto* c = static_cast<am_send*>(user);
      --c->owner->sends_in_flight_;
      delete c;
      ucp_request_free(request);
    };
    ++sends_in_flight_;
    void* req = ucp_am_send_nbx(ep, id, ctx->header.data(), ctx->header.size(), nullptr, 0, &p);
    if (req == nullptr || ptr_is_error(req)) {
      --sends_in_flight_;
      delete ctx;
    }
    if (ptr_is_error(req)) return status_error("ucp_am_send_nbx", ptr_status(req), context);
    return {};
  }

  void op_done(pull_op* op, ucs_status_t status) {
    auto job = op->job;
    op_account(op, status);
    pull_more(job);
    pull_check_done(job);
  }

  // Books a finished operation on its job (and deletes it); starts nothing new.
  void op_account(pull_op* op, ucs_status_t status) {
    auto job = op->job;
    auto& lane = job->lanes[op->lane];
    ops_by_tag_.erase(op->tag);
    lane.ops.erase(std::find(lane.ops.begin(), lane.ops.end(), op));
    --lane.inflight;
    if (status == UCS_OK) {
      ++job->done;
      chunk_landed(job->id, op->segment, op->offset);
    } else {
      if (status != UCS_ERR_CANCELED) {
        source_failed(
            *job, op->lane,
            status_error(lane.get ? "ucp_get_nbx" : "ucp_tag_recv_nbx", status, job->context));
      }
      if (lane.switching) lane.retry.emplace_back(op->segment, op->offset);
    }
    delete op;
  }

  void pull_cancel(pull_job& job, std::size_t i, bool force_endpoint) {
    auto& lane = job.lanes[i];
    // UCX may end (and our callback free) an op inside the cancel: walk a copy, and skip ops that
    // ended meanwhile.
    for (auto* op : std::vector(lane.ops)) {
      if (std::find(lane.ops.begin(), lane.ops.end(), op) == lane.ops.end()) continue;
      if (!lane.get) ucp_request_cancel(worker_, op->request);
    }
    // RMA gets and rendezvous transfers already matched cannot be cancelled: closing the
    // endpoint completes them with an error.
    if (force_endpoint && lane.inflight && lane.ep) {
      for (auto it = eps_.begin(); it != eps_.end(); ++it) {
        if (it->second == lane.ep) {
          closing_.push_back(lane.ep);
          eps_.erase(it);
          break;
        }
      }
    }
  }

  void pull_check_done(const std::shared_ptr<pull_job>& job) {
    if (job->inflight()) return;
    if (!job->failure && job->done < job->total) return;
    auto it = std::find(jobs_.begin(), jobs_.end(), job);
    if (it == jobs_.end()) return;
    jobs_.erase(it);
    if (job->failure) {
      job->finished.set_value(*job->failure);
    } else {
      job->finished.set_value(result<void>{});
    }
  }

  void chunk_landed(const update_id& id, std::uint32_t segment, std::uint64_t offset) {
    auto it = served_.find(id);
    if (it == served_.end()) return;
    auto& u = it->second;
    u.landed[segment][offset / u.chunk] = 1;
    auto w = u.waiting.find({segment, offset / u.chunk});
    if (w == u.waiting.end()) return;
    auto requests = std::move(w->second);
    u.waiting.erase(w);
    for (auto& r : requests) serve(u, r);
  }

  void serve(const fetch_request& r) {
    auto it = served_.find(r.id);
    if (it != served_.end()) return serve(it->second, r);
    if (!relay_) {
      return refuse(r, errc::unknown_update,
                    "unknown update_id: " + r.id +
                        " is not exposed by this publisher (released, "
                        "or never published here)");
    }
    if (early_.size() >= max_early_fetches) {
      return refuse(r, errc::try_again,
                    "ucx: relay holds " + std::to_string(early_.size()) +
                        " fetches for updates it has not started; retry");
    }
    early_.push_back(r);  // the relay has not started this import yet
  }

  void serve(served_update& u, const fetch_request& r) {
    std::uint64_t index = r.offset / u.chunk;
    if (r.segment >= u.nbytes.size() || r.offset % u.chunk || r.offset >= u.nbytes[r.segment] ||
        r.length != std::min(u.chunk, u.nbytes[r.segment] - r.offset)) {
      return refuse(r, errc::invalid_argument,
                    "ucx: fetch of segment " + std::to_string(r.segment) + " bytes [" +
                        std::to_string(r.offset) + ", +" + std::to_string(r.length) +
                        ") does not name a chunk of update_id " + r.id);
    }
    if (!u.landed[r.segment][index]) {
      u.waiting[{r.segment, index}].push_back(r);
      return;
    }
    const std::byte* data = u.s->base + u.offsets[r.segment] + r.offset;
    if (u.verify && !u.verified[r.segment][index]) {
      std::uint64_t sum = checksum_compute(data, r.length);
      if (sum != u.checksums[r.segment][index]) {
        return refuse(r, errc::checksum_mismatch,
                      "tensor checksum mismatch: chunk " + std::to_string(index) + " of segment " +
                          std::to_string(r.segment) + " arrived at the relay as " +
                          checksum_hex(sum) + ", the handle says " +
                          checksum_hex(u.checksums[r.segment][index]) + "; not forwarded");
      }
      u.verified[r.segment][index] = 1;
    }
    struct send_ctx {
      node* owner;
      slot* s;
    };
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.memh = u.s->memh;
    p.user_data = new send_ctx{this, u.s};
    p.cb.send = [](void* request, ucs_status_t, void* user) {
      auto* c = static_cast<send_ctx*>(user);
      --c->owner->sends_in_flight_;
      if (c->owner->pool_) c->owner->pool_->busy_end(c->s);  // gone at worker destruction
      delete c;
      ucp_request_free(request);
    };
    pool_->busy_begin(u.s);
    ++sends_in_flight_;
    void* req = ucp_tag_send_nbx(r.reply_ep, data, r.length, r.tag, &p);
    if (ptr_is_error(req)) {
      --sends_in_flight_;
      pool_->busy_end(u.s);
      delete static_cast<send_ctx*>(p.user_data);
      log_warn("ucx: " + side_ + " could not send chunk " + std::to_string(index) + " of " + r.id +
               ": " + ucs_status_string(ptr_status(req)));
    }
  }

  void refuse(const fetch_request& r, errc code, const std::string& text) {
    fail_header h{r.tag, static_cast<std::uint32_t>(code), static_cast<std::uint32_t>(text.size())};
    std::string buf(reinterpret_cast<const char*>(&h), sizeof h);
    if (auto ok = send_am(r.reply_ep, am_fail, buf + text, 0, r.id); !ok) {
      log_warn("ucx: " + side_ + " could not refuse a fetch: " + ok.error().message);
    }
  }

  void expire_early(clock_type::time_point now) {
    for (auto it = early_.begin(); it != early_.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      refuse(*it, errc::timeout,
             "ucx: the relay did not start importing update_id " + it->id + " within " +
                 std::to_string(cfg_.timeout_ms) + " ms");
      it = early_.erase(it);
    }
  }

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
  };
  static constexpr std::size_t max_rkeys = 64;
  std::vector<cached_rkey> rkeys_;
  std::uint64_t next_tag_ = 1;
  std::uint64_t sends_in_flight_ = 0;
};

served_update served_from(slot* s, std::vector<std::uint64_t> offsets,
                          std::vector<std::uint64_t> nbytes, std::uint64_t chunk,
                          std::vector<std::vector<std::uint64_t>> checksums, bool landed) {
  served_update u;
  u.s = s;
  u.offsets = std::move(offsets);
  u.nbytes = std::move(nbytes);
  u.chunk = chunk;
  u.checksums = std::move(checksums);
  u.verify = !landed;
  for (auto n : u.nbytes) {
    u.landed.emplace_back(chunks_of(n, chunk), landed ? 1 : 0);
    u.verified.emplace_back(chunks_of(n, chunk), landed ? 1 : 0);
  }
  return u;
}

// --- publisher half -----------------------------------------------------------------------------

class ucx_publisher final : public publisher_transport {
 public:
  explicit ucx_publisher(std::unique_ptr<node> n) : node_(std::move(n)) {}

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds wait) override {
    {
      std::lock_guard lock(mutex_);
      if (updates_.count(id)) {
        return make_error(errc::invalid_argument,
                          "ucx: update_id " + id + " acquired twice (field update_id)");
      }
    }
    std::uint64_t need = 0;
    auto offsets = page_offsets(sizes, &need);
    auto s = node_->pool().acquire(id, need, wait);
    if (!s) return s.error();
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      spans.emplace_back((*s)->base + offsets[i], sizes[i]);
    }
    std::lock_guard lock(mutex_);
    updates_[id] = {*s, std::move(offsets), {sizes.begin(), sizes.end()}};
    return spans;
  }

  result<std::string> expose(const update_id& id) override {
    std::unique_lock lock(mutex_);
    auto it = updates_.find(id);
    if (it == updates_.end()) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + " was not acquired from ucx");
    }
    auto u = it->second;
    lock.unlock();
    // Chunk checksums let a relay verify each chunk before it forwards it, long before the
    // whole update has arrived and its tensor checksums can be checked.
    handle h;
    h.address = node_->address();
    h.chunk = node_->settings().chunk_bytes;
    h.rkey = u.s->rkey;
    for (std::size_t i = 0; i < u.nbytes.size(); ++i) {
      std::vector<std::uint64_t> sums;
      for (std::uint64_t off = 0; off < u.nbytes[i]; off += h.chunk) {
        sums.push_back(
            checksum_compute(u.s->base + u.offsets[i] + off, std::min(h.chunk, u.nbytes[i] - off)));
      }
      h.checksums.push_back(std::move(sums));
      h.bases.push_back(reinterpret_cast<std::uintptr_t>(u.s->base + u.offsets[i]));
    }
    node_->call([&] {
      node_->serve_add(id, served_from(u.s, u.offsets, u.nbytes, h.chunk, h.checksums, true));
    });
    return handle_dump(h);
  }

  void release(const update_id& id) override {
    {
      std::lock_guard lock(mutex_);
      if (!updates_.erase(id)) return;
    }
    node_->call([&] { node_->serve_remove(id); });
    node_->pool().release(id);  // the slot is reused once the sends reading it are done
  }

 private:
  struct held {
    slot* s;
    std::vector<std::uint64_t> offsets, nbytes;
  };
  std::unique_ptr<node> node_;
  std::mutex mutex_;
  std::map<update_id, held> updates_;
};

// --- consumer half ------------------------------------------------------------------------------

class ucx_consumer final : public consumer_transport {
 public:
  explicit ucx_consumer(std::unique_ptr<node> n) : node_(std::move(n)) {}

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    auto h = handle_parse(m.transport_handle, &m);
    if (!h) return h.error();
    const auto& cfg = node_->settings();
    std::vector<std::uint64_t> sizes;
    for (const auto& s : m.segments) sizes.push_back(s.nbytes);
    std::uint64_t need = 0;
    auto offsets = page_offsets(sizes, &need);
    auto timeout = std::chrono::milliseconds(cfg.timeout_ms);
    auto landing = node_->pool().acquire(m.update_id, need, timeout);
    if (!landing) return landing.error();

    auto job = std::make_shared<pull_job>();
    job->id = m.update_id;
    job->context = update_context(m);
    if (h->stripes.empty()) {
      pull_lane lane;
      lane.sources = h->fallbacks;
      lane.sources.insert(lane.sources.begin(), h->address);
      std::string op = cfg.op == "auto" ? ucx_auto_op(cfg.tls) : cfg.op;
      lane.get = op == "get" && !h->rkey.empty();
      lane.bases = h->bases;
      lane.rkey_hex = h->rkey;
      job->lanes.push_back(std::move(lane));
    }
    for (const auto& stripe : h->stripes) {
      pull_lane lane;
      lane.sources = stripe.fallbacks;
      lane.sources.insert(lane.sources.begin(), stripe.address);
      job->lanes.push_back(std::move(lane));
    }
    job->landing = *landing;
    job->offsets = offsets;
    job->nbytes = sizes;
    job->chunk = h->chunk;
    job->window = cfg.window;
    for (std::uint32_t i = 0; i < sizes.size(); ++i) {
      for (std::uint64_t off = 0; off < sizes[i]; off += h->chunk) {
        job->lanes[job->total++ % job->lanes.size()].order.emplace_back(i, off);
      }
    }
    auto finished = job->finished.get_future();
    node_->call([&] {
      // Serve the update to children from the first chunk on: the relay is pipelined.
      node_->serve_add(m.update_id,
                       served_from(*landing, offsets, sizes, h->chunk, h->checksums, false));
      node_->pull_start(job);
    });
    if (finished.wait_for(timeout) != std::future_status::ready) {
      node_->call([&] {
        node_->pull_abort(
            job,
            make_error(errc::timeout, "ucx: import of update_id " + m.update_id + " took over " +
                                          std::to_string(cfg.timeout_ms) +
                                          " ms (option timeout_ms; " + update_context(m) + ")"));
      });
    }
    auto pulled = finished.get();
    if (!pulled) {
      drop(m.update_id);
      return pulled.error();
    }
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      spans.emplace_back((*landing)->base + offsets[i], sizes[i]);
    }
    return spans;
  }

  void release(const update_id& id) override { drop(id); }

  std::string relay_address() const override { return node_->address(); }

 private:
  void drop(const update_id& id) {
    node_->call([&] { node_->serve_remove(id); });
    node_->pool().release(id);
  }

  std::unique_ptr<node> node_;
};

// --- the transport and its registry entry -----------------------------------------------------

namespace {

constexpr transport_caps ucx_caps{.cpu_memory = true,
                                  .gpu_memory = false,  // Debian's UCX has no CUDA transports
                                  .cross_process = true,
                                  .cross_node = true,
                                  .zero_copy_import = false};

class ucx_transport final : public transport {
 public:
  explicit ucx_transport(ucx_settings cfg) : cfg_(std::move(cfg)) {}
  std::string_view name() const override { return "ucx"; }
  transport_caps caps() const override { return ucx_caps; }

  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    auto n = node::create(cfg_, "publisher", false);
    if (!n) return n.error();
    return std::unique_ptr<publisher_transport>(std::make_unique<ucx_publisher>(std::move(*n)));
  }

  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    auto n = node::create(cfg_, "consumer", true);
    if (!n) return n.error();
    return std::unique_ptr<consumer_transport>(std::make_unique<ucx_consumer>(std::move(*n)));
  }

  result<std::string> handle_via_relay(const std::string& text,
                                       const std::string& relay_address) const override {
    return ucx_detail::handle_via_relay(text, relay_address);
  }

  result<std::string> handle_striped(const std::vector<std::string>& texts) const override {
    return ucx_detail::handle_striped(texts);
  }

 private:
  ucx_settings cfg_;
};

}  // namespace
}  // namespace ucx_detail

transport_entry ucx_entry() {
  using ucx_detail::page;
  using ucx_detail::ucx_caps;
  using ucx_detail::ucx_settings;
  using ucx_detail::ucx_transport;
  return {"ucx", "cluster; pooled slots registered once, chunked pulls, relays between consumers",
          ucx_caps, [](const transport_options& options) -> result<std::unique_ptr<transport>> {
            options_reader reader("ucx", options);
            ucx_settings cfg;
            cfg.tls = reader.get_string("tls", "");
            cfg.devices = reader.get_string("devices", "");
            cfg.rndv_thresh = reader.get_string("rndv_thresh", "");
            cfg.op = reader.get_string("op", "auto");
            if (cfg.op != "auto" && cfg.op != "tag" && cfg.op != "get") {
              return make_error(errc::invalid_argument,
                                "ucx option op: expected auto, tag or get, got \"" + cfg.op + "\"");
            }
            auto chunk =
                reader.get_uint("chunk_bytes", cfg.chunk_bytes, page, std::uint64_t{1} << 30);
            if (!chunk) return chunk.error();
            auto window = reader.get_uint("window", cfg.window, 1, 256);
            if (!window) return window.error();
            auto slots = reader.get_uint("slots", cfg.slots, 1, 64);
            if (!slots) return slots.error();
            auto timeout = reader.get_uint("timeout_ms", cfg.timeout_ms, 1, 3600000);
            if (!timeout) return timeout.error();
            cfg.chunk_bytes = *chunk;
            cfg.window = *window;
            cfg.slots = *slots;
            cfg.timeout_ms = *timeout;
            if (auto ok = reader.finish(); !ok) return ok.error();
            return std::unique_ptr<transport>(std::make_unique<ucx_transport>(cfg));
          }};
}

}  // namespace wsync
