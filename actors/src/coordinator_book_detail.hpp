#pragma once
// What the coordinator book's two files share: small judgements about an update and a rank's
// entry in it (coordinator_book.cpp keeps the update's course, coordinator_book_answers.cpp the
// ranks' answers and the deadlines).

#include <map>
#include <string>
#include <vector>

#include "wsync/actors/coordinator_book.hpp"

namespace wsync::book_detail {

inline std::string context(const std::string& key, std::int32_t rank) {
  return "update=" + key + " rank=" + std::to_string(rank);
}

inline bool in_flight(const update_record& u) {
  return u.phase == update_phase::assembling || u.phase == update_phase::distributing;
}

inline bool answered(rank_state s) {
  return s == rank_state::acknowledged || s == rank_state::rejected || s == rank_state::failed ||
         s == rank_state::released || s == rank_state::waiting;
}

// Whether a rank in state `s` may still read the update's memory.
inline bool holds(rank_state s) {
  return s != rank_state::released && s != rank_state::failed && s != rank_state::waiting;
}

// Whether the rank of entry `p` may still read the update's memory: by its state, or because it
// said so when it came back (may_hold). What the publishers' memory waits for.
inline bool may_read(const rank_progress& p) {
  return holds(p.state) || p.may_hold;
}

// A rank the deadline failed while it was joined (fail_silent), answering late: a catch-up of a
// committed version, or an update that finished without it (committed, or aborted because nobody
// acknowledged in time). The rank's answer stands, as it would have in time: an acknowledgement
// says it installed the version and serves it, whatever the outcome said.
inline bool late_answer(const update_record& u, const rank_progress& p) {
  return (u.phase == update_phase::committed || u.phase == update_phase::aborted) &&
         p.state == rank_state::failed && p.may_hold;
}

// The ranks that acknowledged `u` at some point: for an aborted version, those that installed it
// after the abort (late_answer).
inline std::vector<std::int32_t> acknowledging_ranks(const update_record& u) {
  std::vector<std::int32_t> out;
  for (const auto& [r, p] : u.consumers) {
    if (p.acknowledged) out.push_back(r);
  }
  return out;
}

inline std::vector<std::int32_t> publisher_ranks(const update_record& u) {
  return {u.expected_publishers.begin(), u.expected_publishers.end()};
}

inline std::vector<std::string> keys_of(const std::map<std::string, update_record>& updates) {
  std::vector<std::string> keys;
  keys.reserve(updates.size());
  for (const auto& [key, u] : updates) keys.push_back(key);
  return keys;
}

}  // namespace wsync::book_detail
