// The coordinator book's side of the ranks' answers (importing, acknowledged, rejected, waiting,
// released) and of the deadlines that fail ranks which stay silent.

#include "coordinator_book_detail.hpp"
#include "wsync/actors/coordinator_book.hpp"

namespace wsync {

using namespace book_detail;

result<coordinator_book::entry> coordinator_book::consumer_entry(const std::string& key,
                                                                 std::int32_t rank) {
  auto it = updates_.find(key);
  if (it == updates_.end()) {
    return make_error(errc::unknown_update, "unknown update_id: " + context(key, rank));
  }
  auto c = it->second.consumers.find(rank);
  if (c == it->second.consumers.end()) {
    return make_error(errc::invalid_argument,
                      "rank is not a consumer of this update (" + context(key, rank) + ")");
  }
  return entry{&it->second, &c->second};
}

result<std::vector<book_effect>> coordinator_book::importing(const std::string& key,
                                                             std::int32_t rank,
                                                             std::string received_from,
                                                             coord_clock::time_point now) {
  auto e = consumer_entry(key, rank);
  if (!e) return e.error();
  auto& p = *e->progress;
  if (p.state != rank_state::pending) {
    return make_error(errc::illegal_transition, "cannot import update in state " +
                                                    std::string(rank_state_name(p.state)) + " (" +
                                                    context(key, rank) + ")");
  }
  p.received_from = std::move(received_from);
  set_state(*e->update, p, rank_state::importing, now);
  return effects{};
}

result<coordinator_book::entry> coordinator_book::answering(const std::string& key,
                                                            std::int32_t rank, const char* verb) {
  auto e = consumer_entry(key, rank);
  if (!e) return e.error();
  auto& p = *e->progress;
  const bool late = late_answer(*e->update, p);
  if (p.state != rank_state::pending && p.state != rank_state::importing && !late) {
    return make_error(errc::illegal_transition,
                      std::string("cannot ") + verb + " update in state " +
                          std::string(rank_state_name(p.state)) + " (" + context(key, rank) + ")");
  }
  if (late) set_may_hold(*e->update, p, false);  // its own answer says what it holds now
  return e;
}

result<std::vector<book_effect>> coordinator_book::acknowledged(const std::string& key,
                                                                std::int32_t rank,
                                                                coord_clock::time_point now,
                                                                double data_s,
                                                                std::string received_from) {
  auto e = answering(key, rank, "acknowledge");
  if (!e) return e.error();
  auto& p = *e->progress;
  auto& u = *e->update;
  p.data_s = data_s;
  if (!received_from.empty()) p.received_from = std::move(received_from);
  set_state(u, p, rank_state::acknowledged, now);
  if (u.phase == update_phase::aborted) {
    // It installed the version after the deadline aborted it, and serves it now: the version
    // is used, as if committed, so it is never published again with other bytes (publish()).
    p.reason = "installed after the update was aborted";
    mark_used(u.model_id, u.weight_version);
  }
  effects out;
  check_finished(u, now, out);
  return out;
}

result<std::vector<book_effect>> coordinator_book::rejected(const std::string& key,
                                                            std::int32_t rank, std::string reason,
                                                            coord_clock::time_point now) {
  auto e = answering(key, rank, "reject");
  if (!e) return e.error();
  auto& p = *e->progress;
  p.reason = std::move(reason);
  set_state(*e->update, p, rank_state::rejected, now);
  effects out;
  check_finished(*e->update, now, out);
  return out;
}

result<std::vector<book_effect>> coordinator_book::waiting(const std::string& key,
                                                           std::int32_t rank, std::string reason,
                                                           coord_clock::time_point now) {
  auto e = answering(key, rank, "wait on");
  if (!e) return e.error();
  auto& p = *e->progress;
  p.reason = std::move(reason);
  set_state(*e->update, p, rank_state::waiting, now);
  effects out;
  check_finished(*e->update, now, out);
  check_released(*e->update, out);
  return out;
}

result<std::vector<book_effect>> coordinator_book::released(const std::string& key,
                                                            std::int32_t rank,
                                                            coord_clock::time_point now) {
  auto e = consumer_entry(key, rank);
  if (!e) return e.error();
  auto& u = *e->update;
  auto& p = *e->progress;
  effects out;
  if ((p.state == rank_state::failed || p.state == rank_state::released) && p.may_hold) {
    // A rank the deadline failed woke up, or one that came back holding it, let go: its
    // memory may be reused now.
    set_may_hold(u, p, false);
    check_released(u, out);
    return out;
  }
  // Waiting holds nothing already: the release the rank sends with it changes nothing here (the
  // table keeps saying why it waits).
  if (p.state == rank_state::waiting) return out;
  if (p.state == rank_state::released || p.state == rank_state::failed) {
    return make_error(errc::illegal_transition, "cannot release update in state " +
                                                    std::string(rank_state_name(p.state)) + " (" +
                                                    context(key, rank) + ")");
  }
  // Releasing before answering is a consumer that dropped the update (e.g. it was aborted).
  if (!answered(p.state)) p.reason = "released without an answer";
  set_state(u, p, rank_state::released, now);
  check_finished(u, now, out);
  check_released(u, out);
  return out;
}

void coordinator_book::fail_silent(update_record& u, std::int32_t rank, rank_progress& p,
                                   const char* reason, coord_clock::time_point now) {
  p.reason = reason;
  set_state(u, p, rank_state::failed, now);
  set_may_hold(u, p, consumers_.count(rank) > 0);  // alive: it may still read the memory
}

// A committed version's unanswered entries are catch-ups (commit waited for every other one):
// each has the update deadline from when it was sent. A rank silent past it is failed like one
// silent on an update in flight, still holding the memory while it is joined, so its entry
// stops counting as a holder once it lets go or leaves instead of never.
void coordinator_book::expire_catch_ups(update_record& u, coord_clock::time_point now,
                                        effects& out) {
  if (u.counts.unanswered == 0) return;  // the common case, checked at every tick
  bool changed = false;
  for (auto& [r, p] : u.consumers) {
    if (answered(p.state)) continue;
    auto sent = p.at.find(p.state);
    if (sent == p.at.end() || now - sent->second < config_.update_deadline) continue;
    fail_silent(u, r, p, "no answer to its catch-up before the update deadline", now);
    changed = true;
  }
  if (changed) check_released(u, out);
}

std::vector<book_effect> coordinator_book::expire(coord_clock::time_point now) {
  effects out;
  // Over the keys as they were: finishing an update may drop older ones from the history.
  for (const auto& key : keys_of(updates_)) {
    auto found = updates_.find(key);
    if (found == updates_.end()) continue;
    auto& u = found->second;
    if (u.phase == update_phase::committed) {
      expire_catch_ups(u, now, out);
      continue;
    }
    if (!in_flight(u) || now < u.deadline) continue;
    if (u.phase == update_phase::assembling) {
      std::string missing;
      for (auto r : u.expected_publishers) {
        if (!u.shards.count(r)) missing += (missing.empty() ? "" : ",") + std::to_string(r);
      }
      abort(u, "deadline passed before publisher ranks " + missing + " published", now, out);
      continue;
    }
    for (auto& [r, p] : u.consumers) {
      if (answered(p.state)) continue;
      fail_silent(u, r, p, "no answer before the update deadline", now);
    }
    check_finished(u, now, out);
  }
  return out;
}

}  // namespace wsync
