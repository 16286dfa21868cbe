#include "wsync/actors/coordinator_book.hpp"

#include <algorithm>

#include "coordinator_book_detail.hpp"

namespace wsync {

using namespace book_detail;

namespace {

// What one consumer entry adds to its update's running counts.
void tally_add(update_record::tally& t, const rank_progress& p, int sign) {
  auto add = [sign](std::size_t& n, bool yes) {
    if (yes) sign > 0 ? ++n : --n;
  };
  add(t.unanswered, !answered(p.state));
  add(t.acknowledged, p.acknowledged);
  add(t.holding, may_read(p));
}

// A new entry for `rank` in `u`'s table (replacing any older one), pending since `now`.
rank_progress& fresh_entry(update_record& u, std::int32_t rank) {
  auto [it, added] = u.consumers.try_emplace(rank);
  if (!added) tally_add(u.counts, it->second, -1);
  it->second = rank_progress{};
  tally_add(u.counts, it->second, +1);
  return it->second;
}

}  // namespace

std::string_view rank_role_name(rank_role r) {
  return r == rank_role::publisher ? "publisher" : "consumer";
}

std::string_view rank_state_name(rank_state s) {
  switch (s) {
    case rank_state::pending:
      return "pending";
    case rank_state::importing:
      return "importing";
    case rank_state::acknowledged:
      return "acknowledged";
    case rank_state::rejected:
      return "rejected";
    case rank_state::failed:
      return "failed";
    case rank_state::released:
      return "released";
    case rank_state::waiting:
      return "waiting";
  }
  return "invalid";
}

std::string_view update_phase_name(update_phase p) {
  switch (p) {
    case update_phase::assembling:
      return "assembling";
    case update_phase::distributing:
      return "distributing";
    case update_phase::committed:
      return "committed";
    case update_phase::aborted:
      return "aborted";
  }
  return "invalid";
}

void coordinator_book::set_state(update_record& u, rank_progress& p, rank_state s,
                                 coord_clock::time_point now) {
  tally_add(u.counts, p, -1);
  p.state = s;
  p.at[s] = now;
  if (s == rank_state::acknowledged) p.acknowledged = true;
  tally_add(u.counts, p, +1);
}

void coordinator_book::set_may_hold(update_record& u, rank_progress& p, bool may_hold) {
  tally_add(u.counts, p, -1);
  p.may_hold = may_hold;
  tally_add(u.counts, p, +1);
}

bool coordinator_book::counts_consistent() const {
  for (const auto& [key, u] : updates_) {
    update_record::tally walked;
    for (const auto& [r, p] : u.consumers) tally_add(walked, p, +1);
    if (walked.unanswered != u.counts.unanswered || walked.acknowledged != u.counts.acknowledged ||
        walked.holding != u.counts.holding) {
      return false;
    }
  }
  return true;
}

result<std::vector<book_effect>> coordinator_book::join(const rank_info& info,
                                                        coord_clock::time_point now) {
  if (info.model_id.empty()) {
    return make_error(errc::invalid_argument,
                      "join refused: model_id: empty (rank=" + std::to_string(info.rank) + ")");
  }
  if (info.rank < 0) {
    return make_error(errc::invalid_argument,
                      "join refused: rank: negative (" + std::to_string(info.rank) + ")");
  }
  if (info.role == rank_role::publisher && info.publisher_ranks > 0) {
    // One group of publisher ranks per model: each shard's rank inside it, and every rank with
    // the same count (the last joiner's count would win, and versions assemble from the wrong
    // number of shards).
    if (info.rank >= info.publisher_ranks) {
      return make_error(errc::invalid_argument, "join refused: rank: " + std::to_string(info.rank) +
                                                    " is not below publisher_ranks " +
                                                    std::to_string(info.publisher_ranks) +
                                                    " (model_id=" + info.model_id + ")");
    }
    for (const auto& [r, other] : publishers_) {
      if (r != info.rank && other.model_id == info.model_id && other.publisher_ranks > 0 &&
          other.publisher_ranks != info.publisher_ranks) {
        return make_error(errc::invalid_argument,
                          "join refused: publisher_ranks: " + std::to_string(info.publisher_ranks) +
                              " differs from the " + std::to_string(other.publisher_ranks) +
                              " publisher rank " + std::to_string(r) + " of model_id=" +
                              info.model_id + " declared (rank=" + std::to_string(info.rank) + ")");
      }
    }
  }
  effects out;
  auto& table = info.role == rank_role::publisher ? publishers_ : consumers_;
  // A re-join replaces the old registration: the rank restarted and holds nothing of ours.
  if (table.count(info.rank)) out = leave(info.rank, info.role, "rank re-registered", now);
  table[info.rank] = info;
  if (info.role == rank_role::publisher && info.publisher_ranks > 0) {
    publisher_ranks_[info.model_id] = info.publisher_ranks;
  }
  if (info.role == rank_role::consumer && info.active_weight_version > 0) {
    mark_used(info.model_id, info.active_weight_version);
  }
  if (info.role == rank_role::consumer) {
    // What it says it still holds, it holds again: the leave above (or the one when its link
    // went) counted it as holding nothing, and the publishers would reuse memory it reads.
    for (const auto& key : info.held) {
      auto u = updates_.find(key);
      if (u == updates_.end()) continue;
      if (u->second.adopted && u->second.weight_version == info.active_weight_version) {
        // It serves the adopted version too: in the table, as the rank that adopted it.
        set_state(u->second, fresh_entry(u->second, info.rank), rank_state::acknowledged, now);
        continue;
      }
      if (u->second.publishers_released) continue;
      auto p = u->second.consumers.find(info.rank);
      if (p == u->second.consumers.end()) continue;
      if (rejoined_mid_update(u->second, p->second, info, now, out)) continue;
      set_may_hold(u->second, p->second, true);
    }
    // Catch-up: the newest committed version, as a fresh entry in that update's table, unless
    // the rank serves it (or newer) already: it would refuse it, and show as rejected.
    auto* latest = latest_committed_mutable(info.model_id);
    if (latest && latest->weight_version > info.active_weight_version) {
      catch_up(*latest, {info.rank}, now, out);
    }
  }
  return out;
}

// The same process back while `u` still distributes, which its leave failed it in (its link
// went, then came back: a rank that restarted holds nothing, so it names no key). The entry is
// its again: importing, or acknowledged when it serves the version already (its answer went
// into the dead link, which loses it). Without this the version would commit without it, and its
// catch-up of the same version would be refused as a repeat (the rank shown as rejected).
bool coordinator_book::rejoined_mid_update(update_record& u, rank_progress& p,
                                           const rank_info& info, coord_clock::time_point now,
                                           effects& out) {
  if (u.phase != update_phase::distributing || !p.left || p.state != rank_state::failed) {
    return false;
  }
  p.left = false;
  p.reason.clear();
  set_may_hold(u, p, false);  // the state says it holds the memory
  set_state(u, p,
            info.active_weight_version >= u.weight_version ? rank_state::acknowledged
                                                           : rank_state::importing,
            now);
  check_finished(u, now, out);
  return true;
}

std::vector<book_effect> coordinator_book::leave(std::int32_t rank, rank_role role,
                                                 const std::string& reason,
                                                 coord_clock::time_point now) {
  effects out;
  auto& table = role == rank_role::publisher ? publishers_ : consumers_;
  table.erase(rank);
  // Over the keys as they were: finishing an update may drop older ones from the history.
  for (const auto& key : keys_of(updates_)) {
    auto found = updates_.find(key);
    if (found == updates_.end()) continue;
    auto& u = found->second;
    if (role == rank_role::publisher) {
      // Only a version still assembling depends on the publisher: once distributed, every
      // consumer has the manifests and the segments outlive their creator, so the version
      // goes on (undoing it would leave ranks that already switched on a version that
      // "never happened"). A consumer that can no longer open a segment rejects it.
      if (u.phase == update_phase::assembling && u.expected_publishers.count(rank)) {
        abort(u, "publisher rank " + std::to_string(rank) + " went away: " + reason, now, out);
      }
      continue;
    }
    auto it = u.consumers.find(rank);
    if (it == u.consumers.end()) continue;
    auto& p = it->second;
    set_may_hold(u, p, false);  // a rank that is gone holds nothing
    p.left = true;
    if (!answered(p.state)) {
      p.reason = reason;
      set_state(u, p, rank_state::failed, now);
    } else if (p.state == rank_state::acknowledged || p.state == rank_state::rejected) {
      set_state(u, p, rank_state::released, now);  // a rank that is gone holds nothing
    }
    check_finished(u, now, out);
    check_released(u, out);
  }
  return out;
}

result<std::vector<book_effect>> coordinator_book::adopt(
    std::int32_t rank, const std::vector<weight_update_manifest>& shards,
    coord_clock::time_point now) {
  auto who = consumers_.find(rank);
  if (who == consumers_.end() || shards.empty()) return effects{};
  const auto& info = who->second;
  const auto version = info.active_weight_version;
  const auto key = update_key(info.model_id, version);
  // Only a version above every one this book recorded: one it knew and let go of from its
  // history (an abort) must not come back as committed.
  if (version == 0 || updates_.count(key)) return effects{};
  if (auto r = recorded_version_.find(info.model_id);
      r != recorded_version_.end() && r->second >= version) {
    return effects{};
  }
  auto refuse = [&](std::size_t i, const std::string& why) {
    return make_error(errc::invalid_manifest,
                      "adoption refused: active_manifests[" + std::to_string(i) + "]." + why +
                          " (" + update_context(shards[i]) + " " + context(key, rank) + ")");
  };
  auto refuse_all = [&](const std::string& why) {
    return make_error(errc::invalid_manifest, "adoption refused: active_manifests." + why + " (" +
                                                  context(key, rank) + ")");
  };
  update_record u;
  std::set<std::string> names;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto& m = shards[i];
    if (m.model_id != info.model_id) {
      return refuse(i,
                    "model_id: \"" + m.model_id + "\" is not the rank's \"" + info.model_id + "\"");
    }
    if (m.weight_version != version) {
      return refuse(i, "weight_version: " + std::to_string(m.weight_version) +
                           " is not the rank's active " + std::to_string(version));
    }
    if (!u.shards.emplace(m.source_rank, m).second) {
      return refuse(i, "source_rank: " + std::to_string(m.source_rank) + " twice");
    }
    for (const auto& t : m.tensors) {
      if (!names.insert(t.name).second) return refuse(i, "tensors: \"" + t.name + "\" twice");
    }
  }
  if (auto n = publisher_ranks_.find(info.model_id); n != publisher_ranks_.end()) {
    for (std::int32_t r = 0; r < n->second; ++r) {
      if (!u.shards.count(r)) {
        return refuse_all("source_rank: publisher rank " + std::to_string(r) + " of " +
                          std::to_string(n->second) + " has no shard");
      }
    }
    if (u.shards.size() != static_cast<std::size_t>(n->second)) {
      return refuse_all("source_rank: " + std::to_string(u.shards.size()) + " shards for " +
                        std::to_string(n->second) + " publisher ranks");
    }
  }
  u.key = key;
  u.model_id = info.model_id;
  u.weight_version = version;
  for (const auto& [r, m] : u.shards) u.expected_publishers.insert(r);
  u.phase = update_phase::committed;
  u.created = u.deadline = now;
  u.finished = now;
  u.publishers_released = true;
  u.adopted = true;
  auto& record = updates_.emplace(key, std::move(u)).first->second;
  recorded_version_[record.model_id] = version;
  set_state(record, fresh_entry(record, rank), rank_state::acknowledged, now);
  mark_used(record.model_id, version);
  effects out;
  catch_up_joined_meanwhile(record, now, out);
  collect_garbage(record.model_id, &record);
  return out;
}

result<std::vector<book_effect>> coordinator_book::publish(const weight_update_manifest& shard,
                                                           coord_clock::time_point now) {
  const std::int32_t rank = shard.source_rank;
  const auto key = update_key(shard.model_id, shard.weight_version);
  auto refuse = [&](errc code, const std::string& why) {
    return make_error(code, why + " (" + update_context(shard) + " " + context(key, rank) + ")");
  };
  auto pub = publishers_.find(rank);
  if (pub == publishers_.end()) {
    return refuse(errc::invalid_argument,
                  "publish refused: source_rank is not a registered publisher");
  }
  if (pub->second.model_id != shard.model_id) {
    return refuse(errc::invalid_argument,
                  "publish refused: model_id differs from the rank's "
                  "registration \"" +
                      pub->second.model_id + "\"");
  }
  auto existing = updates_.find(key);
  std::uint32_t attempt = 1;
  if (existing != updates_.end() && existing->second.phase == update_phase::aborted) {
    // Ranks that installed the aborted version late serve it: other bytes under its number
    // would make two models of one version.
    if (auto served = acknowledging_ranks(existing->second); !served.empty()) {
      std::string ranks;
      for (auto r : served) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      return refuse(errc::version_not_monotonic,
                    "weight_version must increase monotonically: weight_version " +
                        std::to_string(shard.weight_version) + " was aborted, but rank" +
                        (served.size() > 1 ? "s " : " ") + ranks +
                        " installed it after the abort and serve" + (served.size() > 1 ? "" : "s") +
                        " it; publish a version above " + std::to_string(shard.weight_version));
    }
    // A retry of an aborted version: a new attempt, once nobody holds the old one (a report or
    // release of the old attempt must never land on the new one).
    if (!existing->second.publishers_released) {
      return refuse(errc::illegal_transition,
                    "publish refused: weight_version " + std::to_string(shard.weight_version) +
                        " was aborted and ranks still hold it; retry once they released it");
    }
    attempt = existing->second.attempt + 1;
    updates_.erase(existing);
    existing = updates_.end();
  }
  if (existing == updates_.end()) {
    const std::string monotonic = "weight_version must increase monotonically: weight_version " +
                                  std::to_string(shard.weight_version);
    if (auto cv = committed_version_.find(shard.model_id);
        cv != committed_version_.end() && shard.weight_version <= cv->second) {
      return refuse(errc::version_not_monotonic, monotonic + " is not above the committed " +
                                                     std::to_string(cv->second) +
                                                     " for model_id=" + shard.model_id);
    }
    for (const auto& [k, other] : updates_) {
      if (other.model_id == shard.model_id && in_flight(other) &&
          other.weight_version > shard.weight_version) {
        return refuse(errc::version_not_monotonic,
                      monotonic + " is below " + std::to_string(other.weight_version) +
                          ", which is in progress for model_id=" + shard.model_id);
      }
    }
    update_record u;
    u.attempt = attempt;
    u.key = key;
    u.model_id = shard.model_id;
    u.weight_version = shard.weight_version;
    if (auto n = publisher_ranks_.find(shard.model_id); n != publisher_ranks_.end()) {
      for (std::int32_t r = 0; r < n->second; ++r) u.expected_publishers.insert(r);
    } else {
      for (const auto& [r, info] : publishers_) {
        if (info.model_id == shard.model_id) u.expected_publishers.insert(r);
      }
    }
    // Refused before it is recorded: a record no shard may join would refuse lower versions
    // until its deadline, and its abort would send a release naming nothing.
    if (!u.expected_publishers.count(rank)) {
      return refuse(errc::invalid_argument,
                    "publish refused: source_rank is not among this version's publisher ranks");
    }
    u.created = now;
    u.deadline = now + config_.update_deadline;
    auto& recorded = recorded_version_[shard.model_id];
    recorded = std::max(recorded, shard.weight_version);
    existing = updates_.emplace(key, std::move(u)).first;
  }
  auto& u = existing->second;
  if (u.phase != update_phase::assembling) {
    return refuse(errc::version_not_monotonic,
                  "weight_version must increase monotonically: weight_version " +
                      std::to_string(shard.weight_version) + " is already " +
                      std::string(update_phase_name(u.phase)));
  }
  if (!u.expected_publishers.count(rank)) {
    return refuse(errc::invalid_argument,
                  "publish refused: source_rank is not among this version's publisher ranks");
  }
  if (u.shards.count(rank)) {
    return refuse(errc::illegal_transition,
                  "publish refused: source_rank already published "
                  "its shard of this version");
  }
  for (const auto& [r, other] : u.shards) {
    for (const auto& t : shard.tensors) {
      auto clash = std::find_if(other.tensors.begin(), other.tensors.end(),
                                [&](const tensor_descriptor& o) { return o.name == t.name; });
      if (clash != other.tensors.end()) {
        return refuse(errc::invalid_manifest, "invalid manifest: tensors: \"" + t.name +
                                                  "\" is also in the shard of publisher rank " +
                                                  std::to_string(r));
      }
    }
  }
  u.shards[rank] = shard;
  effects out;
  if (u.shards.size() == u.expected_publishers.size()) distribute(u, now, out);
  return out;
}

void coordinator_book::distribute(update_record& u, coord_clock::time_point now, effects& out) {
  u.phase = update_phase::distributing;
  // The consumers get the whole deadline to answer, however long the shards took to come (a
  // restarted trainer rank can take most of it): counted from the first shard, they could be
  // failed while they install, and a version they all installed would be aborted.
  u.deadline = now + config_.update_deadline;
  std::vector<std::int32_t> ranks;
  for (const auto& [r, info] : consumers_) {
    if (info.model_id != u.model_id) continue;
    set_state(u, fresh_entry(u, r), rank_state::pending, now);
    ranks.push_back(r);
  }
  std::vector<weight_update_manifest> shards;
  for (const auto& [r, m] : u.shards) shards.push_back(m);
  if (!ranks.empty()) {
    out.push_back({book_effect::kind::distribute, u.key, ranks, std::move(shards)});
  }
  check_finished(u, now, out);  // no consumer at all: nothing to wait for
}

namespace {
// The outcome effect of a finished update, with a copy of its record. Its shards (every
// manifest) stay out of the copy: the outcome names no tensor.
book_effect outcome_of(update_record& u) {
  auto shards = std::move(u.shards);
  auto finished = std::make_shared<const update_record>(u);
  u.shards = std::move(shards);
  book_effect e{book_effect::kind::outcome, u.key, publisher_ranks(u), {}};
  e.record = std::move(finished);
  return e;
}
}  // namespace

void coordinator_book::check_finished(update_record& u, coord_clock::time_point now, effects& out) {
  if (u.phase != update_phase::distributing) return;
  if (u.counts.unanswered > 0) return;
  // Committed: every consumer answered and someone serves it; rejected and failed ranks are
  // listed in the table, not waited on. Nobody acknowledged: the version never went live.
  if (u.counts.acknowledged > 0 || u.consumers.empty()) {
    u.phase = update_phase::committed;
    mark_used(u.model_id, u.weight_version);
  } else {
    u.phase = update_phase::aborted;
    u.reason = "no consumer acknowledged";
  }
  u.finished = now;
  out.push_back(outcome_of(u));
  if (u.phase == update_phase::committed) catch_up_joined_meanwhile(u, now, out);
  check_released(u, out);
  collect_garbage(u.model_id, &u);  // u itself stays: the caller still uses it
}

// Consumers that joined while `u` was distributing got the version committed before it (join's
// catch-up) and no entry in u's table: now that u is the newest committed version, they get it
// too, as a catch-up. Without this a rank that restarted mid-update would serve the older
// version until the next one came, and for good after a run's last version.
void coordinator_book::catch_up_joined_meanwhile(update_record& u, coord_clock::time_point now,
                                                 effects& out) {
  if (latest_committed_mutable(u.model_id) != &u) return;
  std::vector<std::int32_t> ranks;
  for (const auto& [r, info] : consumers_) {
    // An entry of an earlier process of this rank (it left, then joined again) does not count.
    auto known = u.consumers.find(r);
    if (info.model_id != u.model_id || (known != u.consumers.end() && !known->second.left) ||
        info.active_weight_version >= u.weight_version) {
      continue;
    }
    ranks.push_back(r);
  }
  if (!ranks.empty()) catch_up(u, std::move(ranks), now, out);
}

void coordinator_book::catch_up(update_record& u, std::vector<std::int32_t> ranks,
                                coord_clock::time_point now, effects& out) {
  for (auto r : ranks) set_state(u, fresh_entry(u, r), rank_state::pending, now);
  if (!u.adopted) u.publishers_released = false;  // an adopted one's memory is the orphan's
  std::vector<weight_update_manifest> shards;
  for (const auto& [r, m] : u.shards) shards.push_back(m);
  out.push_back({book_effect::kind::distribute, u.key, std::move(ranks), std::move(shards), true});
}

void coordinator_book::abort(update_record& u, const std::string& reason,
                             coord_clock::time_point now, effects& out) {
  u.phase = update_phase::aborted;
  u.reason = reason;
  u.finished = now;
  std::vector<std::int32_t> holders;
  for (auto& [r, p] : u.consumers) {
    if (!answered(p.state) || p.state == rank_state::acknowledged ||
        p.state == rank_state::rejected) {
      holders.push_back(r);
    }
    if (!answered(p.state)) {
      p.reason = reason;
      set_state(u, p, rank_state::failed, now);
    }
  }
  if (!holders.empty()) out.push_back({book_effect::kind::drop, u.key, holders, {}});
  out.push_back(outcome_of(u));
  check_released(u, out);  // nobody got it (aborted while assembling): publishers let go now
  collect_garbage(u.model_id, &u);  // versions that only ever abort must not pile up either
}

bool coordinator_book::retry_must_wait(const weight_update_manifest& shard) const {
  auto it = updates_.find(update_key(shard.model_id, shard.weight_version));
  // Not one that a rank serves: publish() refuses it at once, however long it waited.
  return it != updates_.end() && it->second.phase == update_phase::aborted &&
         !it->second.publishers_released && it->second.counts.acknowledged == 0;
}

void coordinator_book::check_released(update_record& u, effects& out) {
  if (u.publishers_released || in_flight(u) || u.counts.holding > 0) return;
  u.publishers_released = true;
  book_effect e{book_effect::kind::release_publisher, u.key, publisher_ranks(u), {}};
  for (const auto& [r, m] : u.shards) e.update_ids.push_back(m.update_id);
  out.push_back(std::move(e));
}

void coordinator_book::collect_garbage(const std::string& model_id, const update_record* keep) {
  // Keep the newest finished updates; never drop one a consumer still holds, the latest
  // committed (catch-up source) or `keep` (a later finish drops it).
  auto list = updates(model_id);
  const auto* latest = latest_committed(model_id);
  std::size_t finished = 0;
  for (const auto* u : list) finished += !in_flight(*u);
  for (const auto* u : list) {
    if (finished <= config_.history_per_model) break;
    // An adopted record's publishers never count as released here: it goes once nobody holds it.
    if (in_flight(*u) || u == latest || u == keep || !u->publishers_released ||
        (u->adopted && u->counts.holding > 0)) {
      continue;
    }
    updates_.erase(u->key);
    --finished;
  }
}

const update_record* coordinator_book::find(const std::string& key) const {
  auto it = updates_.find(key);
  return it == updates_.end() ? nullptr : &it->second;
}

std::uint64_t coordinator_book::used_version(const std::string& model_id) const {
  auto it = committed_version_.find(model_id);
  return it == committed_version_.end() ? 0 : it->second;
}

std::vector<std::int32_t> coordinator_book::holders(const std::string& key) const {
  std::vector<std::int32_t> out;
  if (const auto* u = find(key)) {
    for (const auto& [r, p] : u->consumers) {
      if (may_read(p)) out.push_back(r);
    }
  }
  return out;
}

const update_record* coordinator_book::latest_committed(const std::string& model_id) const {
  return const_cast<coordinator_book*>(this)->latest_committed_mutable(model_id);
}

update_record* coordinator_book::latest_committed_mutable(const std::string& model_id) {
  update_record* best = nullptr;
  for (auto& [key, u] : updates_) {
    if (u.model_id == model_id && u.phase == update_phase::committed &&
        (!best || u.weight_version > best->weight_version)) {
      best = &u;
    }
  }
  return best;
}

std::vector<std::int32_t> coordinator_book::consumers_of(const std::string& model_id,
                                                         const std::string& transport) const {
  std::vector<std::int32_t> out;
  for (const auto& [rank, info] : consumers_) {
    if (info.model_id == model_id && std::find(info.transports.begin(), info.transports.end(),
                                               transport) != info.transports.end()) {
      out.push_back(rank);
    }
  }
  return out;
}

std::vector<const update_record*> coordinator_book::updates(const std::string& model_id) const {
  std::vector<const update_record*> out;
  for (const auto& [key, u] : updates_) {
    if (u.model_id == model_id) out.push_back(&u);
  }
  std::sort(out.begin(), out.end(),
            [](const auto* a, const auto* b) { return a->weight_version < b->weight_version; });
  return out;
}

}  // namespace wsync
