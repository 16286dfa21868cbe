// SGLang's weight-update routes over the same state as vLLM's (docs/http.md#sglang). SGLang
// trainers send flat JSON bodies and read {"success": bool, "message": str}: 200 when it worked,
// 400 for anything else, including a failed install. The update itself is a wsync manifest;
// SGLang's NCCL rendezvous is refused, as on vLLM's surface.

#include <optional>
#include <string>
#include <vector>

#include "service_state.hpp"
#include "wsync/http/weight_transfer.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/runtime/generation_control.hpp"

namespace wsync {
namespace {

constexpr const char* default_group = "weight_update_group";

http_reply success(const std::string& message) {
  return reply(200, {{"success", true}, {"message", message}});
}
http_reply failure(const std::string& message) {
  return reply(400, {{"success", false}, {"message", message}});
}

// The body as a JSON object, or the SGLang-shaped 400 naming what is wrong with it.
std::optional<json> sglang_body(std::string_view body, bool empty_ok, http_reply& error) {
  std::string why;
  auto j = read_body(body, empty_ok, why);
  if (!j) error = failure(why);
  return j;
}

// Optional typed fields: false (and `error` set) when present with the wrong type.
bool optional_bool(const json& j, const char* key, bool fallback, bool& out, http_reply& error) {
  out = fallback;
  if (!j.contains(key) || j[key].is_null()) return true;
  if (!j[key].is_boolean()) {
    error = failure(std::string(key) + ": must be a boolean");
    return false;
  }
  out = j[key].get<bool>();
  return true;
}

bool optional_string(const json& j, const char* key, std::optional<std::string>& out,
                     http_reply& error) {
  if (!j.contains(key) || j[key].is_null()) return true;
  if (j[key].is_string()) {
    out = j[key].get<std::string>();
  } else if (j[key].is_number_integer()) {
    out = j[key].dump();
  } else {
    error = failure(std::string(key) + ": must be a string or null");
    return false;
  }
  return true;
}

}  // namespace

http_reply weight_transfer_service::sglang_init_group(std::string_view body) {
  if (auto why = impl_->following("init_weights_update_group")) return failure(*why);
  http_reply error;
  auto j = sglang_body(body, false, error);
  if (!j) return error;
  std::optional<std::string> group, backend;
  if (!optional_string(*j, "group_name", group, error) ||
      !optional_string(*j, "backend", backend, error)) {
    return error;
  }
  for (const char* key : {"master_address", "master_port"}) {
    if (j->contains(key) && !(*j)[key].is_null()) {
      return failure(std::string(key) +
                     ": blocked: NCCL group rendezvous is not a wsync transport here; send "
                     "{\"backend\": \"shared-memory\"} (or another wsync transport) and wsync "
                     "manifests instead");
    }
  }
  std::string why;
  auto options = options_field(*j, "transport_options", "", why);
  if (!options) return failure(why);
  const std::string name = backend.value_or("nccl");
  if (name == "nccl") {
    return failure(
        "backend: blocked: \"nccl\" (SGLang's default) needs a process group wsync does not "
        "join; name a wsync transport, e.g. {\"backend\": \"shared-memory\"}");
  }
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  const std::string g = group.value_or(default_group);
  if (!s.sglang_group.empty() && s.sglang_group != g) {
    return failure("group_name: \"" + g + "\" differs from the group \"" + s.sglang_group +
                   "\" this rank has; destroy it first");
  }
  if (auto no = s.open_transport(name, *options, "backend")) return failure(no->message);
  s.sglang_group = g;
  return success("weight update group \"" + g + "\" initialised over " + name);
}

http_reply weight_transfer_service::sglang_destroy_group(std::string_view body) {
  if (auto why = impl_->following("destroy_weights_update_group")) return failure(*why);
  http_reply error;
  auto j = sglang_body(body, true, error);
  if (!j) return error;
  std::optional<std::string> group;
  if (!optional_string(*j, "group_name", group, error)) return error;
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  const std::string g = group.value_or(default_group);
  if (s.sglang_group != g) {
    return failure("group_name: no weight update group \"" + g + "\" here" +
                   (s.sglang_group.empty() ? "" : " (there is \"" + s.sglang_group + "\")"));
  }
  // The transport's consumer stays: the active weights may be views into what it imported.
  s.sglang_group.clear();
  return success("weight update group \"" + g + "\" destroyed; the active weights stay");
}

http_reply weight_transfer_service::sglang_update(std::string_view body) {
  return naming_rank(sglang_update_answer(body), impl_->config.rank);
}

http_reply weight_transfer_service::sglang_update_answer(std::string_view body) {
  if (auto why = impl_->following("update_weights_from_distributed")) return failure(*why);
  http_reply error;
  auto j = sglang_body(body, false, error);
  if (!j) return error;
  std::optional<std::string> group, label, load_format;
  bool flush_cache = true, abort_all = false;
  if (!optional_string(*j, "group_name", group, error) ||
      !optional_string(*j, "weight_version", label, error) ||
      !optional_string(*j, "load_format", load_format, error) ||
      !optional_bool(*j, "flush_cache", true, flush_cache, error) ||
      !optional_bool(*j, "abort_all_requests", false, abort_all, error)) {
    return error;
  }
  if (load_format) {
    return failure("load_format: \"" + *load_format +
                   "\" is not supported: the tensors' layout comes from the wsync manifest");
  }
  if (!j->contains("manifest")) {
    return failure(
        "manifest: missing: wsync updates carry the publisher's manifest (or a list "
        "of them, one per shard) beside names, dtypes and shapes");
  }
  std::vector<json> given;
  if ((*j)["manifest"].is_array()) {
    if ((*j)["manifest"].empty()) return failure("manifest: an empty list");
    for (const auto& m : (*j)["manifest"]) given.push_back(m);
  } else {
    given.push_back((*j)["manifest"]);
  }
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  const std::string g = group.value_or(default_group);
  if (s.sglang_group != g) {
    return failure("group_name: no weight update group \"" + g + "\" here" +
                   (s.sglang_group.empty() ? "; call /init_weights_update_group first"
                                           : " (there is \"" + s.sglang_group + "\")"));
  }
  if (s.current == phase::started) {
    return failure(
        "update_weights_from_distributed: out of order: a vLLM-style weight update is started "
        "on this rank; finish it first");
  }
  std::vector<weight_update_manifest> shards;
  for (std::size_t k = 0; k < given.size(); ++k) {
    std::string at = given.size() == 1 ? "manifest" : "manifest[" + std::to_string(k) + "]";
    if (auto why = s.accept_manifest(given[k], at, shards); !why.empty()) return failure(why);
  }
  if (auto why = check_chunk(*j, "", shards, "dtypes", s.config.rank); !why.empty()) {
    return failure(why);
  }
  // abort_all_requests: every generation in flight or waiting ends before the switch, and none
  // begins until it is done; a pause the trainer makes, before or meanwhile, stays.
  rollout_report r;
  {
    abort_hold held(s.generation, abort_all);
    r = s.install(std::move(shards), label);
  }
  (void)flush_cache;  // the reference runtime keeps no KV cache: nothing to flush
  if (!r.acknowledged) {
    return failure("update_weights_from_distributed: install failed, version " +
                   std::to_string(s.active.load()) +
                   " stays active: " + (r.failure ? r.failure->message : "unknown failure"));
  }
  return success("weights updated to version " + std::to_string(r.weight_version) +
                 (label ? " (weight_version \"" + *label + "\")" : ""));
}

http_reply weight_transfer_service::sglang_pause(std::string_view body) {
  http_reply error;
  auto j = sglang_body(body, true, error);
  if (!j) return error;
  std::optional<std::string> mode;
  if (!optional_string(*j, "mode", mode, error)) return error;
  const std::string m = mode.value_or("abort");
  // SGLang's modes on wsync's: abort ends in-flight generations; retract and in_place both keep
  // them to go on after /continue_generation (the reference runtime holds no KV cache, so
  // retracting a request's cache and keeping it in place differ only in memory).
  pause_mode mapped = pause_mode::abort;
  if (m == "retract" || m == "in_place") {
    mapped = pause_mode::keep;
  } else if (m != "abort") {
    return failure("mode: \"" + m + "\" is not one of abort, retract, in_place");
  }
  // SGLang's routes answer 200 or 400, nothing else (docs/http.md).
  if (!impl_->generation.pause(mapped)) return failure(resumed_first);
  return reply(200, {{"message", "generation paused (mode " + m + ", wsync's " +
                                     pause_mode_name(mapped) + ")"},
                     {"status", "ok"}});
}

http_reply weight_transfer_service::sglang_continue(std::string_view body) {
  http_reply error;
  if (!sglang_body(body, true, error)) return error;
  impl_->generation.resume();
  return reply(200, {{"message", "generation continued"}, {"status", "ok"}});
}

http_reply weight_transfer_service::sglang_model_info() const {
  std::string model;
  {
    std::lock_guard lock(impl_->status_mutex);
    model = impl_->active_model;
  }
  return reply(200, {{"model_path", model.empty() ? json(nullptr) : json(model)},
                     {"is_generation", true},
                     {"weight_version", impl_->version_label()}});
}

}  // namespace wsync
