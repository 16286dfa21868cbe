#include <algorithm>
#include <cstring>

#include "ucx/node.hpp"
#include "ucx/refusal.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::ucx_detail {

void node::pull_start(const std::shared_ptr<pull_job>& job) {
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
        watch_publisher(lane.ep, lane);
      }
    }
  }
  pull_more(job);
  pull_check_done(job);
}

void node::source_failed(pull_job& job, std::size_t i, error why) {
  auto& lane = job.lanes[i];
  if (job.failure || lane.switching) return;
  if (lane.source + 1 >= lane.sources.size()) {
    job.failure = std::move(why);
    for (std::size_t k = 0; k < job.lanes.size(); ++k) pull_cancel(job, k, false);
    return;
  }
  lane.switching_since = clock_type::now();
  log_warn("ucx: " + side_ + ": source " + std::to_string(lane.source) + " of update_id " + job.id +
           (job.lanes.size() > 1 ? " stripe " + std::to_string(i) : "") + " failed (" +
           why.message + "); pulling the remaining chunks from source " +
           std::to_string(lane.source + 1));
  lane.switching = true;
  pull_cancel(job, i, false);
}

// The importer's deadline passed. Also for a job that failed already: its last source may have
// died with receives matched to it, which UCX does not always end, and the importer waits for
// the job to finish. Those are given up as switch_sources gives them up (the landing slot stays
// busy until each really ends, so no late byte lands in a later update).
void node::pull_abort(const std::shared_ptr<pull_job>& job, error why) {
  if (!job->failure) job->failure = std::move(why);
  for (std::size_t k = 0; k < job->lanes.size(); ++k) pull_cancel(*job, k, true);
  for (auto& lane : job->lanes) abandon_inflight(*job, lane, false);
  pull_check_done(job);
}

// Gives up what `lane` still has in flight: UCX may yet end each op (its callback then only
// frees it), and the landing slot stays busy until it does. With `retry`, their chunks are
// pulled again.
void node::abandon_inflight(pull_job& job, pull_lane& lane, bool retry) {
  for (auto* op : lane.ops) {
    op->abandoned = true;
    pool_->busy_begin(job.landing);
    ops_by_tag_.erase(op->tag);
    if (retry) lane.retry.emplace_back(op->segment, op->offset);
  }
  lane.ops.clear();
  lane.inflight = 0;
}

void node::on_recv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                   void* user) {
  auto* op = static_cast<pull_op*>(user);
  bool short_read = status == UCS_OK && info->length != op->length;
  ucp_request_free(request);
  op_completed(op, short_read ? UCS_ERR_MESSAGE_TRUNCATED : status);
}

void node::on_get(void* request, ucs_status_t status, void* user) {
  ucp_request_free(request);
  op_completed(static_cast<pull_op*>(user), status);
}

void node::op_completed(pull_op* op, ucs_status_t status) {
  if (op->abandoned) {
    // UCX may end it only when the worker is destroyed, after the slots are gone.
    if (op->owner->pool_) op->owner->pool_->busy_end(op->job->landing);
    op->owner->rkey_done(op->rkey);
    delete op;
  } else if (op->issuing) {
    op->inline_status = status;
  } else {
    op->owner->op_done(op, status);
  }
}

ucs_status_t node::on_fail(void* arg, const void* header, std::size_t header_bytes, void*,
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
                      make_error(refusal_code(h.code), text + " (" + job->context + ")"));
  return UCS_OK;
}

// Moves jobs whose source failed to their next source, once nothing is in flight to the old
// one. Runs from the loop, outside UCX callbacks: UCX must not be asked for a new endpoint
// while it is still failing the old one.
void node::switch_sources() {
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
        abandon_inflight(*job, lane, true);
      }
      lane.switching = false;
      lane.get = false;  // fallbacks are relays, or publishers reached through relay handles
      auto ep = endpoint(lane.sources[++lane.source], job->context);
      lane.ep = ep ? *ep : nullptr;
      if (!ep) source_failed(*job, static_cast<std::size_t>(&lane - job->lanes.data()), ep.error());
      switched = true;
    }
    if (!switched) continue;
    pull_more(job);
    pull_check_done(job);
  }
}

// Keeps `window` chunks of every lane of the job in flight.
void node::pull_more(const std::shared_ptr<pull_job>& shared) {
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
      auto* op = new pull_op{.owner = this,
                             .job = shared,
                             .lane = i,
                             .segment = seg,
                             .offset = off,
                             .length = std::min(job.chunk, job.nbytes[seg] - off),
                             .tag = next_tag_++,
                             .request = nullptr,
                             .rkey = lane.get ? lane.rkey : nullptr,
                             .issuing = true,
                             .inline_status = std::nullopt,
                             .abandoned = false};
      lane.ops.push_back(op);
      ++lane.inflight;
      std::byte* dst = job.landing->base + job.offsets[seg] + off;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      p.user_data = op;
      p.memh = job.landing->memh;
      void* req = nullptr;
      if (lane.get) {
        p.cb.send = &node::on_get;
        rkey_used(op->rkey);
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

result<void> node::send_fetch(const pull_job& job, const pull_lane& lane, const pull_op& op) {
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

void node::op_done(pull_op* op, ucs_status_t status) {
  auto job = op->job;
  op_account(op, status);
  pull_more(job);
  pull_check_done(job);
}

// Books a finished operation on its job (and deletes it); starts nothing new.
void node::op_account(pull_op* op, ucs_status_t status) {
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
  rkey_done(op->rkey);
  delete op;
}

void node::pull_cancel(pull_job& job, std::size_t i, bool force_endpoint) {
  auto& lane = job.lanes[i];
  // UCX may end (and our callback free) an op inside the cancel: walk a copy, and skip ops that
  // ended meanwhile.
  for (auto* op : std::vector(lane.ops)) {
    if (std::find(lane.ops.begin(), lane.ops.end(), op) == lane.ops.end()) continue;
    // An op whose post just failed has no request (its caller books it): nothing to cancel.
    if (!lane.get && op->request != nullptr) ucp_request_cancel(worker_, op->request);
  }
  // RMA gets and rendezvous transfers already matched cannot be cancelled: closing the
  // endpoint completes them with an error. Not one that other work goes through (another
  // job's lane, a chunk we send, a fetch we hold): that would fail it too, and what is left
  // in flight here is given up by the caller and keeps the landing slot busy until UCX ends it.
  if (force_endpoint && lane.inflight && lane.ep && !endpoint_shared(lane.ep, &job)) {
    retire_endpoint(lane.ep);
  }
}

void node::pull_check_done(const std::shared_ptr<pull_job>& job) {
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

}  // namespace wsync::ucx_detail
