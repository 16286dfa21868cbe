// The coordinator's steps (coordinator_state.hpp): what its handlers do with the book's
// effects, node leadership, reports and the status document.

#include <algorithm>
#include <nlohmann/json.hpp>

#include "coordinator_state.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/json_writer.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync::coordinator_detail {

using json = nlohmann::json;
// Every dump below replaces invalid UTF-8 (a reason quoting bytes a peer sent) instead of
// throwing inside an actor.

// An update's outcome as publishers and the status table read it, written directly: a
// thousand ranks through a JSON document cost ~3 ms per update, on the trainer's path.
std::string outcome_text(const update_record& u) {
  json_writer w(256 + u.consumers.size() * 128);
  const double commit_s =
      u.finished ? std::chrono::duration<double>(*u.finished - u.created).count() : 0.0;
  w.open('{');
  w.key("adopted").boolean(u.adopted);
  w.key("attempt").number(u.attempt);
  w.key("commit_s").real(commit_s);
  w.key("key").text(u.key);
  w.key("phase").text(update_phase_name(u.phase));
  w.key("ranks").open('[');
  for (const auto& [rank, p] : u.consumers) {
    w.open('{');
    w.key("acknowledged").boolean(p.acknowledged);
    w.key("data_s").real(p.data_s);
    w.key("rank").number(rank);
    w.key("reason").text(p.reason);
    w.key("received_from").text(p.received_from);
    w.key("state").text(rank_state_name(p.state));
    w.close('}');
  }
  w.close(']');
  w.key("reason").text(u.reason);
  w.key("weight_version").number(u.weight_version);
  w.close('}');
  return w.take();
}

// What a refused publish answers: the message and its error code, so a trainer raises the right
// error class (the Python module does).
std::string refusal_text(const std::string& why, errc code) {
  return json{{"error", why}, {"code", errc_name(code)}}.dump(-1, ' ', false,
                                                              json::error_handler_t::replace);
}

// Sends once to each endpoint of `ranks` still connected (a rank that left has none any more;
// ranks sharing an endpoint share the message).
template <class Endpoints, class... Ts>
void send_to(coordinator_pointer self, const Endpoints& endpoints,
             const std::vector<std::int32_t>& ranks, const Ts&... xs) {
  std::set<caf::actor_addr> sent;
  for (auto rank : ranks) {
    auto it = endpoints.find(rank);
    if (it != endpoints.end() && sent.insert(it->second.address()).second) {
      self->send(it->second, xs...);
    }
  }
}

// Each consumer's part of the plan for a distributed update, from the router; empty (everyone
// from the publishers) without one or when it fails.
std::map<std::int32_t, routed_update> route(coordinator_state& st, const book_effect& e) {
  if (!st.router) return {};
  std::vector<route_member> consumers, publishers;
  for (auto rank : e.ranks) {
    // Only ranks with a live endpoint relay (the book may still list one whose endpoint died
    // while its siblings leave).
    if (!st.consumers.count(rank)) continue;
    if (auto it = st.book.consumers().find(rank); it != st.book.consumers().end()) {
      consumers.push_back({rank, it->second.node, it->second.address});
    }
  }
  for (const auto& m : e.manifests) {
    auto it = st.book.publishers().find(m.source_rank);
    // A publisher that left since publishing still has its node's name in no table: its shard
    // comes from its own "node".
    publishers.push_back({m.source_rank,
                          it != st.book.publishers().end()
                              ? it->second.node
                              : "publisher-" + std::to_string(m.source_rank),
                          ""});
  }
  auto routes = st.router(e.manifests, consumers, publishers);
  if (!routes) {
    log_warn("coordinator: update " + e.key +
             " goes from the publishers to every rank: " + routes.error().message);
    return {};
  }
  return std::move(*routes);
}

// A catch-up from a rank that still holds the version, for transports whose consumers relay
// what they hold (ucx): its publisher may be gone. The handle keeps the publisher as the
// fallback. Prefers a holder on the joining rank's node; none (or a transport that cannot
// relay, like shared memory, whose consumers pass descriptors instead): nothing.
std::optional<routed_update> catch_up_route(coordinator_state& st, const book_effect& e,
                                            std::int32_t rank) {
  const auto* u = st.book.find(e.key);
  auto me = st.book.consumers().find(rank);
  if (!u || me == st.book.consumers().end()) return std::nullopt;
  const rank_info* best = nullptr;
  for (const auto& [r, p] : u->consumers) {
    if (r == rank || p.state != rank_state::acknowledged) continue;  // released: not held
    if (!st.consumers.count(r)) continue;  // its endpoint died (its siblings are leaving)
    auto holder = st.book.consumers().find(r);
    if (holder == st.book.consumers().end() || holder->second.address.empty()) continue;
    if (!best || (holder->second.node == me->second.node && best->node != me->second.node)) {
      best = &holder->second;
    }
  }
  if (!best) return std::nullopt;
  routed_update out;
  for (const auto& m : e.manifests) {
    auto t = make_transport(m.transport);
    if (!t) return std::nullopt;
    auto handle = (*t)->handle_via_relay(m.transport_handle, best->address);
    if (!handle) return std::nullopt;
    out.manifests.push_back(m);
    out.manifests.back().transport_handle = std::move(*handle);
  }
  out.received_from = "rank:" + std::to_string(best->rank) +
                      (best->node == me->second.node ? " (shared memory)" : " (network)");
  return out;
}

// Sends an update to the ranks of `e`: one message per endpoint and route, so a process holding
// many ranks (a node's rollout process) gets it once, with the list of its ranks.
void distribute(coordinator_pointer self, const book_effect& e, bool resend = false) {
  auto& st = self->state;
  update_available direct{st.token, e.key, {}, "", {}, resend};
  for (const auto& m : e.manifests) {
    direct.manifests.push_back(manifest_to_json(m));
    direct.received_from +=
        (direct.received_from.empty() ? "publisher:" : ",") + std::to_string(m.source_rank);
  }
  auto routes = e.catch_up ? std::map<std::int32_t, routed_update>{} : route(st, e);
  if (e.catch_up) {
    for (auto rank : e.ranks) {
      if (auto r = catch_up_route(st, e, rank)) routes[rank] = std::move(*r);
    }
  }
  // By endpoint (the node's leader for the ranks it carries), then by route ("" for straight
  // from the publishers).
  std::map<caf::actor_addr, std::pair<consumer_actor, std::map<std::string, update_available>>> out;
  std::map<std::string, const std::vector<weight_update_manifest>*> routed;  // by route id
  for (auto rank : e.ranks) {
    auto endpoint = st.consumers.find(rank);
    if (endpoint == st.consumers.end()) continue;  // it left
    consumer_actor to = endpoint->second;
    if (auto c = st.carriers.find(rank); c != st.carriers.end()) to = c->second.handle;
    auto& [handle, messages] = out[to.address()];
    handle = to;
    auto it = routes.find(rank);
    if (it == routes.end()) {
      auto& msg = messages.try_emplace("", direct).first->second;
      msg.ranks.push_back(rank);
      continue;
    }
    // Each distinct route is encoded once, not once per rank. Routes differ by their hop and
    // handles (the fan-out router changes nothing else); one that differs otherwise (another
    // router) is told apart by its whole JSON.
    // Each part length-prefixed: handles are opaque bytes, and no two routes' parts may join
    // into the same id.
    auto part = [](std::string& id, std::string_view text) {
      id += std::to_string(text.size()) + ":";
      id += text;
    };
    std::string route_id = "h";
    part(route_id, it->second.received_from);
    for (const auto& m : it->second.manifests) part(route_id, m.transport_handle);
    if (auto seen = routed.try_emplace(route_id, &it->second.manifests).first;
        *seen->second != it->second.manifests) {
      route_id[0] = 'j';  // never equal to a short id
      for (const auto& m : it->second.manifests) part(route_id, manifest_to_json(m));
    }
    auto [at, fresh] = messages.try_emplace(route_id);
    auto& msg = at->second;
    if (fresh) {
      msg = update_available{st.token, e.key, {}, it->second.received_from, {}, resend};
      for (const auto& m : it->second.manifests) msg.manifests.push_back(manifest_to_json(m));
    }
    msg.ranks.push_back(rank);
  }
  for (auto& [addr, sends] : out) {
    for (auto& [route_id, msg] : sends.second) {
      ++st.messages.updates_sent;
      self->send(sends.first, update_atom::value, std::move(msg));
    }
  }
}

void run_effects(coordinator_pointer self, const std::vector<book_effect>& effects) {
  auto& st = self->state;
  for (const auto& e : effects) {
    switch (e.what) {
      case book_effect::kind::distribute:
        if (const auto* u = st.book.find(e.key); u && u->adopted) {
          // Its publishers' memory is an orphan's: these ranks are about to read it.
          st.orphans[e.key].holders.insert(e.ranks.begin(), e.ranks.end());
        }
        distribute(self, e);
        break;
      case book_effect::kind::drop:
        send_to(self, st.consumers, e.ranks, drop_atom::value, st.token, e.key);
        break;
      case book_effect::kind::outcome: {
        const update_record* u = e.record.get();  // the finished record (outcome_of)
        if (!u) break;
        if (u->phase == update_phase::committed) ++st.committed;
        log_info("update " + e.key + " " + std::string(update_phase_name(u->phase)) +
                 (u->reason.empty() ? "" : ": " + u->reason));
        auto text = outcome_text(*u);
        for (auto& rp : st.waiting[e.key]) rp.deliver(st.token, text);
        st.waiting.erase(e.key);
        break;
      }
      case book_effect::kind::release_publisher: {
        send_to(self, st.publishers, e.ranks, release_atom::value, st.token, e.key, e.update_ids);
        take_deferred(self, e.key);  // a retry of this version waited for exactly this
        break;
      }
    }
  }
}

namespace {

// A retry refused after it waited: its publisher may have stopped waiting for the answer, and
// then keeps the memory unless told.
void give_back(coordinator_pointer self, const std::string& key, const weight_update_manifest& m) {
  auto& st = self->state;
  if (auto p = st.publishers.find(m.source_rank); p != st.publishers.end()) {
    self->send(p->second, release_atom::value, st.token, key,
               std::vector<std::string>{m.update_id});
  }
}

std::string ranks_text(const std::vector<std::int32_t>& ranks) {
  std::string out;
  for (auto r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out.empty() ? "none" : out;
}

}  // namespace

void defer_retry(coordinator_pointer self, weight_update_manifest m,
                 coordinator_state::outcome_promise rp) {
  auto& st = self->state;
  const auto key = update_key(m.model_id, m.weight_version);
  log_info("coordinator: a retry of " + key + " waits until the aborted attempt is released");
  // A rank retries again when its request timed out: the newer retry replaces its older one,
  // which is refused and given back (taken later, the older would commit while the newer, the
  // one its trainer waits for, is refused as a second shard of the rank).
  auto& waiting = st.deferred[key];
  for (auto it = waiting.begin(); it != waiting.end();) {
    if (it->manifest.source_rank != m.source_rank) {
      ++it;
      continue;
    }
    it->promise.deliver(
        st.token,
        refusal_text("publish refused: update_id=" + it->manifest.update_id +
                         " was replaced by a newer retry of " + key + " (update_id=" + m.update_id +
                         ") from the same source_rank " + std::to_string(m.source_rank),
                     errc::illegal_transition));
    give_back(self, key, it->manifest);
    it = waiting.erase(it);
  }
  waiting.push_back({std::move(m), rp, coord_clock::now()});
}

void take_deferred(coordinator_pointer self, const std::string& key) {
  auto& st = self->state;
  auto d = st.deferred.find(key);
  if (d == st.deferred.end()) return;
  if (!d->second.empty() && st.book.retry_must_wait(d->second.front().manifest)) return;
  auto retries = std::move(d->second);
  st.deferred.erase(d);
  for (auto& w : retries) {
    // Refused after waiting: a later version committed meanwhile, or a rank serves this one.
    if (!accept_publish(self, w.manifest, w.promise)) give_back(self, key, w.manifest);
  }
}

void expire_deferred(coordinator_pointer self, coord_clock::time_point now) {
  auto& st = self->state;
  const auto limit = st.book.config().update_deadline;
  for (auto d = st.deferred.begin(); d != st.deferred.end();) {
    const auto& key = d->first;
    auto& retries = d->second;
    for (auto it = retries.begin(); it != retries.end();) {
      if (now - it->since < limit) {
        ++it;
        continue;
      }
      const auto* old = st.book.find(key);
      std::string why = "publish refused: update_id=" + it->manifest.update_id + " (source_rank " +
                        std::to_string(it->manifest.source_rank) + ") waited " +
                        std::to_string(limit.count()) + " ms, the update deadline, for ranks " +
                        ranks_text(st.book.holders(key)) + " to let go of the aborted attempt " +
                        std::to_string(old ? old->attempt : 0) + " of " + key +
                        "; retry later or publish a version above it";
      log_warn("coordinator: " + why);
      it->promise.deliver(st.token, refusal_text(why, errc::timeout));
      give_back(self, key, it->manifest);
      it = retries.erase(it);
    }
    d = retries.empty() ? st.deferred.erase(d) : std::next(d);
  }
}

bool accept_publish(coordinator_pointer self, const weight_update_manifest& m,
                    coordinator_state::outcome_promise rp) {
  auto& st = self->state;
  auto effects = st.book.publish(m, coord_clock::now());
  if (!effects) {
    rp.deliver(st.token, refusal_text(effects.error().message, effects.error().code));
    return false;
  }
  st.waiting[update_key(m.model_id, m.weight_version)].push_back(rp);
  run_effects(self, *effects);
  return true;
}

namespace {

// Once no consumer holds the orphan's key and the rejoin grace is over: tells each publisher
// that holds attempts of it to give exactly those back, and forgets it. A publisher that is
// not joined now says what it holds again when it re-joins.
void orphan_settle_one(coordinator_pointer self, std::map<std::string, orphan>::iterator it) {
  auto& st = self->state;
  if (!it->second.holders.empty() || !st.orphans_settled) return;
  for (const auto& [rank, ids] : it->second.attempts) {
    if (auto p = st.publishers.find(rank); p != st.publishers.end()) {
      self->send(p->second, release_atom::value, st.token, it->first,
                 std::vector<std::string>(ids.begin(), ids.end()));
    }
  }
  st.orphans.erase(it);
}

}  // namespace

void adopt_served(coordinator_pointer self, const rank_hello& hello,
                  std::vector<book_effect>& effects) {
  auto& st = self->state;
  const auto key = update_key(hello.model_id, hello.active_weight_version);
  const auto* latest = st.book.latest_committed(hello.model_id);
  if (hello.active_weight_version == 0 || hello.active_manifests.empty() || st.book.find(key) ||
      (latest && latest->weight_version >= hello.active_weight_version) ||
      !st.adoption_tried.insert(key + "/" + std::to_string(hello.rank)).second) {
    return;  // the common case: nothing to adopt, and nothing parsed (nor refused twice)
  }
  std::vector<weight_update_manifest> shards;
  for (std::size_t i = 0; i < hello.active_manifests.size(); ++i) {
    auto m = manifest_from_json(hello.active_manifests[i]);
    if (!m) {
      log_warn("coordinator: adoption refused: active_manifests[" + std::to_string(i) + "]: " +
               m.error().message + " (update=" + key + " rank=" + std::to_string(hello.rank) + ")");
      return;
    }
    shards.push_back(std::move(*m));
  }
  auto adopted = st.book.adopt(hello.rank, shards, coord_clock::now());
  if (!adopted) {
    log_warn("coordinator: " + adopted.error().message);
    return;
  }
  if (st.book.find(key)) {
    log_info("coordinator: took " + key + " from consumer rank " + std::to_string(hello.rank) +
             ", which serves it: the catch-up source until the next version commits");
  }
  effects.insert(effects.end(), adopted->begin(), adopted->end());
}

void orphan_release(coordinator_pointer self, const std::string& key, std::int32_t rank) {
  auto it = self->state.orphans.find(key);
  if (it == self->state.orphans.end() || it->second.holders.erase(rank) == 0) return;
  orphan_settle_one(self, it);
}

void orphan_published(coordinator_pointer self, const std::string& key, std::int32_t rank,
                      const std::string& id) {
  auto& orphans = self->state.orphans;
  auto it = orphans.try_emplace(key).first;
  it->second.attempts[rank].insert(id);
  orphan_settle_one(self, it);
}

void orphans_settle(coordinator_pointer self) {
  auto& st = self->state;
  if (st.orphans_settled || coord_clock::now() < st.orphans_settle_at) return;
  st.orphans_settled = true;
  for (auto it = st.orphans.begin(); it != st.orphans.end();) {
    auto next = std::next(it);
    orphan_settle_one(self, it);  // may erase `it`
    it = next;
  }
}

// The lowest rank of a joined endpoint (every endpoint has one: an empty one is erased).
std::int32_t first_rank(const member& m) {
  return *m.ranks.begin();
}

// Names a leader for `node` when it has none — the consumer endpoint with the lowest rank among
// those that offer a port — and tells the node's other endpoints where to attach. `newcomer`: an
// endpoint that just joined a node with a leader; only it is told.
void lead_node(coordinator_pointer self, const std::string& node,
               std::optional<caf::actor_addr> newcomer) {
  auto& st = self->state;
  auto lead = st.leaders.find(node);
  if (lead == st.leaders.end()) {
    const std::pair<const caf::actor_addr, member>* best = nullptr;
    for (const auto& kv : st.members) {
      const auto& m = kv.second;
      if (m.role != rank_role::consumer || m.node != node || m.node_port == 0) continue;
      if (!best || first_rank(m) < first_rank(best->second)) best = &kv;
    }
    if (!best) return;
    const std::uint64_t epoch = random_u64() | 1;  // never 0
    auto handle = st.consumers[first_rank(best->second)];
    lead = st.leaders.emplace(node, node_lead{best->first, handle, epoch}).first;
    self->send(handle, lead_atom::value, st.token, std::uint16_t{0}, epoch);
    log_info("coordinator: node " + node + " is led by the endpoint of consumer rank " +
             std::to_string(first_rank(best->second)));
    newcomer.reset();  // a new leader: everyone attaches
  }
  const auto port = st.members[lead->second.addr].node_port;
  for (const auto& [addr, m] : st.members) {
    if (m.role != rank_role::consumer || m.node != node || addr == lead->second.addr) continue;
    if (newcomer && addr != *newcomer) continue;
    self->send(st.consumers[first_rank(m)], lead_atom::value, st.token, port, lead->second.epoch);
  }
}

// Forgets what endpoint `addr` (just gone: `m` was its entry) carried or was carried as: the ranks
// it carried as its node's leader are added to `orphaned`. True when it led its node.
bool endpoint_gone(coordinator_state& st, const caf::actor_addr& addr, const member& m,
                   std::vector<std::int32_t>& orphaned) {
  if (m.role != rank_role::consumer) return false;  // a publisher's ranks are other ranks
  for (auto c = st.carriers.begin(); c != st.carriers.end();) {
    if (c->second.leader == addr) {
      orphaned.push_back(c->first);
      c = st.carriers.erase(c);
    } else {
      c = m.ranks.count(c->first) ? st.carriers.erase(c) : std::next(c);
    }
  }
  auto lead = st.leaders.find(m.node);
  if (lead == st.leaders.end() || lead->second.addr != addr) return false;
  st.leaders.erase(lead);
  return true;
}

// Whether `sender` leads the node of consumer rank `rank`: a leader reports for its node.
bool leads_rank(const coordinator_state& st, const caf::actor_addr& sender, std::int32_t rank) {
  auto info = st.book.consumers().find(rank);
  if (info == st.book.consumers().end()) return false;
  auto lead = st.leaders.find(info->second.node);
  return lead != st.leaders.end() && lead->second.addr == sender;
}

// `ranks` lost the leader that carried them: what they have not answered of the updates in
// flight, and of the catch-ups sent to them, goes to them again, straight (their leader may have
// died holding it, or their answers). A rank that already has it ignores the resend
// (update_available::resend).
void resend_unanswered(coordinator_pointer self, const std::vector<std::int32_t>& ranks) {
  auto& st = self->state;
  std::set<std::string> models;
  for (auto rank : ranks) {
    if (auto it = st.book.consumers().find(rank); it != st.book.consumers().end()) {
      models.insert(it->second.model_id);
    }
  }
  for (const auto& model : models) {
    for (const auto* u : st.book.updates(model)) {
      // A committed update still waits on ranks it was sent to as a catch-up.
      if (u->phase != update_phase::distributing && u->phase != update_phase::committed) continue;
      book_effect e{
          book_effect::kind::distribute, u->key, {}, {}, u->phase == update_phase::committed};
      for (auto rank : ranks) {
        auto p = u->consumers.find(rank);
        if (p != u->consumers.end() &&
            (p->second.state == rank_state::pending || p->second.state == rank_state::importing)) {
          e.ranks.push_back(rank);
        }
      }
      if (e.ranks.empty()) continue;
      for (const auto& [source, m] : u->shards) e.manifests.push_back(m);
      distribute(self, e, true);
    }
  }
}

std::string status_json(coordinator_state& st) {
  json ranks = json::array();
  std::uint64_t committed_version = 0;
  bool all_ok = true;
  for (const auto& [rank, info] : st.book.publishers()) {
    ranks.push_back({{"rank", rank},
                     {"node", info.node},
                     {"role", "publisher"},
                     {"model", info.model_id},
                     {"state", "joined"},
                     {"active_weight_version", nullptr},
                     {"received_from", nullptr},
                     {"reason", nullptr},
                     {"via", nullptr}});
  }
  json updates = json::array();
  std::set<std::string> models;
  for (const auto& [rank, info] : st.book.consumers()) models.insert(info.model_id);
  for (const auto& [rank, info] : st.book.publishers()) models.insert(info.model_id);
  std::map<std::int32_t, const rank_progress*> latest;  // consumer -> newest entry
  std::map<std::string, std::uint64_t> committed_of;    // model -> its latest committed version
  for (const auto& model : models) {
    // What a trainer publishes next must go above it: a version a consumer serves counts too
    // (after a coordinator restart, or installed after its abort).
    committed_version = std::max(committed_version, st.book.used_version(model));
    if (const auto* c = st.book.latest_committed(model)) committed_of[model] = c->weight_version;
    for (const auto* u : st.book.updates(model)) {
      updates.push_back(json::parse(outcome_text(*u), nullptr, false));  // status is rare
      for (const auto& [rank, p] : u->consumers) latest[rank] = &p;
    }
  }
  std::map<caf::actor_addr, std::int32_t> leader_rank;  // a leader as the table names it
  for (const auto& [node, lead] : st.leaders) {
    if (auto m = st.members.find(lead.addr); m != st.members.end()) {
      leader_rank[lead.addr] = first_rank(m->second);
    }
  }
  for (const auto& [rank, info] : st.book.consumers()) {
    const auto* p = latest.count(rank) ? latest[rank] : nullptr;
    json via = nullptr;
    if (auto c = st.carriers.find(rank);
        c != st.carriers.end() && leader_rank.count(c->second.leader)) {
      via = "rank:" + std::to_string(leader_rank[c->second.leader]);
    }
    std::string state = p ? std::string(rank_state_name(p->state)) : "joined";
    if (p && p->state != rank_state::acknowledged && p->state != rank_state::released) {
      all_ok = false;
    }
    // Each rank against its own model's committed version: models version independently.
    const auto committed = committed_of.find(info.model_id);
    all_ok = all_ok &&
             st.active_version[rank] == (committed == committed_of.end() ? 0 : committed->second);
    ranks.push_back({{"rank", rank},
                     {"node", info.node},
                     {"role", "consumer"},
                     {"model", info.model_id},
                     {"state", state},
                     {"active_weight_version", st.active_version[rank]},
                     {"received_from", p ? json(p->received_from) : json(nullptr)},
                     {"reason", p && !p->reason.empty() ? json(p->reason) : json(nullptr)},
                     {"via", std::move(via)}});
  }
  return json{{"status", all_ok && st.committed > 0 ? "pass" : "fail"},
              {"versions", st.committed},
              {"committed_version", committed_version},
              {"ranks", std::move(ranks)},
              {"updates", std::move(updates)},
              {"messages",
               {{"updates_sent", st.messages.updates_sent},
                {"report_messages", st.messages.report_messages},
                {"reports", st.messages.reports}}}}
      .dump(-1, ' ', false, json::error_handler_t::replace);
}

// One consumer rank's report, from an endpoint that joined it.
void take_report(coordinator_pointer self, const rank_report& r) {
  auto& st = self->state;
  auto& book = st.book;
  auto now = coord_clock::now();
  // The attempt the book tracks for the key, and whether the report names it (by an id of one
  // of its shards; a report without an id names none).
  const auto* tracked = book.find(r.key);
  const bool of_tracked =
      tracked && !r.update_id.empty() &&
      std::any_of(tracked->shards.begin(), tracked->shards.end(),
                  [&](const auto& s) { return s.second.update_id == r.update_id; });
  // A report of an aborted attempt, replayed late (its node leader died before the batch was
  // flushed), must not answer for the retry of the same key.
  if (tracked && !tracked->shards.empty() && !r.update_id.empty() && !of_tracked) {
    // Not for the book, but a release still lets go of that earlier attempt: after a restart
    // it is an orphan (its publisher kept it) that waits for exactly this.
    if (r.state == "released" && st.orphans.count(r.key)) {
      orphan_release(self, r.key, r.rank);
      return;
    }
    log_warn("coordinator: report refused: " + r.state +
             " of update_id=" + update_id_shown(r.update_id) + " rank=" + std::to_string(r.rank) +
             " is of an earlier attempt of " + r.key + " (now attempt " +
             std::to_string(tracked->attempt) + ")");
    return;
  }
  result<std::vector<book_effect>> effects = std::vector<book_effect>{};
  if (r.state == "importing") {
    effects = book.importing(r.key, r.rank, r.reason, now);
  } else if (r.state == "acknowledged") {
    // Never lowered by a report (a resent answer carries the version of its time): a joined
    // rank's active version only grows; its join sets it.
    auto& active = st.active_version[r.rank];
    active = std::max(active, r.active_weight_version);
    effects = book.acknowledged(r.key, r.rank, now, r.seconds, r.received_from);
  } else if (r.state == "rejected") {
    effects = book.rejected(r.key, r.rank, r.reason, now);
  } else if (r.state == "waiting") {
    effects = book.waiting(r.key, r.rank, r.reason, now);
  } else if (r.state == "released") {
    // An orphan of the key is held until every rank that said it holds the key lets go. A
    // release of the attempt the book tracks says nothing of the orphan (an older attempt of
    // the key, which the rank may still serve); that one's own release is taken above.
    const bool orphan = st.orphans.count(r.key) != 0;
    if (orphan && (!of_tracked || tracked->adopted)) orphan_release(self, r.key, r.rank);
    if (orphan && !tracked) return;
    effects = book.released(r.key, r.rank, now);
  } else {
    effects = make_error(errc::invalid_argument, "report refused: state: \"" + r.state +
                                                     "\" is unknown (update=" + r.key +
                                                     " rank=" + std::to_string(r.rank) + ")");
  }
  if (!effects) {
    log_warn("coordinator: " + effects.error().message);
    return;
  }
  run_effects(self, *effects);
  // A late acknowledgement of an aborted version: its waiting retries are refused now.
  if (r.state == "acknowledged") take_deferred(self, r.key);
}

const member* sender_member(coordinator_pointer self) {
  auto it = self->state.members.find(caf::actor_cast<caf::actor_addr>(self->current_sender()));
  return it == self->state.members.end() ? nullptr : &it->second;
}

}  // namespace wsync::coordinator_detail
