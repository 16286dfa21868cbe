#include "wsync/http/weight_transfer.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/dtype.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/runtime/generation_control.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;

http_reply reply(int status, json body) {
  return {status, body.dump()};
}
http_reply fail(int status, const std::string& message) {
  return reply(status, {{"error", message}});
}

// A JSON body, or the 400 that names what is wrong with it. An empty body is {} when allowed.
std::optional<json> parse_body(std::string_view body, bool empty_ok, http_reply& error) {
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    if (empty_ok) return json::object();
    error = fail(400, "body: a JSON object is required");
    return std::nullopt;
  }
  auto j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    error = fail(400, "body: invalid JSON format");
    return std::nullopt;
  }
  if (!j.is_object()) {
    error = fail(400, "body: must be a JSON object");
    return std::nullopt;
  }
  return j;
}

// Prometheus histogram with fixed buckets (seconds).
class histogram {
 public:
  void observe(double seconds) {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < bounds.size(); ++i) {
      if (seconds <= bounds[i]) ++counts_[i];
    }
    ++count_;
    sum_ += seconds;
  }
  void render(std::ostringstream& out, const std::string& name, const std::string& label) const {
    std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < bounds.size(); ++i) {
      out << name << "_bucket{" << label << ",le=\"" << bounds[i] << "\"} " << counts_[i] << "\n";
    }
    out << name << "_bucket{" << label << ",le=\"+Inf\"} " << count_ << "\n";
    out << name << "_sum{" << label << "} " << sum_ << "\n";
    out << name << "_count{" << label << "} " << count_ << "\n";
  }

 private:
  static constexpr std::array<double, 10> bounds = {0.0005, 0.001, 0.005, 0.01, 0.05,
                                                    0.1,    0.5,   1,     5,    30};
  mutable std::mutex mutex_;
  std::array<std::uint64_t, bounds.size()> counts_{};
  std::uint64_t count_ = 0;
  double sum_ = 0;
};

enum class phase { uninitialized, ready, started };
const char* phase_name(phase p) {
  switch (p) {
    case phase::uninitialized:
      return "uninitialized";
    case phase::ready:
      return "ready";
    case phase::started:
      return "started";
  }
  return "?";
}

// One rank's answer to one update, for /status.
struct rank_answer {
  std::int32_t rank = 0;
  std::string state;  ///< acknowledged | rejected
  std::string reason;
  double seconds = 0;
};

// One update as this process saw it: committed while every rank acknowledged it.
struct update_entry {
  std::string key;
  std::uint64_t weight_version = 0;
  std::vector<rank_answer> ranks;
  std::string phase() const {
    for (const auto& r : ranks) {
      if (r.state != "acknowledged") return "rejected";
    }
    return "committed";
  }
};

// A rank whose runtime this process serves.
struct rank_slot {
  std::int32_t rank = 0;
  reference_runtime* runtime = nullptr;
  std::uint64_t active = 0;
  std::string state = "joined";
};

constexpr std::size_t status_history = 16;

}  // namespace

struct weight_transfer_service::impl {
  impl(weight_transfer_config c, std::string coord)
      : config(std::move(c)), coordinator(std::move(coord)) {}

  weight_transfer_config config;
  std::string coordinator;    ///< non-empty: coordinator-driven, the four phases are refused
  reference_runtime runtime;  ///< standalone: the rank's own runtime
  generation_control generation;

  // The four phases; one call at a time.
  mutable std::mutex phase_mutex;
  phase current = phase::uninitialized;
  std::string transport;  ///< fixed by the first init
  std::unique_ptr<weight_consumer> consumer;
  std::unique_ptr<rollout_executor> executor;
  std::vector<weight_update_manifest> shards;  ///< received since start

  // What /status and /metrics report.
  mutable std::mutex status_mutex;
  std::vector<rank_slot> ranks;
  std::deque<update_entry> recent;
  std::atomic<std::uint64_t> active{0};  ///< standalone: the version finish switched to
  std::atomic<std::uint64_t> published{0}, committed{0}, rejected{0}, bytes_moved{0};
  std::atomic<std::uint64_t> generations_completed{0}, generations_aborted{0};
  std::uint64_t versions = 0;         ///< distinct versions made active here (status_mutex)
  std::uint64_t highest_version = 0;  ///< status_mutex
  histogram import_s, verify_s, install_s, total_s;

  std::string conflict(std::string_view call, std::string_view hint) const {
    return std::string(call) + ": out of order: the weight transfer is '" + phase_name(current) +
           "'" + (hint.empty() ? "" : " (" + std::string(hint) + ")");
  }

  // update and finish need a started phase: say which call comes first.
  std::string not_started(std::string_view call) const {
    return conflict(call, current == phase::uninitialized
                              ? "call /init_weight_transfer_engine first"
                              : "call /start_weight_update first");
  }

  std::optional<http_reply> refuse_when_following(std::string_view call) const {
    if (coordinator.empty()) return std::nullopt;
    return fail(409, std::string(call) +
                         ": out of order: this consumer follows the coordinator at " + coordinator +
                         "; updates come from it, not over HTTP");
  }

  // Counts one rank's answer to one update (metrics, per-rank state, recent updates).
  void record(std::int32_t rank, const std::string& key, const rollout_report& r,
              std::uint64_t bytes) {
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
    it->ranks.push_back(std::move(answer));
    while (recent.size() > status_history) recent.pop_front();
  }
};

weight_transfer_service::weight_transfer_service(weight_transfer_config config)
    : impl_(std::make_unique<impl>(std::move(config), "")) {
  impl_->ranks.push_back({impl_->config.rank, &impl_->runtime, 0, "joined"});
}

weight_transfer_service::weight_transfer_service(weight_transfer_config config,
                                                 std::string coordinator)
    : impl_(std::make_unique<impl>(std::move(config), std::move(coordinator))) {}

void weight_transfer_service::add_rank(std::int32_t rank, reference_runtime& runtime) {
  std::lock_guard lock(impl_->status_mutex);
  impl_->ranks.push_back({rank, &runtime, 0, "joined"});
}

void weight_transfer_service::record_update(std::int32_t rank, const std::string& key,
                                            const rollout_report& report, std::uint64_t bytes) {
  impl_->record(rank, key, report, bytes);
}

void weight_transfer_service::detach_ranks() {
  std::lock_guard lock(impl_->status_mutex);
  for (auto& slot : impl_->ranks) slot.runtime = nullptr;
}

weight_transfer_service::~weight_transfer_service() {
  if (impl_->executor) (void)impl_->executor->release_active();
}

std::uint64_t weight_transfer_service::active_version() const {
  std::lock_guard lock(impl_->status_mutex);
  std::optional<std::uint64_t> lowest;
  for (const auto& slot : impl_->ranks)
    lowest = std::min(lowest.value_or(slot.active), slot.active);
  return lowest.value_or(0);
}

http_reply weight_transfer_service::init(std::string_view body) {
  if (auto r = impl_->refuse_when_following("init_weight_transfer_engine")) return *r;
  http_reply error;
  auto j = parse_body(body, false, error);
  if (!j) return error;
  if (!j->contains("init_info")) return fail(400, "init_info: missing in request body");
  const auto& info = (*j)["init_info"];
  if (!info.is_object()) return fail(400, "init_info: must be a JSON object");
  std::string name = "shared-memory";
  if (info.contains("transport")) {
    if (!info["transport"].is_string()) return fail(400, "init_info.transport: must be a string");
    name = info["transport"].get<std::string>();
  }
  if (info.contains("master_address") || info.contains("nccl_unique_id_b64")) {
    return fail(400,
                "init_info.master_address: blocked: NCCL rendezvous is not a wsync transport "
                "here; send {\"transport\": \"shared-memory\"} and wsync manifests instead");
  }
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  if (s.current == phase::started) {
    return fail(409, s.conflict("init_weight_transfer_engine", "finish the update first"));
  }
  if (s.consumer) {
    if (name != s.transport) {
      return fail(400, "init_info.transport: \"" + name + "\" differs from \"" + s.transport +
                           "\", which this rank was initialised with");
    }
    return reply(200, {{"message", "Weight transfer initialized"}});
  }
  auto t = make_transport(name);
  if (!t) return fail(400, "init_info.transport: " + t.error().message);
  auto c = (*t)->make_consumer();
  if (!c) return fail(500, "init_info.transport: " + c.error().message);
  s.transport = name;
  s.consumer = std::make_unique<weight_consumer>(std::move(*c), consumer_config{s.config.rank, 2});
  s.executor = std::make_unique<rollout_executor>(*s.consumer, s.runtime, s.runtime.gate(),
                                                  executor_config{s.config.verify});
  s.current = phase::ready;
  log_info("rank " + std::to_string(s.config.rank) + ": weight transfer initialised over " + name);
  return reply(200, {{"message", "Weight transfer initialized"}});
}

http_reply weight_transfer_service::start(std::string_view body) {
  if (auto r = impl_->refuse_when_following("start_weight_update")) return *r;
  http_reply error;
  auto j = parse_body(body, true, error);
  if (!j) return error;
  if (j->contains("is_checkpoint_format") && !(*j)["is_checkpoint_format"].is_boolean()) {
    return fail(400, "is_checkpoint_format: must be a boolean");
  }
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  if (s.current == phase::uninitialized) {
    return fail(409, s.conflict("start_weight_update", "call /init_weight_transfer_engine first"));
  }
  if (s.current == phase::started) {
    return fail(409, s.conflict("start_weight_update",
                                "a weight update is already started; finish it first"));
  }
  s.shards.clear();
  s.current = phase::started;
  return reply(200, {{"message", "Weight update started"}});
}

namespace {

// Checks one update_info chunk against the manifest it describes; "" when it matches.
std::string check_chunk(const json& info, const std::string& where,
                        const std::vector<weight_update_manifest>& known) {
  const char* lists[] = {"names", "dtype_names", "shapes"};
  std::size_t n = 0;
  bool any = false;
  for (const char* l : lists) {
    if (!info.contains(l)) continue;
    if (!info[l].is_array()) return where + "." + l + ": must be a list";
    if (any && info[l].size() != n) {
      return where + "." + l + ": has " + std::to_string(info[l].size()) + " entries, names has " +
             std::to_string(n);
    }
    n = info[l].size();
    any = true;
  }
  if (!any) return "";
  if (!info.contains("names")) return where + ".names: missing (dtype_names / shapes need it)";
  for (std::size_t i = 0; i < n; ++i) {
    const auto& name = info["names"][i];
    std::string at = "[" + std::to_string(i) + "]";
    if (!name.is_string()) return where + ".names" + at + ": must be a string";
    const tensor_descriptor* t = nullptr;
    for (const auto& m : known) {
      for (const auto& d : m.tensors) {
        if (d.name == name.get<std::string>()) t = &d;
      }
    }
    if (!t)
      return where + ".names" + at + ": \"" + name.get<std::string>() + "\" is not in the manifest";
    if (info.contains("dtype_names")) {
      const auto& dn = info["dtype_names"][i];
      auto dt = dn.is_string() ? dtype_parse(dn.get<std::string>()) : std::nullopt;
      if (!dt) return where + ".dtype_names" + at + ": not a dtype";
      if (*dt != t->dtype) {
        return where + ".dtype_names" + at + ": " + dn.get<std::string>() +
               " differs from the manifest's " + std::string(dtype_name(t->dtype)) + " for \"" +
               t->name + "\"";
      }
    }
    if (info.contains("shapes")) {
      const auto& sh = info["shapes"][i];
      std::vector<std::int64_t> shape;
      if (!sh.is_array()) return where + ".shapes" + at + ": must be a list of integers";
      for (const auto& d : sh) {
        if (!d.is_number_integer()) return where + ".shapes" + at + ": must be a list of integers";
        shape.push_back(d.get<std::int64_t>());
      }
      if (shape != t->shape) {
        return where + ".shapes" + at + ": differs from the manifest's shape for \"" + t->name +
               "\"";
      }
    }
  }
  return "";
}

}  // namespace

http_reply weight_transfer_service::update(std::string_view body) {
  if (auto r = impl_->refuse_when_following("update_weights")) return *r;
  http_reply error;
  auto j = parse_body(body, false, error);
  if (!j) return error;
  if (!j->contains("update_info")) return fail(400, "update_info: missing in request body");
  std::vector<json> infos;
  const auto& given = (*j)["update_info"];
  if (given.is_object()) {
    infos.push_back(given);
  } else if (given.is_array() && !given.empty()) {
    for (const auto& i : given) {
      if (!i.is_object()) return fail(400, "update_info: every entry must be a JSON object");
      infos.push_back(i);
    }
  } else {
    return fail(400, "update_info: must be a JSON object (or a non-empty list of them)");
  }
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  if (s.current != phase::started) {
    return fail(409, s.not_started("update_weights"));
  }
  // Check every chunk before keeping any: a refused request changes nothing.
  auto shards = s.shards;
  for (std::size_t k = 0; k < infos.size(); ++k) {
    const auto& info = infos[k];
    std::string where =
        infos.size() == 1 ? "update_info" : "update_info[" + std::to_string(k) + "]";
    if (info.contains("manifest")) {
      const auto& mj = info["manifest"];
      if (!mj.is_object() && !mj.is_string()) {
        return fail(400, where + ".manifest: must be a wsync manifest (JSON object)");
      }
      auto m = manifest_from_json(mj.is_string() ? mj.get<std::string>() : mj.dump());
      if (!m) return fail(400, where + ".manifest: " + m.error().message);
      if (m->transport != s.transport) {
        return fail(400, where + ".manifest.transport: \"" + m->transport +
                             "\" differs from the initialised transport \"" + s.transport + "\" (" +
                             update_context(*m) + ")");
      }
      if (!shards.empty() && (m->model_id != shards.front().model_id ||
                              m->weight_version != shards.front().weight_version)) {
        return fail(400, where + ".manifest.weight_version: " +
                             update_key(m->model_id, m->weight_version) + " is not the update " +
                             update_key(shards.front().model_id, shards.front().weight_version) +
                             " this phase started with (" + update_context(*m) + ")");
      }
      for (const auto& other : shards) {
        if (other.update_id == m->update_id) {
          return fail(400, where + ".manifest.update_id: sent twice (" + update_context(*m) + ")");
        }
      }
      if (m->weight_version <= s.active.load()) {
        return fail(400, where +
                             ".manifest.weight_version: weight_version must increase "
                             "monotonically: " +
                             std::to_string(m->weight_version) + " is not above the active " +
                             std::to_string(s.active.load()) + " (" + update_context(*m) + ")");
      }
      shards.push_back(std::move(*m));
    } else if (shards.empty()) {
      return fail(400, where + ".manifest: missing, and no manifest of this update came before");
    }
    if (auto why = check_chunk(info, where, shards); !why.empty()) return fail(400, why);
  }
  s.shards = std::move(shards);
  return reply(200, {{"message", "Weights updated"}});
}

http_reply weight_transfer_service::finish(std::string_view body) {
  if (auto r = impl_->refuse_when_following("finish_weight_update")) return *r;
  http_reply error;
  auto j = parse_body(body, true, error);
  if (!j) return error;
  std::optional<std::string> version;
  if (j->contains("weight_version") && !(*j)["weight_version"].is_null()) {
    const auto& v = (*j)["weight_version"];
    if (v.is_string()) {
      version = v.get<std::string>();
    } else if (v.is_number_unsigned()) {
      version = std::to_string(v.get<std::uint64_t>());
    } else {
      return fail(400, "weight_version: must be a string, an integer or null");
    }
  }
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  if (s.current != phase::started) {
    return fail(409, s.not_started("finish_weight_update"));
  }
  if (s.shards.empty()) {
    return fail(
        409, s.conflict("finish_weight_update", "no /update_weights since /start_weight_update"));
  }
  const auto& first = s.shards.front();
  std::string key = update_key(first.model_id, first.weight_version);
  if (version && *version != std::to_string(first.weight_version)) {
    return fail(400, "weight_version: \"" + *version + "\" differs from the manifests' " +
                         std::to_string(first.weight_version) + " (" + update_context(first) + ")");
  }
  auto r = s.executor->update_weights(s.shards);
  std::uint64_t bytes = 0;
  for (const auto& m : s.shards) bytes += m.total_bytes;
  s.shards.clear();  // `first` is gone from here on
  s.current = phase::ready;
  if (r.acknowledged) s.active = r.weight_version;
  s.record(s.config.rank, key, r, bytes);
  if (!r.acknowledged) {
    std::string why = r.failure ? r.failure->message : "unknown failure";
    log_warn("rank " + std::to_string(s.config.rank) + ": update " + key + " rejected: " + why);
    return fail(500, "finish_weight_update: install failed, version " +
                         std::to_string(s.active.load()) + " stays active: " + why);
  }
  log_info("rank " + std::to_string(s.config.rank) + ": active version " +
           std::to_string(r.weight_version) + " (" + key + ")");
  return reply(200, {{"message", "Weight update finished"}, {"weight_version", r.weight_version}});
}

http_reply weight_transfer_service::pause(std::string_view mode) {
  auto m = pause_mode_parse(mode.empty() ? "abort" : mode);
  if (!m) {
    return fail(400, "mode: \"" + std::string(mode) + "\" is not one of abort, wait, keep");
  }
  impl_->generation.pause(*m);
  return reply(200, {{"status", "paused"}});
}

http_reply weight_transfer_service::resume() {
  impl_->generation.resume();
  return reply(200, {{"status", "resumed"}});
}

http_reply weight_transfer_service::is_paused() const {
  return reply(200, {{"is_paused", impl_->generation.paused()}});
}

http_reply weight_transfer_service::world_size(std::string_view include_dp) const {
  bool dp = true;
  if (include_dp == "false" || include_dp == "False" || include_dp == "0") {
    dp = false;
  } else if (!include_dp.empty() && include_dp != "true" && include_dp != "True" &&
             include_dp != "1") {
    return fail(400, "include_dp: \"" + std::string(include_dp) + "\" is not a boolean");
  }
  const auto& c = impl_->config;
  return reply(200, {{"world_size", dp ? c.world_size * c.data_parallel : c.world_size}});
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
  std::string phase_now;
  {
    std::lock_guard lock(s.phase_mutex);
    phase_now = s.coordinator.empty() ? phase_name(s.current) : "following " + s.coordinator;
  }
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
  auto gauge = [&](const char* name, const char* help, double v) {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n"
        << name << " " << v << "\n";
  };
  counter("wsync_updates_published_total", "updates offered to this process's ranks, per rank",
          s.published.load());
  counter("wsync_updates_committed_total", "updates installed and made active", s.committed.load());
  counter("wsync_updates_rejected_total", "updates whose install failed", s.rejected.load());
  counter("wsync_bytes_moved_total", "tensor bytes of the updates installed", s.bytes_moved.load());
  gauge("wsync_active_weight_version", "lowest version a rank serves (0: none yet)",
        static_cast<double>(active_version()));
  gauge("wsync_paused", "1 while generation is paused", s.generation.paused() ? 1 : 0);
  gauge("wsync_generations_in_flight", "generations running or held",
        static_cast<double>(s.generation.in_flight()));
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

http_reply weight_transfer_service::generate(std::string_view body) {
  http_reply error;
  auto j = parse_body(body, true, error);
  if (!j) return error;
  auto number = [&](const char* key, std::int64_t fallback, std::int64_t lo, std::int64_t hi,
                    std::int64_t& out) -> bool {
    out = fallback;
    if (!j->contains(key)) return true;
    const auto& v = (*j)[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi) {
      error = fail(400, std::string(key) + ": must be an integer in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "]");
      return false;
    }
    out = v.get<std::int64_t>();
    return true;
  };
  std::int64_t steps = 0, step_ms = 0, rank = -1;
  if (!number("steps", 8, 1, 100000, steps) || !number("step_ms", 5, 0, 10000, step_ms) ||
      !number("rank", -1, 0, INT32_MAX, rank)) {
    return error;
  }
  auto& s = *impl_;
  generation_scope g(s.generation);
  // The runtime stays while this generation runs: detach_ranks() comes after the actors
  // stopped, and the gateway stops before the runtimes go.
  reference_runtime* runtime = nullptr;
  {
    std::lock_guard lock(s.status_mutex);
    for (const auto& slot : s.ranks) {
      if (rank < 0 || slot.rank == rank) {
        runtime = slot.runtime;
        break;
      }
    }
  }
  if (!runtime) {
    return fail(rank < 0 ? 503 : 400,
                rank < 0 ? "generate: no rank is serving"
                         : "rank: " + std::to_string(rank) + " is not served here");
  }
  json versions = json::array();
  std::int64_t done = 0;
  for (; done < steps; ++done) {
    if (g.step() == generation_status::aborted) {
      ++s.generations_aborted;
      return reply(200, {{"status", "aborted"},
                         {"finish_reason", "abort"},
                         {"reason", "generation aborted by /pause?mode=abort"},
                         {"steps_done", done},
                         {"weight_versions", versions}});
    }
    // One step reads one complete version: the install waits for it, it waits for the install.
    auto v = runtime->generate([](const runtime_weights& w) { return w.weight_version; });
    if (versions.empty() || versions.back() != v) versions.push_back(v);
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
  }
  ++s.generations_completed;
  return reply(200, {{"status", "completed"},
                     {"finish_reason", "length"},
                     {"steps_done", done},
                     {"weight_versions", versions}});
}

}  // namespace wsync
