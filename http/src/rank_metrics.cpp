#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

#include "service_state.hpp"
#include "wsync/http/weight_transfer.hpp"
#include "wsync/runtime/rollout_executor.hpp"

namespace wsync {

void http_detail::histogram::observe(double seconds) {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < bounds.size(); ++i) {
    if (seconds <= bounds[i]) ++counts_[i];
  }
  ++count_;
  sum_ += seconds;
}

void http_detail::histogram::render(std::ostringstream& out, const std::string& name,
                                    const std::string& label) const {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < bounds.size(); ++i) {
    out << name << "_bucket{" << label << ",le=\"" << bounds[i] << "\"} " << counts_[i] << "\n";
  }
  out << name << "_bucket{" << label << ",le=\"+Inf\"} " << count_ << "\n";
  out << name << "_sum{" << label << "} " << sum_ << "\n";
  out << name << "_count{" << label << "} " << count_ << "\n";
}

void weight_transfer_service::impl::record(std::int32_t rank, const std::string& key,
                                           const rollout_report& r, std::uint64_t bytes,
                                           const std::optional<std::string>& label_text) {
  ++published;
  import_s.observe(r.timings.import);
  verify_s.observe(r.timings.verify);
  install_s.observe(r.timings.install);
  total_s.observe(r.timings.total);
  if (r.acknowledged) {
    ++committed;
    bytes_moved += bytes;
  } else {
    ++rejected;
  }
  rank_answer answer{rank, r.acknowledged ? "acknowledged" : "rejected",
                     r.failure ? r.failure->message : "", r.timings.total};
  std::lock_guard lock(status_mutex);
  if (r.acknowledged) active_model = key.substr(0, key.rfind('@'));
  if (r.acknowledged && label_text) {
    label = *label_text;
    label_for = r.weight_version;
  }
  if (r.acknowledged && r.weight_version > highest_version) {
    highest_version = r.weight_version;
    ++versions;
  }
  for (auto& slot : ranks) {
    if (slot.rank != rank) continue;
    slot.state = answer.state;
    if (r.acknowledged) slot.active = r.weight_version;
  }
  auto it = std::find_if(recent.begin(), recent.end(),
                         [&](const update_entry& e) { return e.key == key; });
  if (it == recent.end()) {
    recent.push_back({key, r.weight_version, {}});
    it = std::prev(recent.end());
  }
  // A version retried after a failed install has the same key: the rank's latest answer stands.
  auto mine = std::find_if(it->ranks.begin(), it->ranks.end(),
                           [&](const rank_answer& a) { return a.rank == rank; });
  if (mine != it->ranks.end()) {
    *mine = std::move(answer);
  } else {
    it->ranks.push_back(std::move(answer));
  }
  while (recent.size() > status_history) recent.pop_front();
}

void weight_transfer_service::record_update(std::int32_t rank, const std::string& key,
                                            const rollout_report& report, std::uint64_t bytes) {
  impl_->record(rank, key, report, bytes);
}

http_reply weight_transfer_service::status() const {
  const auto& s = *impl_;
  json updates = json::array();
  json ranks = json::array();
  bool all_ok = true;
  std::uint64_t versions = 0;
  {
    std::lock_guard lock(s.status_mutex);
    versions = s.versions;
    for (const auto& u : s.recent) {
      json answers = json::array();
      std::string reason;
      double slowest = 0;
      for (const auto& a : u.ranks) {
        answers.push_back({{"rank", a.rank},
                           {"state", a.state},
                           {"reason", a.reason},
                           {"received_from", s.coordinator.empty() ? "http" : "coordinator"}});
        if (reason.empty()) reason = a.reason;
        slowest = std::max(slowest, a.seconds);
      }
      updates.push_back({{"key", u.key},
                         {"weight_version", u.weight_version},
                         {"phase", u.phase()},
                         {"reason", reason},
                         {"commit_s", slowest},
                         {"ranks", std::move(answers)}});
    }
    for (const auto& slot : s.ranks) {
      all_ok = all_ok && slot.state != "rejected";
      ranks.push_back({{"rank", slot.rank},
                       {"node", s.config.node},
                       {"role", "consumer"},
                       {"state", slot.state},
                       {"active_weight_version", slot.active},
                       {"received_from", slot.active == 0        ? json(nullptr)
                                         : s.coordinator.empty() ? json("http")
                                                                 : json("coordinator")}});
    }
  }
  // Not under phase_mutex, which a call holds for as long as it runs (an NCCL receive: minutes).
  const std::string phase_now =
      s.coordinator.empty() ? phase_name(s.current) : "following " + s.coordinator;
  const auto active = active_version();
  return reply(200, {{"status", all_ok ? "pass" : "fail"},
                     {"versions", versions},
                     {"committed_version", active},
                     {"active_weight_version", active},
                     {"paused", s.generation.paused()},
                     {"phase", phase_now},
                     {"ranks", std::move(ranks)},
                     {"updates", std::move(updates)}});
}

std::string weight_transfer_service::metrics() const {
  const auto& s = *impl_;
  std::ostringstream out;
  auto counter = [&](const char* name, const char* help, std::uint64_t v) {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " counter\n"
        << name << " " << v << "\n";
  };
  // Every gauge here counts something: written as an integer, never in a 6-digit float form
  // (version 1234567 must not read 1.23457e+06).
  auto gauge = [&](const char* name, const char* help, std::uint64_t v) {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n"
        << name << " " << v << "\n";
  };
  counter("wsync_updates_published_total", "updates offered to this process's ranks, per rank",
          s.published.load());
  counter("wsync_updates_committed_total", "updates installed and made active", s.committed.load());
  counter("wsync_updates_rejected_total", "updates whose install failed", s.rejected.load());
  counter("wsync_bytes_moved_total", "tensor bytes of the updates installed", s.bytes_moved.load());
  gauge("wsync_active_weight_version", "lowest version a rank serves (0: none yet)",
        active_version());
  gauge("wsync_paused", "1 while generation is paused", s.generation.paused() ? 1 : 0);
  gauge("wsync_generations_in_flight", "generations running or held", s.generation.in_flight());
  gauge("wsync_generations_waiting", "generations waiting to begin (paused)",
        s.generation.waiting());
  counter("wsync_generation_steps_total", "generation steps served, each on one whole version",
          s.generation_steps.load());
  out << "# HELP wsync_generations_total generations by how they ended\n"
      << "# TYPE wsync_generations_total counter\n"
      << "wsync_generations_total{status=\"completed\"} " << s.generations_completed.load() << "\n"
      << "wsync_generations_total{status=\"aborted\"} " << s.generations_aborted.load() << "\n";
  out << "# HELP wsync_update_stage_seconds time per update stage on this rank\n"
      << "# TYPE wsync_update_stage_seconds histogram\n";
  s.import_s.render(out, "wsync_update_stage_seconds", "stage=\"import\"");
  s.verify_s.render(out, "wsync_update_stage_seconds", "stage=\"verify\"");
  s.install_s.render(out, "wsync_update_stage_seconds", "stage=\"install\"");
  s.total_s.render(out, "wsync_update_stage_seconds", "stage=\"total\"");
  std::map<std::string, int> states{{"acknowledged", 0}, {"rejected", 0}, {"joined", 0}};
  {
    std::lock_guard lock(s.status_mutex);
    for (const auto& slot : s.ranks) ++states[slot.state];
  }
  out << "# HELP wsync_ranks rollout ranks in this process by the state of their latest update\n"
      << "# TYPE wsync_ranks gauge\n";
  for (const auto& [state, n] : states)
    out << "wsync_ranks{state=\"" << state << "\"} " << n << "\n";
  return out.str();
}
}  // namespace wsync
