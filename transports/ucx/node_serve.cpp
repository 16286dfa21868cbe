#include <algorithm>
#include <chrono>
#include <cstring>

#include "ucx/node.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::ucx_detail {

void node::serve_add(const update_id& id, served_update u) {
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

void node::serve_remove(const update_id& id) {
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

ucs_status_t node::on_fetch(void* arg, const void* header, std::size_t header_bytes, void*,
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
  if (h.address_bytes == 0 || h.address_bytes > max_worker_address_bytes) {
    log_warn("ucx: " + self->side_ + " dropped a fetch request whose requester address has " +
             std::to_string(h.address_bytes) + " bytes");
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

// Serves the fetches received since the last turn of the loop.
void node::answer_fetches() {
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
void node::forget_requests_of(ucp_ep_h ep) {
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

void node::chunk_landed(const update_id& id, std::uint32_t segment, std::uint64_t offset) {
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

void node::serve(const fetch_request& r) {
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
  // The relay has not started this import yet. It may never (it refused the version, or let
  // go of it): held for half the timeout, so that the requester, whose own import has the
  // whole of it, still has time to pull from its next source.
  fetch_request held = r;
  held.deadline = std::min(r.deadline, clock_type::now() + early_patience());
  early_.push_back(std::move(held));
}

void node::serve(served_update& u, const fetch_request& r) {
  std::uint64_t index = r.offset / u.chunk;
  if (r.segment >= u.nbytes.size() || r.offset % u.chunk || r.offset >= u.nbytes[r.segment] ||
      r.length != std::min(u.chunk, u.nbytes[r.segment] - r.offset)) {
    return refuse(r, errc::invalid_argument,
                  "ucx: fetch of segment " + std::to_string(r.segment) + " bytes [" +
                      std::to_string(r.offset) + ", +" + std::to_string(r.length) +
                      ") does not name a chunk of update_id " + r.id);
  }
  if (!u.landed[r.segment][index]) {
    auto& waiting = u.waiting[{r.segment, index}];
    if (waiting.size() >= max_waiting_per_chunk) {
      return refuse(r, errc::try_again,
                    "ucx: " + std::to_string(waiting.size()) +
                        " requesters already wait for chunk " + std::to_string(index) +
                        " of update_id " + r.id + "; retry");
    }
    // Not for longer than a fetch for an update the relay has not started: a relay whose own
    // source stalled would otherwise hold its children until its import gives up, which is
    // when theirs do too, and they would never pull from their next source.
    fetch_request held = r;
    held.deadline = std::min(r.deadline, clock_type::now() + early_patience());
    waiting.push_back(std::move(held));
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
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.memh = u.s->memh;
  auto* send = new chunk_send{this, u.s, r.reply_ep,
                              clock_type::now() + std::chrono::milliseconds(cfg_.timeout_ms)};
  p.user_data = send;
  p.cb.send = [](void* request, ucs_status_t status, void* user) {
    auto* c = static_cast<chunk_send*>(user);
    if (status == UCS_OK) c->owner->sends_done_at_[c->ep] = clock_type::now();
    --c->owner->sends_in_flight_;
    c->owner->chunk_sends_.erase(c);
    if (c->owner->pool_) c->owner->pool_->busy_end(c->s);  // gone at worker destruction
    delete c;
    ucp_request_free(request);
  };
  pool_->busy_begin(u.s);
  ++sends_in_flight_;
  chunk_sends_.insert(send);
  void* req = ucp_tag_send_nbx(r.reply_ep, data, r.length, r.tag, &p);
  if (ptr_is_error(req)) {
    --sends_in_flight_;
    chunk_sends_.erase(send);
    pool_->busy_end(u.s);
    delete send;
    log_warn("ucx: " + side_ + " could not send chunk " + std::to_string(index) + " of " + r.id +
             ": " + ucs_status_string(ptr_status(req)));
  }
}

void node::refuse(const fetch_request& r, errc code, const std::string& text) {
  fail_header h{r.tag, static_cast<std::uint32_t>(code), static_cast<std::uint32_t>(text.size())};
  std::string buf(reinterpret_cast<const char*>(&h), sizeof h);
  if (auto ok = send_am(r.reply_ep, am_fail, buf + text, 0, r.id); !ok) {
    log_warn("ucx: " + side_ + " could not refuse a fetch: " + ok.error().message);
  }
}

void node::expire_early(clock_type::time_point now) {
  for (auto it = early_.begin(); it != early_.end();) {
    if (it->deadline > now) {
      ++it;
      continue;
    }
    refuse(*it, errc::timeout,
           "ucx: the relay did not start importing update_id " + it->id + " within " +
               std::to_string(early_patience().count()) + " ms");
    it = early_.erase(it);
  }
}

void node::expire_waiting(clock_type::time_point now) {
  for (auto& [id, u] : served_) {
    for (auto w = u.waiting.begin(); w != u.waiting.end();) {
      auto& requests = w->second;
      for (auto it = requests.begin(); it != requests.end();) {
        if (it->deadline > now) {
          ++it;
          continue;
        }
        refuse(*it, errc::timeout,
               "ucx: chunk " + std::to_string(w->first.second) + " of segment " +
                   std::to_string(w->first.first) + " of update_id " + id +
                   " did not reach the relay within " + std::to_string(early_patience().count()) +
                   " ms");
        it = requests.erase(it);
      }
      w = requests.empty() ? u.waiting.erase(w) : std::next(w);
    }
  }
}

// A chunk send still running past its deadline (the serving side's timeout_ms), to a peer
// that took no chunk from us for that long, is one its requester no longer waits for: it timed
// out, or moved to another source, and cancelled its receive. UCX cannot cancel a send, and a
// rendezvous nobody matches never ends, keeping the slot it reads busy. Closing the endpoint
// ends every send on it; the requester, should it still be there, sees the connection fail
// (over transports that report a failed peer; over shared memory only, at its own deadline)
// and pulls from its next source.
void node::expire_sends(clock_type::time_point now) {
  const auto patience = std::chrono::milliseconds(cfg_.timeout_ms);
  std::vector<ucp_ep_h> stuck;
  for (const auto* c : chunk_sends_) {
    if (c->deadline > now || std::find(stuck.begin(), stuck.end(), c->ep) != stuck.end()) continue;
    // A peer still taking other chunks is slow, not gone; but not for a second timeout: one
    // that took later updates while this send stayed unmatched cancelled its receive.
    if (auto done = sends_done_at_.find(c->ep); done != sends_done_at_.end() &&
                                                now - done->second < patience &&
                                                now - c->deadline < patience) {
      continue;
    }
    stuck.push_back(c->ep);
  }
  for (auto ep : stuck) {
    if (drop_endpoint(ep, "was closed: the source's chunks to this node went untaken for " +
                              std::to_string(cfg_.timeout_ms) + " ms")) {
      log_warn("ucx: " + side_ + " closed a connection whose peer took no chunk within " +
               std::to_string(cfg_.timeout_ms) +
               " ms (option timeout_ms); the slot those chunks "
               "held is free again");
    }
  }
  // The loop closes what drop_endpoint queued, on its next turn.
}

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

}  // namespace wsync::ucx_detail
