// The coordinator actor: authenticates ranks, feeds their messages to the coordinator_book and
// carries out the effects the book returns (coordinator_state.hpp: the steps it takes). All
// decisions live in the book.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "coordinator_actor.hpp"
#include "coordinator_state.hpp"
#include "guard.hpp"
#include "runtime_support.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/manifest/port_file.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using namespace proto;
using namespace coordinator_detail;

constexpr auto tick_interval = std::chrono::milliseconds(200);

coordinator_actor::behavior_type coordinator_impl(coordinator_pointer self, std::string token,
                                                  book_config config, update_router router) {
  self->state.token = std::move(token);
  self->state.router = std::move(router);
  self->state.book = coordinator_book(config);
  self->state.orphans_settle_at = coord_clock::now() + config.rejoin_grace;
  self->set_down_handler([=](caf::down_msg& msg) {
    auto& st = self->state;
    auto it = st.members.find(msg.source);
    if (it == st.members.end()) return;
    auto m = it->second;
    const auto first = *m.ranks.begin();  // every rank of an endpoint has the same handle
    bool genuine = m.role == rank_role::consumer
                       ? !st.consumers.count(first) || really_down(st.consumers[first])
                       : !st.publishers.count(first) || really_down(st.publishers[first]);
    auto who = "coordinator: " + std::string(rank_role_name(m.role)) +
               (m.ranks.size() == 1
                    ? " rank " + std::to_string(first)
                    : " ranks " + std::to_string(first) + ".." + std::to_string(*m.ranks.rbegin()) +
                          " (" + std::to_string(m.ranks.size()) + " ranks)");
    if (!genuine) {
      log_warn(who + ": refused a down message while the endpoint is still running");
      return;
    }
    st.members.erase(it);
    std::vector<std::int32_t> orphaned;
    const bool led = endpoint_gone(st, msg.source, m, orphaned);
    auto reason = "down: " + self->system().render(msg.reason);
    // A rank that stopped in order (SIGTERM, the end of its work) says user_shutdown; only a
    // lost link or a crash is worth a warning.
    if (msg.reason == caf::exit_reason::user_shutdown || msg.reason == caf::exit_reason::normal) {
      log_info(who + " left");
    } else {
      log_warn(who + " " + reason);
    }
    // Every rank of the endpoint is gone before the first leaves the book: the effects of one
    // leaving (a commit, a catch-up, a retry distributed) must not route bytes through another.
    for (auto rank : m.ranks) {
      if (m.role == rank_role::consumer) st.consumers.erase(rank);
    }
    for (auto rank : m.ranks) {
      if (m.role == rank_role::consumer) {
        st.active_version.erase(rank);
        std::vector<std::string> keys;
        for (const auto& [key, o] : st.orphans) keys.push_back(key);
        for (const auto& key : keys) orphan_release(self, key, rank);
      } else {
        st.publishers.erase(rank);
        // Its retries waiting for an aborted attempt go with it: taken later they would belong
        // to no live rank, and refuse the shard its next incarnation publishes.
        for (auto d = st.deferred.begin(); d != st.deferred.end();) {
          std::erase_if(d->second, [&](const auto& w) { return w.manifest.source_rank == rank; });
          d = d->second.empty() ? st.deferred.erase(d) : std::next(d);
        }
      }
      run_effects(self, st.book.leave(rank, m.role, reason, coord_clock::now()));
    }
    if (led) lead_node(self, m.node);
    resend_unanswered(self, orphaned);
  });
  self->state.tick_nonce = random_u64();
  self->delayed_send(self, tick_interval, tick_atom::value, self->state.tick_nonce);
  return {
      [=](join_atom, const rank_hello& hello) -> std::tuple<std::string, std::string> {
        auto& st = self->state;
        if (!token_matches(hello.token, st.token)) {
          log_warn("coordinator: refused rank " + std::to_string(hello.rank) +
                   ": wrong cluster token");
          return {"", "join refused: token: wrong cluster token"};
        }
        if (hello.role != "publisher" && hello.role != "consumer") {
          return {st.token,
                  "join refused: role: \"" + hello.role + "\" is neither publisher nor consumer"};
        }
        auto role = hello.role == "publisher" ? rank_role::publisher : rank_role::consumer;
        rank_info info{hello.rank,
                       role,
                       hello.node,
                       hello.model_id,
                       hello.transports,
                       hello.address,
                       hello.publisher_ranks,
                       hello.active_weight_version,
                       hello.held};
        auto sender = self->current_sender();
        // A join is answered to, and monitored as, its sender: one without (an anonymous
        // message, or one whose proxy CAF could not make) cannot be a rank.
        if (!sender) return {st.token, "join refused: the join has no sender to answer"};
        const auto sender_addr = caf::actor_cast<caf::actor_addr>(sender);
        // Everything is checked before anything changes: a refused join leaves no trace.
        if (auto m = st.members.find(sender_addr); m != st.members.end()) {
          if (m->second.role != role) {
            return {st.token, "join refused: role: this endpoint already joined ranks as " +
                                  std::string(rank_role_name(m->second.role))};
          }
          // The same endpoint asking again for a rank it has: a retry of a join whose answer
          // came late (a busy coordinator), not a restart. Treating it as one would fail the
          // rank's in-flight updates and hand its node's leadership round again. The first
          // join already recorded what the rank holds.
          if (m->second.ranks.count(hello.rank) != 0) return {st.token, ""};
        }
        auto effects = st.book.join(info, coord_clock::now());  // checks, then registers
        if (!effects) return {st.token, effects.error().message};
        if (role == rank_role::consumer) adopt_served(self, hello, *effects);
        // A rank joining again replaces its old endpoint (it restarted); an old endpoint left
        // without ranks is gone, and so is its node's leadership if it had it.
        if (role == rank_role::consumer) st.carriers.erase(hello.rank);
        std::vector<std::int32_t> orphaned;
        std::set<std::string> leaderless;
        for (auto it = st.members.begin(); it != st.members.end();) {
          if (it->second.role == role) it->second.ranks.erase(hello.rank);
          if (!it->second.ranks.empty()) {
            ++it;
            continue;
          }
          if (endpoint_gone(st, it->first, it->second, orphaned))
            leaderless.insert(it->second.node);
          it = st.members.erase(it);
        }
        if (role == rank_role::consumer) {
          st.consumers[hello.rank] = caf::actor_cast<consumer_actor>(sender);
          st.active_version[hello.rank] = hello.active_weight_version;
        } else {
          st.publishers[hello.rank] = caf::actor_cast<publisher_actor>(sender);
        }
        if (role == rank_role::consumer) {
          // A key it held before and names no more it let go of while away (its report lost),
          // unless this join sends it an adopted key again (a catch-up lost with the old link):
          // the orphan's memory is what it is about to read. (Another key's catch-up is a newer
          // attempt under the same key, whose release would never let go of the orphan.)
          const std::set<std::string> now_held(hello.held.begin(), hello.held.end());
          std::set<std::string> sent_again;
          for (const auto& e : *effects) {
            const auto* u = st.book.find(e.key);
            if (e.what == book_effect::kind::distribute && u && u->adopted &&
                std::find(e.ranks.begin(), e.ranks.end(), hello.rank) != e.ranks.end()) {
              sent_again.insert(e.key);
            }
          }
          std::vector<std::string> dropped;
          for (const auto& [key, o] : st.orphans) {
            if (o.holders.count(hello.rank) && !now_held.count(key) && !sent_again.count(key)) {
              dropped.push_back(key);
            }
          }
          for (const auto& key : dropped) orphan_release(self, key, hello.rank);
          // Held keys the book does not know, keys of orphans (an old attempt of a version the
          // book knows by its retry: the key does not say which attempt the rank holds), and
          // adopted versions (the book never releases their publishers' memory).
          for (const auto& key : now_held) {
            const auto* known = st.book.find(key);
            if (!known || known->adopted || st.orphans.count(key)) {
              st.orphans[key].holders.insert(hello.rank);
            }
          }
        } else {
          for (std::size_t i = 0; i < std::min(hello.held.size(), hello.held_ids.size()); ++i) {
            const auto& key = hello.held[i];
            const auto& id = hello.held_ids[i];
            const auto* known = st.book.find(key);
            bool tracked = false;            // the book's record names this very attempt
            if (known && !known->adopted) {  // an adopted version's memory is the orphan's
              auto shard = known->shards.find(hello.rank);
              tracked = shard != known->shards.end() && shard->second.update_id == id;
            }
            if (!tracked) {
              // Unknown to the book (it restarted, or never got the shard), or an attempt it
              // replaced by a retry after releasing it while the rank was away.
              orphan_published(self, key, hello.rank, id);
            } else if (known->publishers_released) {
              // Its release went out while the rank was away (lost with its old link): again.
              self->send(st.publishers[hello.rank], release_atom::value, st.token, key,
                         std::vector<std::string>{id});
            }
          }
        }
        auto [joined, fresh] =
            st.members.try_emplace(sender_addr, member{role, {}, hello.node, hello.node_port});
        joined->second.ranks.insert(hello.rank);
        if (fresh) self->monitor(caf::actor_cast<caf::actor>(sender));
        for (const auto& node : leaderless) lead_node(self, node);
        if (fresh && role == rank_role::consumer) lead_node(self, hello.node, sender_addr);
        resend_unanswered(self, orphaned);
        log_info("coordinator: " + hello.role + " rank " + std::to_string(hello.rank) +
                 " joined from node " + hello.node);
        run_effects(self, *effects);
        return {st.token, ""};
      },
      [=](publish_atom, const std::string& given,
          const std::string& manifest_json) -> caf::result<std::string, std::string> {
        auto& st = self->state;
        auto refuse = [&](const std::string& why,
                          errc code =
                              errc::invalid_argument) -> caf::result<std::string, std::string> {
          return {st.token, refusal_text(why, code)};
        };
        const auto* m = sender_member(self);
        if (!token_matches(given, st.token)) {
          log_warn("coordinator: refused a publish from a peer without the cluster token");
          return {std::string(), json{{"error", "publish refused: token: not the cluster's"},
                                      {"code", "invalid_argument"}}
                                     .dump(-1, ' ', false, json::error_handler_t::replace)};
        }
        if (!m || m->role != rank_role::publisher) {
          // The token is right: the peer's membership is what is gone.
          log_warn("coordinator: refused a publish from an endpoint not joined as a publisher");
          return refuse(
              "publish refused: this endpoint is not joined as a publisher (its link went and "
              "it did not join again, or another process joined as its rank)");
        }
        auto manifest = manifest_from_json(manifest_json);
        if (!manifest) return refuse(manifest.error().message, manifest.error().code);
        if (!m->ranks.count(manifest->source_rank)) {
          return refuse("publish refused: source_rank " + std::to_string(manifest->source_rank) +
                        " differs from the joined rank " + std::to_string(*m->ranks.begin()) +
                        " (" + update_context(*manifest) + ")");
        }
        auto rp = self->make_response_promise<std::string, std::string>();
        if (st.book.retry_must_wait(*manifest)) {
          defer_retry(self, std::move(*manifest), rp);
          return rp;
        }
        accept_publish(self, *manifest, rp);
        return rp;
      },
      [=](report_atom, const rank_report& r) {
        const auto* m = sender_member(self);
        if (!token_matches(r.token, self->state.token) || !m || m->role != rank_role::consumer ||
            !m->ranks.count(r.rank)) {
          log_warn("coordinator: refused a report (" + r.state + " of " + r.key +
                   (r.update_id.empty() ? "" : ", update_id=" + update_id_shown(r.update_id)) +
                   ") for rank " + std::to_string(r.rank) +
                   " from a peer that did not join as that consumer with the cluster token");
          return;
        }
        // Counted once the peer is known to be a rank: the status's figures are the cluster's.
        ++self->state.messages.report_messages;
        ++self->state.messages.reports;
        take_report(self, r);
      },
      [=](report_atom, const report_batch& batch) {
        const auto* m = sender_member(self);
        const auto sender = caf::actor_cast<caf::actor_addr>(self->current_sender());
        if (!token_matches(batch.token, self->state.token) || !m ||
            m->role != rank_role::consumer) {
          log_warn("coordinator: refused a batch of " + std::to_string(batch.reports.size()) +
                   " reports from a peer that did not join as a consumer with the cluster token");
          return;
        }
        ++self->state.messages.report_messages;
        self->state.messages.reports += batch.reports.size();
        for (const auto& r : batch.reports) {
          // Checked again per report: the batch may name only the endpoint's own ranks, or
          // those of the node it leads.
          if (!token_matches(r.token, batch.token) ||
              (!m->ranks.count(r.rank) && !leads_rank(self->state, sender, r.rank))) {
            log_warn("coordinator: refused a report (" + r.state + " of " + r.key + ") for rank " +
                     std::to_string(r.rank) +
                     " in the batch of an endpoint that neither joined it nor leads its node");
            continue;
          }
          take_report(self, r);
        }
      },
      [=](status_atom, const std::string& given) -> std::string {
        if (!token_matches(given, self->state.token))
          return json{{"error", "status refused: token"}}.dump(-1, ' ', false,
                                                               json::error_handler_t::replace);
        return status_json(self->state);
      },
      [=](members_atom, const std::string& given, const std::string& model_id,
          const std::string& transport) -> std::string {
        if (!token_matches(given, self->state.token)) {
          return json{{"error", "members refused: token"}}.dump(-1, ' ', false,
                                                                json::error_handler_t::replace);
        }
        return json(self->state.book.consumers_of(model_id, transport))
            .dump(-1, ' ', false, json::error_handler_t::replace);
      },
      [=](tick_atom, std::uint64_t nonce) {
        // Only its own timer drives the deadlines: each tick schedules the next, so a tick a
        // peer sent would start one more chain of timers for good. A sender can be forged in
        // CAF 0.17 (docs/cluster.md, Security); the nonce cannot be guessed.
        if (nonce != self->state.tick_nonce) return;
        const auto now = coord_clock::now();
        run_effects(self, self->state.book.expire(now));
        expire_deferred(self, now);
        orphans_settle(self);
        self->delayed_send(self, tick_interval, tick_atom::value, nonce);
      },
      [=](carry_atom, const carry_notice& n) {
        auto& st = self->state;
        const auto sender = caf::actor_cast<caf::actor_addr>(self->current_sender());
        auto m = st.members.find(sender);
        if (!token_matches(n.token, st.token) || m == st.members.end() ||
            m->second.role != rank_role::consumer) {
          log_warn(
              "coordinator: refused a carry notice from a peer that did not join as a "
              "consumer with the cluster token");
          return;
        }
        const auto& node = m->second.node;
        if (n.carried) {
          auto lead = st.leaders.find(node);
          if (lead == st.leaders.end() || lead->second.addr != sender ||
              lead->second.epoch != n.epoch) {
            log_warn(
                "coordinator: refused a carry notice from an endpoint that does not lead "
                "node " +
                node + " in that epoch");
            return;
          }
          for (auto rank : n.ranks) {
            auto e = st.consumers.find(rank);
            auto info = st.book.consumers().find(rank);
            if (e == st.consumers.end() || info == st.book.consumers().end() ||
                info->second.node != node || e->second.address() == sender) {
              log_warn("coordinator: node " + node + "'s leader cannot carry consumer rank " +
                       std::to_string(rank) + ": not a rank of another endpoint on its node");
              continue;
            }
            st.carriers[rank] = carried_by{sender, lead->second.handle, n.epoch};
          }
          return;
        }
        // Let go of by the leader that carries them, or by the ranks' own endpoint; a notice of
        // an earlier leadership changes nothing.
        std::vector<std::int32_t> lost;
        for (auto rank : n.ranks) {
          auto c = st.carriers.find(rank);
          if (c == st.carriers.end() || c->second.epoch != n.epoch) continue;
          if (c->second.leader != sender && !m->second.ranks.count(rank)) continue;
          st.carriers.erase(c);
          lost.push_back(rank);
        }
        resend_unanswered(self, lost);
      },
  };
}

}  // namespace

proto::coordinator_actor coordinator_spawn(caf::actor_system& sys, std::string token,
                                           book_config config, update_router router) {
  return sys.spawn<guarded<coordinator_base>>(
      "coordinator",
      [token = std::move(token), config, router = std::move(router)](coordinator_base* self) {
        return coordinator_impl(self, token, config, router);
      });
}

bool host_is_loopback(const std::string& host) {
  if (host.empty()) return false;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || !found) return false;
  bool all = true;
  for (auto* a = found; a; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      auto ip = ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
      all = all && (ip >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      all = all &&
            IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr);
    } else {
      all = false;
    }
  }
  ::freeaddrinfo(found);
  return all;
}

int coordinator_run(const coordinator_options& options) {
  // Off loopback, a coordinator without TLS lets any host that reaches the port speak CAF's
  // protocol to it; the token guards every state change, but not the transport.
  if (!options.listen.tls.enabled() && !host_is_loopback(options.listen.host)) {
    if (!options.insecure) {
      log_error("coordinator: refusing to listen on '" + options.listen.host +
                "' without TLS: every host that reaches the port could talk to the cluster's "
                "control plane. Give --tls-cert, --tls-key and --tls-ca (`wsync certs` makes "
                "them), listen on 127.0.0.1, or accept the risk with --insecure");
      return 2;
    }
    log_warn("coordinator: listening on '" + options.listen.host +
             "' without TLS (--insecure): the control plane is open to every host that reaches "
             "the port");
  }
  cluster_system sys(options.heartbeat, options.listen.tls);
  book_config config;
  config.update_deadline = options.update_deadline;
  config.history_per_model = options.history_per_model;
  config.rejoin_grace = options.rejoin_grace;
  auto coordinator = coordinator_spawn(sys.get(), options.listen.token, config, options.router);
  port_file_clear(options.port_file);
  auto port = sys.publish(coordinator, options.listen);
  if (!port) {
    log_error("coordinator: cannot listen on " + options.listen.host + ":" +
              std::to_string(options.listen.port) + ": " + sys.get().render(port.error()));
    stop_guarded(coordinator, caf::exit_reason::kill);
    return 1;
  }
  log_info("coordinator: listening on " + options.listen.host + ":" + std::to_string(*port) +
           (sys.tls() ? " (TLS)" : ""));
  if (!options.port_file.empty()) {
    if (auto why = port_file_write(options.port_file, *port); !why.empty()) {
      log_error("coordinator: --port-file: " + why);
      stop_guarded(coordinator, caf::exit_reason::kill);
      return 1;
    }
  }
  const int rc = run_until_stopped(sys.get(), {caf::actor_cast<caf::actor>(coordinator)});
  port_file_clear(options.port_file);  // the port is no one's now
  return rc;
}

}  // namespace wsync
