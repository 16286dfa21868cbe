// A consumer endpoint: joins the coordinator for its ranks, hands every update it is sent to
// their workers (consumer_rank.hpp), which run the rollout executor, and reports importing /
// acknowledged / rejected / released, batched per node when it leads or joins a node leader.

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "consumer_endpoint.hpp"
#include "consumer_rank.hpp"
#include "guard.hpp"
#include "runtime_support.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

using namespace proto;
using namespace consumer_detail;

// How long an endpoint holds reports back while some of its ranks still import an update, so
// that a node's answers reach the coordinator in one batch; a slow rank delays its peers' news
// by no more than this (the commit waits for every rank anyway).
constexpr auto report_linger = std::chrono::milliseconds(20);

void schedule_reconnect(endpoint_pointer self, const endpoint_state_ptr& st) {
  if (st->reconnecting) return;
  st->reconnecting = true;
  self->delayed_send(self, st->backoff, reconnect_atom::value);
}

// Joins one rank to the current coordinator in join round `round`, telling it the version the
// rank serves and what it still holds. A join that fails while the coordinator still runs (a
// timeout under load) is retried for that rank alone: re-joining its accepted peers would make
// the coordinator drop what they hold mid-update. Only a coordinator that is gone is reconnected.
void join_rank(endpoint_pointer self, const endpoint_state_ptr& st, std::int32_t rank,
               std::uint64_t round) {
  auto it = st->ranks.find(rank);
  if (round != st->join_round || it == st->ranks.end() || it->second.side->joined) return;
  auto hello = it->second.hello;
  auto side = it->second.side;
  hello.node_port = st->node_port;
  std::tie(hello.active_weight_version, hello.active_manifests) = side->active_served();
  hello.held = side->held();
  self->request(st->coordinator, std::chrono::seconds(10), join_atom::value, hello)
      .then(
          [=](const std::string& token, const std::string& refusal) {
            if (round != st->join_round) return;  // a later round replaced this one
            if (token_matches(token, hello.token) && refusal.empty()) {
              if (side->joined) return;
              side->joined = true;
              if (++st->accepted == st->ranks.size()) {
                st->joined = true;
                st->backoff = std::chrono::milliseconds(200);
              }
              return;
            }
            log_error("consumer rank " + std::to_string(hello.rank) + ": " + refusal);
            side->refused = true;
            self->quit(caf::exit_reason::user_shutdown);
          },
          [=](caf::error& err) {
            if (round != st->join_round) return;
            log_warn("consumer rank " + std::to_string(hello.rank) +
                     ": join failed: " + self->system().render(err));
            if (really_down(st->coordinator)) return schedule_reconnect(self, st);
            st->backoff = std::min(st->backoff * 2, std::chrono::milliseconds(5000));
            self->delayed_send(self, st->backoff, reconnect_atom::value, rank, st->join_nonce);
          });
}

// Joins (or re-joins) every rank to the current coordinator: a new round.
void join_all(endpoint_pointer self, const endpoint_state_ptr& st) {
  const auto round = ++st->join_round;
  st->join_nonce = random_u64();
  st->accepted = 0;
  self->monitor(st->coordinator);
  for (auto& [rank, slot] : st->ranks) slot.side->joined = false;
  for (auto& [rank, slot] : st->ranks) join_rank(self, st, rank, round);
}

// A rank answered `r.key`; once all of the endpoint's ranks did, the log says how it went (one
// line for the process, not one per rank).
void answered(const endpoint_state_ptr& st, const rank_report& r) {
  auto it = st->owed.find(r.key);
  if (it == st->owed.end()) return;
  if (r.state != "acknowledged") st->rejected[r.key][r.rank] = r.reason;
  it->second.erase(r.rank);
  if (!it->second.empty()) return;
  st->owed.erase(it);
  auto rejected = std::move(st->rejected[r.key]);
  st->rejected.erase(r.key);
  if (rejected.empty()) {
    log_info(st->who + ": active version " + std::to_string(r.active_weight_version) + " (" +
             r.key + ")");
    return;
  }
  std::string list;
  for (const auto& [rank, why] : rejected) {
    list += (list.empty() ? "" : "; ") + std::string("rank ") + std::to_string(rank) + ": " + why;
  }
  log_warn(st->who + ": update " + r.key +
           (r.update_id.empty() ? "" : " (update_id=" + update_id_shown(r.update_id) + ")") +
           " not installed by " + list);
}

// A report joins the pending batch.
void enqueue(const endpoint_state_ptr& st, rank_report r,
             std::chrono::steady_clock::time_point now) {
  if (st->pending.empty()) st->pending_since = now;
  st->pending.push_back(std::move(r));
}

// A report of this endpoint's ranks, or of a member's, joins the pending batch.
void take(const endpoint_state_ptr& st, rank_report r, std::chrono::steady_clock::time_point now) {
  if (r.state == "acknowledged" || r.state == "rejected" || r.state == "waiting") answered(st, r);
  if (st->ranks.count(r.rank)) remember_answer(*st, r);
  enqueue(st, std::move(r), now);
}

// Tells the members whose batches were taken that they went on (or held nothing to pass on).
void confirm_members(endpoint_pointer self, const endpoint_state_ptr& st) {
  for (const auto& [addr, seq] : std::exchange(st->unconfirmed_from, {})) {
    if (auto m = st->members.find(addr); m != st->members.end()) {
      self->send(m->second.handle, flushed_atom::value, st->token, seq);
    }
  }
}

// Sends a batch on: through the node's leader when attached to one (kept until the leader says
// it passed it on), else to the coordinator — and then tells the members whose reports were in
// it.
void send_batch(endpoint_pointer self, const endpoint_state_ptr& st,
                std::vector<rank_report> reports) {
  if (st->leader) {
    report_batch b{st->token, std::move(reports), ++st->batch_seq};
    st->unconfirmed.push_back(b);
    self->send(st->leader, report_atom::value, std::move(b));
    return;
  }
  self->send(st->coordinator, report_atom::value, report_batch{st->token, std::move(reports)});
  confirm_members(self, st);
}

// Sends what is pending once every rank answered what it was handed, or once the oldest pending
// report waited report_linger; otherwise makes sure a flush comes then.
void flush(endpoint_pointer self, const endpoint_state_ptr& st) {
  const auto now = std::chrono::steady_clock::now();
  if (st->linger_due && now >= *st->linger_due) st->linger_due.reset();
  for (auto& r : st->box->take()) take(st, std::move(r), now);
  if (st->pending.empty()) return;
  if (st->owed.empty() || now - *st->pending_since >= report_linger) {
    send_batch(self, st, std::exchange(st->pending, {}));
    st->pending_since.reset();
    return;
  }
  if (!st->linger_due) {
    st->linger_due = *st->pending_since + report_linger;
    self->delayed_send(self, *st->linger_due - now, flush_atom::value);
  }
}

// The endpoint of a process's consumer ranks: joins them, hands each update to the workers of
// the ranks it names, and sends their reports on in batches.
consumer_actor::behavior_type endpoint_impl(endpoint_pointer self, coordinator_actor coordinator,
                                            endpoint_state_ptr st, endpoint where,
                                            caf::io::middleman_actor connector) {
  st->coordinator = coordinator;
  st->connector = connector;
  {
    std::lock_guard lock(st->box->mu);
    st->box->endpoint = caf::actor_cast<caf::actor_addr>(self);
  }
  for (auto& [rank, slot] : st->ranks) self->monitor(slot.worker);
  // Connects in flight hold callbacks that hold the state: let go however the actor ends (an
  // answer that comes after is dropped with the mailbox).
  self->attach_functor([st] { st->connects.clear(); });
  // Leaving in order (only this process can stop it: guard.hpp): the answers it still holds —
  // its ranks' reports not sent yet, a leader's members' reports, what a member's leader had
  // not confirmed — go straight to the coordinator first, ahead of the down message that ends
  // the ranks there, so a rank that answered and then stopped is not counted as failed.
  self->set_exit_handler([=](caf::exit_msg& msg) {
    const auto now = std::chrono::steady_clock::now();
    for (auto& r : st->box->take()) take(st, std::move(r), now);
    detach(self, st);
    if (!st->pending.empty()) send_batch(self, st, std::exchange(st->pending, {}));
    self->quit(msg.reason);
  });
  self->set_down_handler([=](caf::down_msg& msg) {
    if (st->leader && msg.source == st->leader.address()) {
      if (!really_down(st->leader)) return;
      log_warn(st->who + ": its node's leader went away; reporting straight to the coordinator");
      detach(self, st);
      return;
    }
    if (auto m = st->members.find(msg.source); m != st->members.end()) {
      if (!really_down(m->second.handle)) return;
      member_gone(self, st, msg.source, true);
      return;
    }
    if (msg.source != st->coordinator.address()) {
      for (auto& [rank, slot] : st->ranks) {
        if (msg.source != slot.worker.address()) continue;
        log_error("consumer rank " + std::to_string(rank) +
                  ": its worker stopped: " + self->system().render(msg.reason));
        self->quit(msg.reason);
        return;
      }
      return;
    }
    if (!really_down(st->coordinator)) {
      log_warn(st->who + ": refused a down message for the coordinator, which is still running");
      return;
    }
    st->joined = false;
    for (auto& [rank, slot] : st->ranks) slot.side->joined = false;
    // Leadership was the coordinator's word: the next one names leaders anew.
    stop_leading(self, st, false);
    if (st->leader) self->demonitor(st->leader.address());
    st->leader = nullptr;
    st->member_epoch = 0;
    st->unconfirmed.clear();
    // Keep serving the active version and look for a restarted coordinator, with backoff.
    log_warn(st->who + ": coordinator went away; serving the active version, reconnecting");
    schedule_reconnect(self, st);
  });
  return {
      [=](update_atom, update_available& msg) {
        if (!token_matches(msg.token, st->token)) {
          log_warn(st->who + ": refused update " + msg.key + ": token: not from the coordinator");
          return;
        }
        // The ranks this endpoint carries for its node's other endpoints: one message to each.
        std::map<caf::actor_addr, update_available> relay;
        std::vector<std::int32_t> mine;
        for (auto rank : msg.ranks) {
          auto c = st->carried.find(rank);
          if (c == st->carried.end()) {
            mine.push_back(rank);
            continue;
          }
          auto& out = relay[c->second];
          if (out.ranks.empty()) {
            out = update_available{msg.token,         msg.key, msg.manifests,
                                   msg.received_from, {},      msg.resend};
          }
          out.ranks.push_back(rank);
          // A member's rank works on one update at a time: one it never answered (it went and
          // came back) is owed no more. A resent update is answered only by a rank that does not
          // have it yet.
          for (auto& [key, ranks] : st->owed) {
            if (key != msg.key) ranks.erase(rank);
          }
          if (!msg.resend) st->owed[msg.key].insert(rank);
        }
        forget_settled(*st);
        for (auto& [addr, out] : relay) {
          self->send(st->members[addr].handle, update_atom::value, std::move(out));
        }
        if (mine.empty()) return;
        auto u = std::make_shared<parsed_update>();
        u->token = msg.token;
        u->key = msg.key;
        u->identity = msg.key;
        u->received_from = msg.received_from;
        for (const auto& text : msg.manifests) {
          auto m = manifest_from_json(text);
          if (!m) {
            u->error = m.error().message;
            break;
          }
          u->identity += "/" + m->update_id;
          u->shards.push_back(std::move(*m));
        }
        auto work = caf::make_message(update_atom::value, parsed_update_ptr(u));
        const update_id attempt = u->shards.empty() ? update_id() : u->shards.front().update_id;
        bool answers_again = false;
        for (auto rank : mine) {
          auto it = st->ranks.find(rank);
          if (it == st->ranks.end()) {
            log_warn(st->who + ": update " + msg.key + " names rank " + std::to_string(rank) +
                     ", which is not here");
            continue;
          }
          auto& handed = st->handed[rank];
          if (msg.resend && std::find(handed.begin(), handed.end(), u->identity) != handed.end()) {
            // It has this one: its answer is on its way, or was lost with a node leader that
            // confirmed it too early (see endpoint_state::answers): then it goes again.
            for (auto& r : answers_to(*st, rank, msg.key, attempt)) {
              enqueue(st, std::move(r), std::chrono::steady_clock::now());
              answers_again = true;
            }
            continue;
          }
          forget_answers(*st, rank, msg.key, attempt);  // this delivery's answers replace them
          handed.push_front(u->identity);
          if (handed.size() > 16) handed.pop_back();
          st->owed[msg.key].insert(rank);
          it->second.side->importing(msg.key);  // held from now: see rollout_side::importing
          caf::anon_send(it->second.worker, work);
        }
        if (answers_again) flush(self, st);
      },
      [=](reconnect_atom) {
        st->reconnecting = false;
        if (st->joined) return;  // a stray reconnect: the coordinator is there
        st->backoff = std::min(st->backoff * 2, std::chrono::milliseconds(5000));
        connect_privately(self, st, where.host, where.port,
                          [=](caf::strong_actor_ptr ptr, const std::string& why) {
                            if (!ptr) {
                              log_warn(st->who + ": reconnecting to the coordinator: " + why);
                              return schedule_reconnect(self, st);
                            }
                            st->coordinator = caf::actor_cast<coordinator_actor>(ptr);
                            log_info(st->who + ": reconnected to the coordinator");
                            join_all(self, st);
                          });
      },
      [=](connected_atom, std::uint64_t nonce, caf::strong_actor_ptr& ptr, const std::string& why) {
        auto it = st->connects.find(nonce);
        if (it == st->connects.end()) return;  // forged (the nonce is random), or a repeat
        auto done = std::move(it->second);
        st->connects.erase(it);
        done(std::move(ptr), why);
      },
      [=](reconnect_atom, std::int32_t rank, std::uint64_t nonce) {
        // A retry of one rank's join, sent by join_rank; one of an earlier round, or forged
        // (the nonce is random per round), changes nothing.
        if (nonce == st->join_nonce) join_rank(self, st, rank, st->join_round);
      },
      [=](drop_atom, const std::string& token, const std::string& key) {
        if (!token_matches(token, st->token)) return;
        // Updates run to completion in the workers, so an aborted one is either already
        // rejected and released, or active — and the active version is kept.
        log_info(st->who + ": update " + key + " was aborted; keeping the active version");
      },
      [=](flush_atom) { flush(self, st); },
      [=](join_atom) {
        if (st->join_round == 0) join_all(self, st);  // once: later rounds are its own
      },
      [=](lead_atom, const std::string& token, std::uint16_t port, std::uint64_t epoch) {
        if (!token_matches(token, st->token)) return;
        if (port == 0) {  // this endpoint leads its node
          if (st->lead_epoch == epoch) return;
          stop_leading(self, st, true);
          detach(self, st);
          st->lead_epoch = epoch;
          log_info(st->who + ": leads the consumer endpoints of its node");
          attaches_settle(self, st);
          return;
        }
        if (st->member_epoch == epoch) return;
        stop_leading(self, st, true);
        detach(self, st);
        attaches_settle(self, st);  // refused: this endpoint leads nothing now
        attach(self, st, port, epoch);
      },
      [=](attach_atom, const attach_request& req) -> caf::result<std::string, std::string> {
        if (!token_matches(req.token, st->token)) {
          return {std::string(), std::string("attach refused: token: wrong cluster token")};
        }
        auto handle = caf::actor_cast<consumer_actor>(self->current_sender());
        if (req.epoch != st->lead_epoch && handle) {
          // A leadership this endpoint has not heard of: its own `lead` may still be on the way.
          if (st->attaches_waiting.size() >= endpoint_state::max_attaches_waiting) {
            st->attaches_waiting.pop_front();  // its promise breaks: that member reports straight
          }
          auto promise = self->make_response_promise<std::string, std::string>();
          st->attaches_waiting.push_back({req, handle, promise});
          return promise;
        }
        auto [token, refusal] = attach_accept(self, st, req, handle);
        return {std::move(token), std::move(refusal)};
      },
      [=](report_atom, report_batch& b) {
        auto m = st->members.find(caf::actor_cast<caf::actor_addr>(self->current_sender()));
        if (!token_matches(b.token, st->token)) {
          log_warn(st->who + ": refused a batch of reports: token: not the cluster's");
          return;
        }
        if (m == st->members.end()) {
          // Named, so that a lost answer can be traced (the member replays the batch when it
          // detaches): the ranks and updates it was about.
          std::set<std::int32_t> ranks;
          std::set<std::string> keys;
          for (const auto& r : b.reports) ranks.insert(r.rank), keys.insert(r.key);
          std::string about;
          for (auto r : ranks) about += (about.empty() ? "rank " : ",") + std::to_string(r);
          for (const auto& k : keys) about += (k == *keys.begin() ? "; " : ",") + k;
          log_warn(st->who + ": refused a batch of " + std::to_string(b.reports.size()) +
                   " reports (" + about + ") from an endpoint it does not carry");
          return;
        }
        const auto now = std::chrono::steady_clock::now();
        for (auto& r : b.reports) {
          const auto& ranks = m->second.ranks;
          if (!token_matches(r.token, st->token) ||
              std::find(ranks.begin(), ranks.end(), r.rank) == ranks.end()) {
            log_warn(st->who + ": refused a report for rank " + std::to_string(r.rank) +
                     " from a member endpoint that did not attach it");
            continue;
          }
          take(st, std::move(r), now);
        }
        st->unconfirmed_from[m->first] = b.seq;
        flush(self, st);
        if (st->pending.empty()) confirm_members(self, st);  // nothing of theirs left here
      },
      [=](flushed_atom, const std::string& token, std::uint64_t seq) {
        if (!token_matches(token, st->token) || !st->leader ||
            caf::actor_cast<caf::actor_addr>(self->current_sender()) != st->leader.address()) {
          return;
        }
        while (!st->unconfirmed.empty() && st->unconfirmed.front().seq <= seq) {
          st->unconfirmed.pop_front();
        }
      },
  };
}

// Spawns a worker per rank and their endpoint; returns the endpoint first, then the workers
// (stop them all together).
// With `node_leader`, the endpoint is published on a loopback port first, so that it can lead
// its node's other consumer endpoints if the coordinator asks it to.
std::vector<caf::actor> spawn_ranks(
    cluster_system& cs, coordinator_actor coordinator, const endpoint& where,
    std::vector<std::pair<std::shared_ptr<rollout_side>, rank_hello>> ranks,
    consumer_observer* observer, bool node_leader) {
  auto& sys = cs.get();
  auto connector = cs.connector();
  auto st = std::make_shared<endpoint_state>();
  st->box = std::make_shared<report_outbox>();
  st->token = where.token;
  const auto first = ranks.front().second.rank, last = ranks.back().second.rank;
  st->who = ranks.size() == 1
                ? "consumer rank " + std::to_string(first)
                : "consumer ranks " + std::to_string(first) + ".." + std::to_string(last);
  std::vector<caf::actor> actors{caf::actor()};
  for (auto& [side, hello] : ranks) {
    auto worker = sys.spawn(rank_worker, side, hello, st->box, observer);
    actors.push_back(worker);
    st->ranks[hello.rank] = rank_slot{side, hello, worker};
  }
  auto e = sys.spawn<guarded<consumer_actor::base>>(st->who, [=](consumer_actor::base* self) {
    return endpoint_impl(self, coordinator, st, where, connector);
  });
  if (node_leader) {
    endpoint local = where;
    local.host = "127.0.0.1";
    local.port = 0;
    if (auto port = cs.publish(e, local)) {
      st->node_port = *port;  // read by the endpoint only once it is started below
    } else {
      log_warn(st->who + ": cannot listen on 127.0.0.1 for its node's endpoints (" +
               sys.render(port.error()) + "); it will not lead its node");
    }
  }
  caf::anon_send(e, join_atom::value);
  actors.front() = caf::actor_cast<caf::actor>(e);
  return actors;
}

}  // namespace

int consumer_run(const consumer_options& options) {
  cluster_system sys(options.heartbeat, options.coordinator.tls);
  // The transports first: one that cannot run here (a GPU transport without a GPU) says so
  // before anything is asked of the coordinator.
  std::vector<std::pair<std::shared_ptr<rollout_side>, rank_hello>> ranks;
  // The sides outlive the actors, for the observer, which lets go of their runtimes on every
  // way out (an early return included) before the sides go.
  struct observer_stop {
    consumer_observer* observer;
    ~observer_stop() {
      if (observer) observer->stopping();
    }
  } stop_observing{options.observer};
  for (std::int32_t k = 0; k < options.count; ++k) {
    const std::string who = "consumer rank " + std::to_string(options.rank + k) + ": ";
    auto t = make_transport(options.transport, options.transport_settings);
    if (!t) return log_error(who + t.error().message), 1;
    auto c = (*t)->make_consumer();
    if (!c) return log_error(who + c.error().message), 1;
    auto side = std::make_shared<rollout_side>(std::move(*c), options.rank + k, options.verify);
    if (options.observer) options.observer->rank_started(options.rank + k, *side->own_runtime);
    auto hello = hello_make(options.coordinator.token, options.rank + k, "consumer", options.node,
                            options.model_id, options.transport);
    hello.address = side->relay_address;
    ranks.emplace_back(side, std::move(hello));
  }
  auto coordinator = sys.connect(options.coordinator);
  if (!coordinator) {
    log_error("consumer rank " + std::to_string(options.rank) +
              ": cannot reach the coordinator at " + options.coordinator.host + ":" +
              std::to_string(options.coordinator.port) + ": " +
              sys.get().render(coordinator.error()));
    return 1;
  }
  auto actors = spawn_ranks(sys, *coordinator, options.coordinator, ranks, options.observer,
                            options.node_leader);
  // An import still waiting (nccl: for a publisher that never comes) ends now, not at its
  // deadline: the actor system's shutdown waits for the rank's worker.
  return run_until_stopped(sys.get(), actors, [&] {
    for (auto& [side, hello] : ranks) side->consumer.closing();
  });
}

struct rollout_rank::impl {
  impl(std::chrono::milliseconds heartbeat, const tls_settings& tls) : sys(heartbeat, tls) {}
  cluster_system sys;  // first: blocks the stop signals before any thread starts
  std::shared_ptr<rollout_side> side;
  std::vector<caf::actor> actors;  ///< the endpoint, then the rank's worker
};

rollout_rank::rollout_rank(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

rollout_rank::~rollout_rank() {
  impl_->side->consumer.closing();  // an import still waiting ends now (consumer_run)
  stop_and_wait(impl_->sys.get(), impl_->actors);
  impl_->actors.clear();
  impl_->side->executor.release_active();
}

result<std::unique_ptr<rollout_rank>> rollout_rank::connect(const rollout_options& o,
                                                            install_adapter& adapter,
                                                            generation_gate& gate,
                                                            consumer_observer* observer) {
  auto p = std::make_unique<impl>(o.heartbeat, o.coordinator.tls);
  const auto who = "consumer rank " + std::to_string(o.rank);
  // The transport first: one that cannot run here says so before the coordinator is asked.
  auto t = make_transport(o.transport, o.transport_settings);
  if (!t) return t.error();
  auto c = (*t)->make_consumer();
  if (!c) return c.error();
  p->side = std::make_shared<rollout_side>(std::move(*c), o.rank, o.verify, adapter, gate);
  auto coordinator = p->sys.connect(o.coordinator);
  if (!coordinator) {
    return make_error(errc::io_error, who + ": cannot reach the coordinator at " +
                                          o.coordinator.host + ":" +
                                          std::to_string(o.coordinator.port) + ": " +
                                          p->sys.get().render(coordinator.error()));
  }
  auto hello = hello_make(o.coordinator.token, o.rank, "consumer", o.node, o.model_id, o.transport);
  hello.address = p->side->relay_address;
  p->actors = spawn_ranks(p->sys, *coordinator, o.coordinator, {{p->side, std::move(hello)}},
                          observer, o.node_leader);
  auto rank = std::unique_ptr<rollout_rank>(new rollout_rank(std::move(p)));
  const auto deadline = std::chrono::steady_clock::now() + o.join_timeout;
  while (!rank->impl_->side->joined) {
    if (rank->impl_->side->refused) {
      return make_error(errc::invalid_argument,
                        who + ": the coordinator refused the rank (see the log for why)");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return make_error(errc::timeout, who + ": not joined to the coordinator at " +
                                           o.coordinator.host + ":" +
                                           std::to_string(o.coordinator.port) + " within " +
                                           std::to_string(o.join_timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return rank;
}

std::uint64_t rollout_rank::active_weight_version() const {
  return impl_->side->active_version();
}

bool rollout_rank::joined() const {
  return impl_->side->joined;
}

}  // namespace wsync
