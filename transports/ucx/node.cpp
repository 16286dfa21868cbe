#include "ucx/node.hpp"

#include <algorithm>

#include "src/process.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/transports/ucx.hpp"

namespace wsync::ucx_detail {

result<std::unique_ptr<node>> node::create(const ucx_settings& cfg, std::string side, bool relay) {
  std::unique_ptr<node> n(new node(cfg, std::move(side), relay));
  if (auto ok = n->init(); !ok) return ok.error();
  n->thread_ = std::thread([p = n.get()] { p->loop(); });
  return n;
}

node::~node() {
  if (thread_.joinable()) {
    {
      std::lock_guard lock(tasks_mutex_);
      stop_ = true;
    }
    tasks_cv_.notify_all();
    thread_.join();
  }
  // Keys of gets UCX never ended (their peer died matched to them) go before the worker that
  // owns them. Then the worker (it ends whatever UCX still holds, which may touch the slots),
  // then the slots, unregistered while the context still exists.
  for (auto& r : rkeys_) ucp_rkey_destroy(r.rkey);
  rkeys_.clear();
  if (worker_) ucp_worker_destroy(worker_);
  worker_ = nullptr;
  pool_.reset();
  if (ctx_) ucp_cleanup(ctx_);
}

result<void> node::init() {
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
    if (auto ok = modify("RNDV_THRESH", cfg_.rndv_thresh, "rndv_thresh"); !ok) return ok;
    // UCX 1.13's TCP transport connects inside ucp_ep_create when connecting blocks, its
    // default. Should the peer's worker go away in that moment (a relay shutting down as a child
    // connects: the connection request cannot be sent, the reconnect is refused), it marks the
    // new endpoint failed before giving it its send side, and the next progress aborts the
    // process (tcp_ep.c:478, `!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)`). Connecting without
    // blocking ends the connect in progress, once the endpoint is whole: a refused connection
    // then reaches on_ep_error like any dead peer. Asked only where TCP may be in use, since UCX
    // warns about a setting that no transport takes.
    if (ucx_tls_may_use_tcp(cfg_.tls)) {
      WSYNC_UCX_CHECK(ucp_config_modify(config, "CONN_NB", "y"), side_);
    }
    return result<void>{};
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
  for (auto [id, cb] : {std::pair{am_fetch, &node::on_fetch}, std::pair{am_fail, &node::on_fail}}) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    WSYNC_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_, &hp), side_);
  }
  // Pinned: still busy two import deadlines after its release (a given-up receive is
  // normally ended by the source's failure or the next source's bytes well before).
  pool_ = std::make_unique<slot_pool>(ctx_, side_, cfg_.slots,
                                      std::chrono::milliseconds(2 * cfg_.timeout_ms));
  return {};
}

// The progress loop: spins while UCX reports progress, then naps: 50 us while transfers are in
// flight, 1 ms when idle, so a fetch that arrives at an idle node waits at most that long.
void node::loop() {
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
      expire_waiting(now);
      expire_sends(now);
      if (!publishers_.empty() && now - publishers_checked_at_ > std::chrono::seconds(1)) {
        forget_exited_publishers();
        publishers_checked_at_ = now;
      }
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
    tasks_cv_.wait_for(lock, active ? std::chrono::microseconds(50) : std::chrono::milliseconds(1),
                       [&] { return !tasks_.empty() || stop_; });
  }
  shutdown();
}

void node::shutdown() {
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
  // A peer that connected just now may still be owed UCX's connection reply (its wireup REP),
  // and UCX 1.13 aborts when the worker is destroyed with one pending (ucp_request.c:684, "got
  // REP message"). Flushing the worker sends it first; bounded, since over shared memory a dead
  // peer is never noticed.
  ucp_request_param_t p{};
  void* flush = ucp_worker_flush_nbx(worker_, &p);
  if (flush == nullptr || ptr_is_error(flush)) return;
  deadline = clock_type::now() + std::chrono::seconds(1);
  while (ucp_request_check_status(flush) == UCS_INPROGRESS && clock_type::now() < deadline) {
    ucp_worker_progress(worker_);
  }
  ucp_request_free(flush);
}

void node::close_endpoint(ucp_ep_h ep, bool force) {
  sends_done_at_.erase(ep);
  publishers_.erase(ep);
  // A lane of a job that failed (or waits for receives UCX may never end) keeps no handle of
  // it: UCX hands the freed handle out again, and a later cancel of the lane would close the
  // unrelated endpoint that got it.
  for (const auto& job : jobs_) {
    for (auto& lane : job->lanes) {
      if (lane.ep == ep) lane.ep = nullptr;
    }
  }
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
  // Still closing after a second (a peer that takes no more bytes): the request is let go, and
  // the worker's destruction ends the close with whatever it still holds (before the slots go:
  // ~node). Not a second, forced close of the same endpoint: UCX refuses an endpoint already
  // closing ("already closed"), so that call changed nothing.
  ucp_request_free(req);
}

void node::close_failed_endpoints() {
  while (!closing_.empty()) {
    auto ep = closing_.back();
    closing_.pop_back();
    close_endpoint(ep, true);
  }
}

result<ucp_ep_h> node::endpoint(const std::string& address, const std::string& context) {
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
  WSYNC_UCX_CHECK(ucp_ep_create(worker_, &ep, &h), side_ + " connecting to its source, " + context);
  eps_[address] = h;
  return h;
}

// The unpacked remote key of a publisher slot, kept while the endpoint lives: over shared
// memory, unpacking attaches the publisher's segment, and a fresh attachment faults every page
// in again (~0.3 GB/s here) where a kept one is read at memcpy speed.
result<ucp_rkey_h> node::remote_key(ucp_ep_h ep, const std::string& packed,
                                    const std::string& context) {
  for (auto& r : rkeys_) {
    if (r.ep == ep && r.packed == packed && !r.forgotten) return r.rkey;
  }
  auto bytes = hex_decode(packed);
  ucp_rkey_h rkey = nullptr;
  WSYNC_UCX_CHECK(ucp_ep_rkey_unpack(ep, bytes->data(), &rkey), context);
  rkeys_.push_back({ep, packed, rkey});
  // A publisher reuses a ring of a few slots; far more keys than that are stale ones.
  for (auto it = rkeys_.begin(); rkeys_.size() > max_rkeys && it != rkeys_.end();) {
    bool in_use = it->gets || it->forgotten || it->rkey == rkey ||
                  std::any_of(jobs_.begin(), jobs_.end(), [&](auto& j) {
                    return std::any_of(j->lanes.begin(), j->lanes.end(),
                                       [&](const pull_lane& l) { return l.rkey == it->rkey; });
                  });
    if (in_use) {
      ++it;
      continue;
    }
    ucp_rkey_destroy(it->rkey);
    it = rkeys_.erase(it);
  }
  return rkey;
}

void node::rkey_used(ucp_rkey_h rkey) {
  for (auto& r : rkeys_) {
    if (r.rkey == rkey) ++r.gets;
  }
}

void node::rkey_done(ucp_rkey_h rkey) {
  if (rkey == nullptr) return;
  auto it = std::find_if(rkeys_.begin(), rkeys_.end(),
                         [&](const cached_rkey& r) { return r.rkey == rkey; });
  if (it == rkeys_.end() || --it->gets != 0 || !it->forgotten) return;
  ucp_rkey_destroy(it->rkey);
  rkeys_.erase(it);
}

// The endpoint is closing: its keys go now, or, where gets still use them, when the last ends
// (the close ends them: a flush runs them, a forced close cancels them). UCX asks for keys to go
// before their endpoint; a deferred one goes after it, which UCX 1.13's ucp_rkey_destroy
// allows (it releases the key's transport parts and its worker's pool entry, not the
// endpoint), and is the lesser harm than destroying it under a running get.
void node::forget_rkeys(ucp_ep_h ep) {
  for (auto it = rkeys_.begin(); it != rkeys_.end();) {
    if (it->ep != ep || it->forgotten) {
      ++it;
      continue;
    }
    if (it->gets) {
      it->forgotten = true;
      ++it;
      continue;
    }
    ucp_rkey_destroy(it->rkey);
    it = rkeys_.erase(it);
  }
}

void node::watch_publisher(ucp_ep_h ep, const pull_lane& lane) {
  const auto& p = lane.publisher;
  if (p.pid <= 0 || publishers_.count(ep) || !detail::pid_checkable(p.pidns)) return;
  // Another host's process (over a network): its pid means nothing here.
  if (p.boot.empty() || p.boot != detail::boot_id()) return;
  // Another process under that pid, or one this node cannot see: nothing to watch.
  if (p.start == 0 || detail::process_start_time(static_cast<int>(p.pid)) != p.start) return;
  publishers_[ep] = p;
}

void node::forget_exited_publishers() {
  for (auto it = publishers_.begin(); it != publishers_.end();) {
    auto ep = it->first;
    const auto pid = it->second.pid;
    if (detail::process_start_time(static_cast<int>(pid)) == it->second.start ||
        endpoint_shared(ep, nullptr)) {
      ++it;
      continue;
    }
    it = publishers_.erase(it);
    if (!retire_endpoint(ep)) continue;
    log_info("ucx: " + side_ + ": publisher process " + std::to_string(pid) +
             " exited; its memory keys and connection are let go");
  }
}

void node::on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  static_cast<node*>(arg)->drop_endpoint(ep, std::string("failed: ") + ucs_status_string(status));
}

bool node::retire_endpoint(ucp_ep_h ep) {
  auto it = std::find_if(eps_.begin(), eps_.end(), [&](const auto& e) { return e.second == ep; });
  if (it == eps_.end()) return false;
  eps_.erase(it);
  closing_.push_back(ep);
  return true;
}

bool node::drop_endpoint(ucp_ep_h ep, const std::string& why) {
  if (!retire_endpoint(ep)) return false;
  forget_requests_of(ep);
  for (auto job : std::vector(jobs_)) {  // a copy: a job may end meanwhile
    for (std::size_t i = 0; i < job->lanes.size(); ++i) {
      if (job->lanes[i].ep != ep) continue;
      // Tag receives are the worker's, not the endpoint's: source_failed cancels them.
      source_failed(
          *job, i,
          make_error(errc::io_error, "ucx: connection to the source of update_id " + job->id + " " +
                                         why + " (" + job->context + ")"));
    }
  }
  return true;
}

bool node::endpoint_shared(ucp_ep_h ep, const pull_job* job) const {
  for (const auto& other : jobs_) {
    if (other.get() == job) continue;
    for (const auto& lane : other->lanes) {
      if (lane.ep == ep) return true;
    }
  }
  for (const auto* c : chunk_sends_) {
    if (c->ep == ep) return true;
  }
  auto asked = [&](const fetch_request& r) {
    return r.reply_ep == ep;
  };
  for (const auto& [id, u] : served_) {
    for (const auto& [key, requests] : u.waiting) {
      if (std::any_of(requests.begin(), requests.end(), asked)) return true;
    }
  }
  return std::any_of(early_.begin(), early_.end(), asked);
}

// Sends an active message made of `header` alone; UCX reads it until the send completes.
result<void> node::send_am(ucp_ep_h ep, unsigned id, std::string header, std::uint32_t flags,
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

}  // namespace wsync::ucx_detail
