// The weight version as trainers read and set it, and the weight checker: per-tensor SHA-256 of
// the weights a rank serves, so a trainer can prove the rollout holds exactly its weights
// (docs/http.md#weight-version-and-weight-checker).

#include <openssl/evp.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "service_state.hpp"
#include "wsync/http/weight_transfer.hpp"
#include "wsync/runtime/generation_control.hpp"

namespace wsync {
namespace {

using checksums = std::map<std::string, std::string>;

std::string sha256_hex(const std::byte* data, std::size_t n) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, n, digest, &len, EVP_sha256(), nullptr);
  static constexpr char hex[] = "0123456789abcdef";
  std::string out(2 * len, '0');
  for (unsigned i = 0; i < len; ++i) {
    out[2 * i] = hex[digest[i] >> 4];
    out[2 * i + 1] = hex[digest[i] & 0xf];
  }
  return out;
}

bool is_sha256_hex(const std::string& s) {
  return s.size() == 64 &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isxdigit(c) != 0; });
}

}  // namespace

std::string weight_transfer_service::impl::version_label() const {
  std::lock_guard lock(status_mutex);
  const std::uint64_t v = lowest_active();
  return !label.empty() && label_for == v ? label : std::to_string(v);
}

http_reply weight_transfer_service::weight_info() const {
  return reply(200, {{"weight_version", impl_->version_label()}});
}

http_reply weight_transfer_service::update_weight_version(std::string_view body) {
  http_reply error;
  auto j = parse_body(body, false, error);
  if (!j) return error;
  if (!j->contains("new_version")) return fail(400, "new_version: missing in request body");
  const auto& v = (*j)["new_version"];
  if (!v.is_string() || v.get<std::string>().empty()) {
    return fail(400, "new_version: must be a non-empty string");
  }
  bool abort_all = false;
  if (j->contains("abort_all_requests") && !(*j)["abort_all_requests"].is_null()) {
    if (!(*j)["abort_all_requests"].is_boolean()) {
      return fail(400, "abort_all_requests: must be a boolean");
    }
    abort_all = (*j)["abort_all_requests"].get<bool>();
  }
  auto& s = *impl_;
  std::uint64_t active = 0;
  {
    // Generations begun on the old label end, paused or not, and none begins until the new
    // label is set: the hold lasts until then.
    abort_hold ended(s.generation, abort_all);
    std::lock_guard lock(s.status_mutex);  // the label names the version active at this moment
    active = s.lowest_active();
    s.label = v.get<std::string>();
    s.label_for = active;
  }
  return reply(200, {{"success", true},
                     {"message", "weight version of the active weights (" + std::to_string(active) +
                                     ") is now \"" + v.get<std::string>() + "\""},
                     {"weight_version", v.get<std::string>()}});
}

http_reply weight_transfer_service::weight_checker(std::string_view body) {
  http_reply error;
  auto j = parse_body(body, false, error);
  if (!j) return error;
  if (!j->contains("action")) return fail(400, "action: missing in request body");
  const auto& a = (*j)["action"];
  const std::string action = a.is_string() ? a.get<std::string>() : "";
  if (action != "checksum" && action != "reset" && action != "compare") {
    return fail(400, "action: " + a.dump() + " is not one of checksum, reset, compare");
  }
  auto& s = *impl_;
  if (action == "reset") {
    std::lock_guard lock(s.status_mutex);
    s.checker_baseline.reset();
    return reply(200, {{"status", "reset"}});
  }
  std::optional<checksums> baseline;
  if (j->contains("baseline") && !(*j)["baseline"].is_null()) {
    const auto& b = (*j)["baseline"];
    if (!b.is_object()) return fail(400, "baseline: must be an object {name: sha256 hex}");
    baseline.emplace();
    for (const auto& [name, value] : b.items()) {
      std::string hex = value.is_string() ? value.get<std::string>() : "";
      if (!is_sha256_hex(hex)) {
        return fail(400, "baseline." + name + ": must be a SHA-256 digest (64 hex digits)");
      }
      std::transform(hex.begin(), hex.end(), hex.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      (*baseline)[name] = std::move(hex);
    }
  }
  std::int64_t rank = -1;
  if (j->contains("rank")) {
    const auto& r = (*j)["rank"];
    if (!r.is_number_integer() || r.get<std::int64_t>() < 0 || r.get<std::int64_t>() > INT32_MAX) {
      return fail(400, "rank: must be an integer in [0, " + std::to_string(INT32_MAX) + "]");
    }
    rank = r.get<std::int64_t>();
  }

  // Hash what readers see, under the shared side of the generation gate: one whole version,
  // never a switch half-way through (an install waits until the hashing is done).
  reference_runtime* runtime = nullptr;
  std::int32_t served = 0;
  {
    std::lock_guard lock(s.status_mutex);
    if (const auto* slot = s.slot_of(rank)) runtime = slot->runtime, served = slot->rank;
    if (action == "compare" && !baseline) baseline = s.checker_baseline;
  }
  if (!runtime) {
    return fail(rank < 0 ? 503 : 400,
                rank < 0 ? "weight_checker: no rank is serving"
                         : "rank: " + std::to_string(rank) + " is not served here");
  }
  if (action == "compare" && !baseline) {
    return fail(400,
                "baseline: missing, and no checksum was taken on this rank since the last reset");
  }
  std::uint64_t version = 0;
  checksums now = runtime->generate([&](const runtime_weights& w) {
    version = w.weight_version;
    checksums out;
    for (const auto& t : w.tensors) out[t.name] = sha256_hex(t.data, t.nbytes);
    return out;
  });

  if (action == "checksum") {
    {
      std::lock_guard lock(s.status_mutex);
      s.checker_baseline = now;
    }
    return reply(200, {{"checksums", now}, {"weight_version", version}, {"rank", served}});
  }
  std::set<std::string> names;
  for (const auto& [name, _] : now) names.insert(name);
  for (const auto& [name, _] : *baseline) names.insert(name);
  json mismatches = json::array();
  for (const auto& name : names) {
    auto have = now.find(name);
    auto want = baseline->find(name);
    if (have != now.end() && want != baseline->end() && have->second == want->second) continue;
    mismatches.push_back(
        {{"name", name},
         {"expected", want == baseline->end() ? json(nullptr) : json(want->second)},
         {"actual", have == now.end() ? json(nullptr) : json(have->second)}});
  }
  return reply(200, {{"match", mismatches.empty()},
                     {"mismatches", mismatches},
                     {"compared", names.size()},
                     {"weight_version", version},
                     {"rank", served}});
}

}  // namespace wsync
