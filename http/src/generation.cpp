#include <algorithm>
#include <cctype>
#include <chrono>
#include <climits>
#include <optional>
#include <string>
#include <thread>

#include "service_state.hpp"
#include "wsync/http/weight_transfer.hpp"
#include "wsync/runtime/generation_control.hpp"
#include "wsync/runtime/reference_runtime.hpp"

namespace wsync {

http_reply weight_transfer_service::pause(std::string_view mode) {
  auto m = pause_mode_parse(mode);  // "mode=" given empty is refused, as vLLM's enum does
  if (!m) {
    return fail(400, "mode: \"" + std::string(mode) + "\" is not one of abort, wait, keep");
  }
  if (!impl_->generation.pause(*m)) return fail(409, resumed_first);
  return reply(200, {{"status", "paused"}});
}

http_reply weight_transfer_service::resume() {
  impl_->generation.resume();
  return reply(200, {{"status", "resumed"}});
}

http_reply weight_transfer_service::is_paused() const {
  return reply(200, {{"is_paused", impl_->generation.paused()}});
}

std::optional<bool> query_flag(std::string_view text) {
  std::string t(text);
  std::transform(t.begin(), t.end(), t.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // Pydantic's spellings, which vLLM's FastAPI server reads them with.
  if (t == "true" || t == "1" || t == "yes" || t == "on" || t == "t" || t == "y") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off" || t == "f" || t == "n") return false;
  return std::nullopt;
}

http_reply weight_transfer_service::world_size(std::string_view include_dp) const {
  const auto dp = query_flag(include_dp);  // "include_dp=" given empty is not a boolean
  if (!dp) return fail(400, "include_dp: \"" + std::string(include_dp) + "\" is not a boolean");
  const auto& c = impl_->config;
  // In 64 bits: each may be up to 2^20 (the CLI's bound), their product is not an int32.
  const std::int64_t all = std::int64_t{c.world_size} * c.data_parallel;
  return reply(200, {{"world_size", *dp ? all : std::int64_t{c.world_size}}});
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
  // Found before the generation begins, which blocks while paused: a rank that is not served
  // is told so at once. The runtime stays while this generation runs: detach_ranks() comes
  // after the actors stopped, and the gateway stops before the runtimes go.
  reference_runtime* runtime = nullptr;
  {
    std::lock_guard lock(s.status_mutex);
    if (const auto* slot = s.slot_of(rank)) runtime = slot->runtime;
  }
  if (!runtime) {
    return fail(rank < 0 ? 503 : 400,
                rank < 0 ? "generate: no rank is serving"
                         : "rank: " + std::to_string(rank) + " is not served here");
  }
  generation_scope g(s.generation);
  json versions = json::array();
  std::int64_t done = 0;
  for (; done < steps; ++done) {
    if (g.step() == generation_status::aborted) {
      ++s.generations_aborted;
      return reply(200, {{"status", "aborted"},
                         {"finish_reason", "abort"},
                         {"reason",
                          "generation aborted (a pause in abort mode, or an update "
                          "with abort_all_requests)"},
                         {"steps_done", done},
                         {"weight_versions", versions}});
    }
    // One step reads one complete version: the install waits for it, it waits for the install.
    auto v = runtime->generate([](const runtime_weights& w) { return w.weight_version; });
    ++s.generation_steps;
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
