// A consumer endpoint's node leadership (docs/cluster.md, "Node leaders"): as the leader, it
// carries its node's other endpoints (their updates and reports); as a member, it attaches to
// the leader and reports through it. The handlers that call these are in consumer_actor.cpp.

#include <algorithm>
#include <tuple>

#include "consumer_endpoint.hpp"
#include "tcp_probe.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::consumer_detail {

// This endpoint's own ranks.
std::vector<std::int32_t> own_ranks(const endpoint_state_ptr& st) {
  std::vector<std::int32_t> out;
  for (const auto& [rank, slot] : st->ranks) out.push_back(rank);
  return out;
}

// Stops reporting through the node's leader: the coordinator hears that the ranks are carried no
// more, and what the leader had not passed on goes to it straight (a report it did pass on
// arrives twice; the coordinator refuses the second).
void detach(endpoint_pointer self, const endpoint_state_ptr& st) {
  if (st->leader) self->demonitor(st->leader.address());
  st->leader = nullptr;
  if (st->member_epoch != 0) {
    self->send(st->coordinator, carry_atom::value,
               carry_notice{st->token, st->member_epoch, own_ranks(st), false});
  }
  st->member_epoch = 0;
  std::vector<rank_report> replay;
  for (auto& b : st->unconfirmed) {
    for (auto& r : b.reports) replay.push_back(std::move(r));
  }
  st->unconfirmed.clear();
  if (!replay.empty()) {
    self->send(st->coordinator, report_atom::value, report_batch{st->token, std::move(replay)});
  }
}

// A member endpoint is carried no more (it went away, or this endpoint stops leading): its ranks
// are owed nothing here, and the coordinator hears it unless `tell` is false.
void member_gone(endpoint_pointer self, const endpoint_state_ptr& st, const caf::actor_addr& addr,
                 bool tell) {
  auto m = st->members.find(addr);
  if (m == st->members.end()) return;
  for (auto rank : m->second.ranks) {
    st->carried.erase(rank);
    for (auto& [key, ranks] : st->owed) ranks.erase(rank);
  }
  forget_settled(*st);
  if (tell) {
    self->send(st->coordinator, carry_atom::value,
               carry_notice{st->token, st->lead_epoch, m->second.ranks, false});
  }
  self->demonitor(m->second.handle.address());
  st->unconfirmed_from.erase(addr);
  st->members.erase(m);
}

// Stops leading the node: every member is let go.
void stop_leading(endpoint_pointer self, const endpoint_state_ptr& st, bool tell) {
  if (st->lead_epoch != 0) {
    log_info(st->who + ": no longer leads its node (" + std::to_string(st->members.size()) +
             " member endpoint(s) let go)");
  }
  while (!st->members.empty()) member_gone(self, st, st->members.begin()->first, tell);
  st->lead_epoch = 0;
}

// Attaches this endpoint's ranks to its node's leader at 127.0.0.1:port for leadership `epoch`.
// Until the leader accepts (or when it cannot be reached), reports go straight to the
// coordinator, which routes nothing through the leader before the leader says it carries them.
void attach(endpoint_pointer self, const endpoint_state_ptr& st, std::uint16_t port,
            std::uint64_t epoch) {
  st->member_epoch = epoch;
  auto fail = [=](const std::string& why) {
    if (epoch != st->member_epoch) return;
    st->member_epoch = 0;
    log_warn(st->who + ": cannot attach to its node's leader at 127.0.0.1:" + std::to_string(port) +
             " (" + why + "); reporting straight to the coordinator");
  };
  connect_privately(self, st, "127.0.0.1", port,
                    [=](caf::strong_actor_ptr ptr, const std::string& why) {
                      if (epoch != st->member_epoch) return;
                      if (!ptr) return fail(why.empty() ? "nothing published there" : why);
                      auto leader = caf::actor_cast<consumer_actor>(ptr);
                      self->request(leader, std::chrono::seconds(5), attach_atom::value,
                                    attach_request{st->token, epoch, own_ranks(st)})
                          .then(
                              [=](const std::string& token, const std::string& refusal) {
                                if (epoch != st->member_epoch) return;
                                if (!token_matches(token, st->token) || !refusal.empty()) {
                                  return fail(refusal.empty() ? "wrong token" : refusal);
                                }
                                st->leader = leader;
                                self->monitor(leader);
                                log_info(st->who + ": reports through its node's leader");
                              },
                              [=](caf::error& err) { fail(self->system().render(err)); });
                    });
}

// connect_privately's helper. Its state comes as spawn arguments: CAF 0.17 dereferences an
// empty argument tuple when a function actor takes none (UBSan reports it). Detached: it probes
// the address first, blocking its own thread, so that a host that drops SYNs never reaches the
// middleman, whose blocking connect would hold every connect and publish of the process for
// about two minutes (tcp_probe.hpp).
void connect_helper(caf::event_based_actor* helper, caf::io::middleman_actor connector,
                    std::string host, std::uint16_t port, consumer_actor endpoint,
                    std::uint64_t nonce) {
  constexpr auto limit = std::chrono::seconds(5);
  if (auto why = tcp_answers(host, port, limit); !why.empty()) {
    helper->send(endpoint, connected_atom::value, nonce, caf::strong_actor_ptr(),
                 "cannot connect to " + host + ":" + std::to_string(port) + ": " + why);
    helper->quit();
    return;
  }
  helper->request(connector, limit, caf::connect_atom::value, host, port)
      .then(
          [=](const caf::node_id&, caf::strong_actor_ptr& ptr, const std::set<std::string>&) {
            helper->send(endpoint, connected_atom::value, nonce, ptr, std::string());
            helper->quit();
          },
          [=](caf::error& err) {
            helper->send(endpoint, connected_atom::value, nonce, caf::strong_actor_ptr(),
                         helper->system().render(err));
            helper->quit();
          });
}

void connect_privately(endpoint_pointer self, const endpoint_state_ptr& st, std::string host,
                       std::uint16_t port,
                       std::function<void(caf::strong_actor_ptr, const std::string&)> done) {
  const auto nonce = random_u64();
  st->connects[nonce] = std::move(done);
  self->system().spawn<caf::detached>(connect_helper, st->connector, std::move(host), port,
                                      caf::actor_cast<consumer_actor>(self), nonce);
}

// Takes a member endpoint's ranks on, for the leadership this endpoint holds: (token, refusal).
std::tuple<std::string, std::string> attach_accept(endpoint_pointer self,
                                                   const endpoint_state_ptr& st,
                                                   const attach_request& req,
                                                   const consumer_actor& handle) {
  if (st->lead_epoch == 0 || req.epoch != st->lead_epoch) {
    return {st->token, "attach refused: epoch: this endpoint does not lead its node in it"};
  }
  if (req.ranks.empty()) return {st->token, "attach refused: ranks: none given"};
  for (auto rank : req.ranks) {
    if (st->ranks.count(rank)) {
      return {st->token,
              "attach refused: ranks: rank " + std::to_string(rank) + " is this endpoint's own"};
    }
  }
  if (!handle) return {st->token, "attach refused: no sender to carry"};
  auto [m, fresh] = st->members.try_emplace(handle.address());
  m->second.handle = handle;
  for (auto rank : m->second.ranks) st->carried.erase(rank);
  m->second.ranks = req.ranks;
  for (auto rank : req.ranks) st->carried[rank] = handle.address();
  if (fresh) self->monitor(handle);
  // Before the answer: the coordinator hears it carries them before any of their reports.
  self->send(st->coordinator, carry_atom::value,
             carry_notice{st->token, st->lead_epoch, req.ranks, true});
  return {st->token, ""};
}

// Answers the attaches that waited for this endpoint's `lead`, now that it came.
void attaches_settle(endpoint_pointer self, const endpoint_state_ptr& st) {
  auto waiting = std::move(st->attaches_waiting);
  st->attaches_waiting.clear();
  for (auto& w : waiting) {
    auto [token, refusal] = attach_accept(self, st, w.request, w.handle);
    w.promise.deliver(std::move(token), std::move(refusal));
  }
}

}  // namespace wsync::consumer_detail
