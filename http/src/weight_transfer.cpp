#include "wsync/http/weight_transfer.hpp"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "service_state.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/codec_json.hpp"
#include "wsync/manifest/dtype.hpp"
#include "wsync/manifest/json_bounded.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {

std::optional<json> http_detail::read_body(std::string_view body, bool empty_ok, std::string& why) {
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    if (empty_ok) return json::object();
    why = "body: a JSON object is required";
    return std::nullopt;
  }
  bool too_deep = false;
  std::string twice;
  auto j = json_parse_bounded(body, &too_deep, &twice);
  if (too_deep) {
    why = "body: nested deeper than " + std::to_string(json_max_depth) + " levels";
    return std::nullopt;
  }
  if (!twice.empty()) {  // refused, not read as its last value (another parser keeps the first)
    why = "body: \"" + twice.substr(0, 64) + "\" given twice in one object";
    return std::nullopt;
  }
  if (j.is_discarded()) {
    why = "body: invalid JSON format";
    return std::nullopt;
  }
  if (!j.is_object()) {
    why = "body: must be a JSON object";
    return std::nullopt;
  }
  return j;
}

std::optional<json> http_detail::parse_body(std::string_view body, bool empty_ok,
                                            http_reply& error) {
  std::string why;
  auto j = read_body(body, empty_ok, why);
  if (!j) error = fail(400, why);
  return j;
}

const char* http_detail::phase_name(phase p) {
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

namespace {

// init_info of vLLM's NCCL engine (it has a rendezvous), checked field by field: the refusal, or
// nullopt when it is not an NCCL init_info or one in unique-id mode that nccl_init can join.
std::optional<http_reply> nccl_init_refusal(const json& info) {
  const bool tcp = info.contains("master_address") || info.contains("master_port");
  const bool unique = info.contains("nccl_unique_id_b64");
  if (!tcp && !unique) return std::nullopt;
  if (tcp && unique) {
    return fail(400,
                "init_info: master_address/master_port and nccl_unique_id_b64 are two "
                "rendezvous modes; send one (wsync takes nccl_unique_id_b64)");
  }
  if (tcp) {
    const std::string field = info.contains("master_address") ? "master_address" : "master_port";
    return fail(400, "init_info." + field +
                         ": blocked: torch's TCP-store rendezvous "
                         "(master_address/master_port) is not supported; use NCCL unique-id mode "
                         "(init_info.nccl_unique_id_b64), or {\"transport\": \"shared-memory\"} "
                         "and wsync manifests");
  }
  const auto& id = info["nccl_unique_id_b64"];
  if (!id.is_string()) return fail(400, "init_info.nccl_unique_id_b64: must be a string");
  if (auto decoded = nccl::unique_id_from_base64(id.get<std::string>()); !decoded) {
    return fail(400, "init_info.nccl_unique_id_b64: " + decoded.error().message);
  }
  // NCCL ranks are ints; a JSON number beyond them is refused before it can wrap.
  auto rank_number = [&](const char* key) {
    const auto& v = info[key];
    if (v.is_number_unsigned()) return v.get<std::uint64_t>() < (std::uint64_t{1} << 31);
    return v.is_number_integer() && v.get<std::int64_t>() > -(std::int64_t{1} << 31);
  };
  for (const char* key : {"rank_offset", "world_size"}) {
    if (!info.contains(key)) return fail(400, std::string("init_info.") + key + ": missing");
    if (!rank_number(key)) {
      return fail(400, std::string("init_info.") + key + ": must be an integer below 2^31");
    }
  }
  const auto offset = info["rank_offset"].get<std::int64_t>();
  const auto world = info["world_size"].get<std::int64_t>();
  if (offset < 1) {
    return fail(400, "init_info.rank_offset: " + std::to_string(offset) +
                         " would put a rollout rank on rank 0, the trainer's");
  }
  if (world <= offset) {
    return fail(400, "init_info.world_size: " + std::to_string(world) +
                         " leaves no rank for this worker after rank_offset " +
                         std::to_string(offset));
  }
  nccl::packing how;
  if (auto why = read_packing(info, "init_info", how); !why.empty()) return fail(400, why);
  return std::nullopt;
}

}  // namespace

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

void weight_transfer_service::detach_ranks() {
  std::lock_guard lock(impl_->status_mutex);
  for (auto& slot : impl_->ranks) slot.runtime = nullptr;
}

void weight_transfer_service::stop_waiting() {
  {
    std::lock_guard lock(impl_->cancel_mutex);
    impl_->stopping = true;
  }
  impl_->cancel_group();
  impl_->generation.close();
}

weight_transfer_service::~weight_transfer_service() {
  if (impl_->executor) (void)impl_->executor->release_active();
}

std::uint64_t weight_transfer_service::active_version() const {
  std::lock_guard lock(impl_->status_mutex);
  return impl_->lowest_active();
}

http_reply weight_transfer_service::init(std::string_view body) {
  return naming_rank(init_answer(body), impl_->config.rank);
}

http_reply weight_transfer_service::init_answer(std::string_view body) {
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
  std::string why;
  auto options = options_field(info, "transport_options", "init_info", why);
  if (!options) return fail(400, why);
  if (auto no = nccl_init_refusal(info)) return *no;
  // A valid NCCL init supersedes the group this rank is in: a receive from it still waiting
  // (the old trainer gone, say) ends now instead of at its deadline, minutes on.
  if (info.contains("nccl_unique_id_b64")) impl_->cancel_group();
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  if (info.contains("nccl_unique_id_b64")) return s.nccl_init(info);
  if (s.nccl_mode()) {
    return fail(400, "init_info.transport: \"" + name +
                         "\" differs from NCCL mode, which this rank was initialised with");
  }
  if (auto no = s.open_transport(name, *options, "init_info.transport")) {
    return fail(no->status, no->message);
  }
  s.started_drop("init_weight_transfer_engine");
  return reply(200, {{"message", "Weight transfer initialized"}});
}

std::optional<transport_options> http_detail::options_field(const json& j, const char* key,
                                                            const std::string& where,
                                                            std::string& error) {
  transport_options out;
  if (!j.contains(key) || j[key].is_null()) return out;
  const std::string at = field(where, key);
  if (!j[key].is_object()) {
    error = at + ": must be an object of option names to values, e.g. {\"dir\": \"/shared/w\"}";
    return std::nullopt;
  }
  for (const auto& [k, v] : j[key].items()) {
    if (v.is_string()) {
      out[k] = v.get<std::string>();
    } else if (v.is_number() || v.is_boolean()) {
      out[k] = v.dump();
    } else {
      error = at + "." + k + ": must be a string or a number";
      return std::nullopt;
    }
  }
  return out;
}

std::optional<refusal> weight_transfer_service::impl::open_transport(
    const std::string& name, const transport_options& options, const std::string& where) {
  if (consumer) {
    if (name == transport && options == transport_settings) return std::nullopt;
    if (name == transport) {
      return refusal{400, where + ": options differ from those this rank was initialised with"};
    }
    return refusal{400, where + ": \"" + name + "\" differs from \"" + transport +
                            "\", which this rank was initialised with"};
  }
  if (name == "nccl") {
    // wsync's own nccl transport takes its group from a coordinator; over HTTP the trainer
    // makes the group and says so in vLLM's fields.
    return refusal{400, where +
                            ": \"nccl\" over HTTP is vLLM's NCCL mode: send "
                            "init_info.nccl_unique_id_b64, rank_offset and world_size instead"};
  }
  auto t = make_transport(name, options);
  if (!t) return refusal{400, where + ": " + t.error().message};
  auto c = (*t)->make_consumer();
  if (!c) return refusal{500, where + ": " + c.error().message};
  transport = name;
  transport_settings = options;
  consumer = std::make_unique<weight_consumer>(std::move(*c), consumer_config{config.rank, 2});
  executor = std::make_unique<rollout_executor>(*consumer, runtime, runtime.gate(),
                                                executor_config{config.verify});
  if (current == phase::uninitialized) current = phase::ready;
  log_info("rank " + std::to_string(config.rank) + ": weight transfer initialised over " + name);
  return std::nullopt;
}

http_reply weight_transfer_service::start(std::string_view body) {
  return naming_rank(start_answer(body), impl_->config.rank);
}

http_reply weight_transfer_service::start_answer(std::string_view body) {
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

// check_chunk without the update and rank.
std::string chunk_mismatch(const json& info, const std::string& where,
                           const std::vector<weight_update_manifest>& known,
                           const char* dtype_key) {
  const char* lists[] = {"names", dtype_key, "shapes"};
  std::size_t n = 0;
  bool any = false;
  for (const char* l : lists) {
    if (!info.contains(l)) continue;
    if (!info[l].is_array()) return field(where, l) + ": must be a list";
    if (any && info[l].size() != n) {
      return field(where, l) + ": has " + std::to_string(info[l].size()) + " entries, names has " +
             std::to_string(n);
    }
    n = info[l].size();
    any = true;
  }
  if (!any) return "";
  if (!info.contains("names")) {
    return field(where, "names") + ": missing (" + dtype_key + " / shapes need it)";
  }
  // Looked up by name once each: a list of every tensor of a large model, under phase_mutex.
  std::unordered_map<std::string_view, const tensor_descriptor*> by_name;
  for (const auto& m : known) {
    for (const auto& d : m.tensors) by_name[d.name] = &d;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const auto& name = info["names"][i];
    std::string at = "[" + std::to_string(i) + "]";
    if (!name.is_string()) return field(where, "names") + at + ": must be a string";
    auto found = by_name.find(name.get_ref<const std::string&>());
    const tensor_descriptor* t = found == by_name.end() ? nullptr : found->second;
    if (!t) {
      return field(where, "names") + at + ": \"" + name.get<std::string>() +
             "\" is not in the manifest";
    }
    if (info.contains(dtype_key)) {
      const auto& dn = info[dtype_key][i];
      auto dt = torch_dtype(dn);
      if (!dt) return field(where, dtype_key) + at + ": not a dtype";
      if (*dt != t->dtype) {
        return field(where, dtype_key) + at + ": " + dn.get<std::string>() +
               " differs from the manifest's " + std::string(dtype_name(t->dtype)) + " for \"" +
               t->name + "\"";
      }
    }
    if (info.contains("shapes")) {
      const auto& sh = info["shapes"][i];
      std::vector<std::int64_t> shape;
      if (!sh.is_array()) return field(where, "shapes") + at + ": must be a list of integers";
      for (const auto& d : sh) {
        if (!d.is_number_integer()) {
          return field(where, "shapes") + at + ": must be a list of integers";
        }
        shape.push_back(d.get<std::int64_t>());
      }
      if (shape != t->shape) {
        return field(where, "shapes") + at + ": differs from the manifest's shape for \"" +
               t->name + "\"";
      }
    }
  }
  return "";
}

}  // namespace

std::string http_detail::check_chunk(const json& info, const std::string& where,
                                     const std::vector<weight_update_manifest>& known,
                                     const char* dtype_key, std::int32_t rank) {
  auto why = chunk_mismatch(info, where, known, dtype_key);
  if (why.empty() || known.empty()) return why;
  return why + " (" + update_context(known.front().update_id, rank) + ")";
}

std::string weight_transfer_service::impl::accept_manifest(
    const json& mj, const std::string& at, std::vector<weight_update_manifest>& into) const {
  if (!mj.is_object() && !mj.is_string()) {
    return at + ": must be a wsync manifest (JSON object)";
  }
  // An object is read as parsed; the text of one is decoded.
  auto m = mj.is_string() ? manifest_from_json(mj.get_ref<const std::string&>())
                          : manifest_from_json_value(mj);
  // The codec names the manifest's own source_rank: this consumer rank is said too.
  if (!m) return at + ": " + m.error().message + " at consumer rank " + std::to_string(config.rank);
  // This consumer rank's words: the manifest's own source_rank is in the field named.
  const auto where = " (" + update_context(m->update_id, config.rank) + ")";
  if (m->transport != transport) {
    return at + ".transport: \"" + m->transport + "\" differs from the initialised transport \"" +
           transport + "\"" + where;
  }
  if (!into.empty() &&
      (m->model_id != into.front().model_id || m->weight_version != into.front().weight_version)) {
    return at + ".weight_version: " + update_key(m->model_id, m->weight_version) +
           " is not the update " + update_key(into.front().model_id, into.front().weight_version) +
           " the shards before it belong to" + where;
  }
  // What the install would refuse at finish, refused here while the trainer can still send
  // the right shard: finish would drop the whole update.
  std::unordered_set<std::string_view> names;
  for (const auto& other : into) {
    if (other.update_id == m->update_id) return at + ".update_id: sent twice" + where;
    if (other.source_rank == m->source_rank) {
      return at + ".source_rank: " + std::to_string(m->source_rank) +
             " sent a shard of this update already (update_id=" + other.update_id + ")" + where;
    }
    for (const auto& t : other.tensors) names.insert(t.name);
  }
  for (const auto& t : m->tensors) {
    if (names.contains(t.name)) {
      return at + ".tensors: \"" + t.name + "\" came in an earlier shard of this update" + where;
    }
  }
  if (m->weight_version <= active.load()) {
    return at + ".weight_version: weight_version must increase monotonically: " +
           std::to_string(m->weight_version) + " is not above the active " +
           std::to_string(active.load()) + where;
  }
  into.push_back(std::move(*m));
  return "";
}

http_reply weight_transfer_service::update(std::string_view body) {
  return naming_rank(update_answer(body), impl_->config.rank);
}

http_reply weight_transfer_service::update_answer(std::string_view body) {
  if (auto r = impl_->refuse_when_following("update_weights")) return *r;
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  auto no = s.update_weights(body);
  if (!no) return reply(200, {{"message", "Weights updated"}});
  return s.update_refused(*no);
}

http_reply weight_transfer_service::update_unread(int status, const std::string& why) {
  std::lock_guard lock(impl_->phase_mutex);
  auto& s = *impl_;
  if (!s.nccl_group) return naming_rank(fail(status, why + "; nothing was done"), s.config.rank);
  return naming_rank(s.update_refused({status, why}), s.config.rank);
}

http_reply weight_transfer_service::impl::update_refused(const refusal& no) {
  if (!nccl_group) return fail(no.status, no.message);
  // The trainer broadcasts while this call is in flight: a call refused before its receives
  // leaves those broadcasts to be taken by the next one, as the wrong tensors. The group goes.
  nccl_drop("update_weights was refused (" + no.message + ")");
  const auto named = no.message.find("rank=") != std::string::npos
                         ? no.message
                         : no.message + " (rank=" + std::to_string(config.rank) + ")";
  return fail(no.status, named +
                             "; the trainer's broadcasts for this call have no receiver, so the "
                             "NCCL group is aborted and the update dropped: call "
                             "/init_weight_transfer_engine again");
}

// Under phase_mutex. nullopt: the update's chunks are taken.
std::optional<refusal> weight_transfer_service::impl::update_weights(std::string_view body) {
  auto& s = *this;
  std::string bad_body;
  auto j = read_body(body, false, bad_body);
  if (!j) return refusal{400, bad_body};
  if (!j->contains("update_info")) return refusal{400, "update_info: missing in request body"};
  std::vector<const json*> infos;  // into the body: copying a manifest is not free
  const auto& given = (*j)["update_info"];
  if (given.is_object()) {
    infos.push_back(&given);
  } else if (given.is_array() && !given.empty()) {
    for (const auto& i : given) {
      if (!i.is_object()) return refusal{400, "update_info: every entry must be a JSON object"};
      infos.push_back(&i);
    }
  } else {
    return refusal{400, "update_info: must be a JSON object (or a non-empty list of them)"};
  }
  if (s.current != phase::started) {
    return refusal{409, s.not_started("update_weights")};
  }
  if (s.nccl_mode()) {
    // Every entry is checked before the first receive: what the trainer broadcasts must be
    // received whole, in order, or the broadcasts and the receives no longer line up.
    std::set<std::string> taken;
    for (const auto& m : s.shards) {
      for (const auto& t : m.tensors) taken.insert(t.name);
    }
    std::vector<impl::nccl_entry> entries(infos.size());
    for (std::size_t k = 0; k < infos.size(); ++k) {
      std::string where =
          infos.size() == 1 ? "update_info" : "update_info[" + std::to_string(k) + "]";
      if (auto why = s.nccl_check(*infos[k], where, taken, entries[k]); !why.empty()) {
        return refusal{400, why};
      }
    }
    for (auto& e : entries) {
      int status = 500;
      if (auto why = s.nccl_receive(std::move(e), status); !why.empty()) {
        return refusal{status, why};
      }
    }
    return std::nullopt;
  }
  // Check every chunk before keeping any: a refused request changes nothing.
  auto taken = s.shards;
  for (std::size_t k = 0; k < infos.size(); ++k) {
    const auto& info = *infos[k];
    std::string where =
        infos.size() == 1 ? "update_info" : "update_info[" + std::to_string(k) + "]";
    if (info.contains("manifest")) {
      if (auto why = s.accept_manifest(info["manifest"], where + ".manifest", taken);
          !why.empty()) {
        return refusal{400, why};
      }
    } else if (taken.empty()) {
      return refusal{400, where + ".manifest: missing, and no manifest of this update came before"};
    }
    if (auto why = check_chunk(info, where, taken, "dtype_names", s.config.rank); !why.empty()) {
      return refusal{400, why};
    }
  }
  s.shards = std::move(taken);
  return std::nullopt;
}

http_reply weight_transfer_service::finish(std::string_view body) {
  return naming_rank(finish_answer(body), impl_->config.rank);
}

http_reply weight_transfer_service::finish_answer(std::string_view body) {
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
    // Nothing to install; the started phase ends anyway, so a trainer that lost track can
    // start again (start refuses while an update is started).
    auto why = s.conflict("finish_weight_update",
                          "no /update_weights since /start_weight_update; the empty update is "
                          "dropped, start again");
    s.current = phase::ready;
    return fail(409, why);
  }
  const auto& first = s.shards.front();
  std::string key = update_key(first.model_id, first.weight_version);
  // NCCL mode numbers versions itself (active + 1): the trainer's weight_version is a label.
  // With manifests, a number must be theirs; any other text (vLLM's free-form "step-12") is a
  // label too.
  const bool label_only = s.nccl_mode();
  const bool number =
      version && !version->empty() &&
      std::all_of(version->begin(), version->end(), [](char c) { return c >= '0' && c <= '9'; });
  if (number && !label_only && *version != std::to_string(first.weight_version)) {
    return fail(400, "weight_version: \"" + *version + "\" differs from the manifests' " +
                         std::to_string(first.weight_version) + " (" +
                         update_context(first.update_id, s.config.rank) + ")");
  }
  const auto label = label_only || !number ? version : std::nullopt;
  auto shards = std::move(s.shards);  // `first` is gone from here on
  s.shards.clear();
  s.current = phase::ready;
  std::vector<update_id> ids;
  for (const auto& m : shards) ids.push_back(m.update_id);
  auto r = s.install(std::move(shards), label);
  if (!r.acknowledged) {
    if (label_only) s.nccl_forget(ids);  // what the executor did not import
    return fail(500, "finish_weight_update: install failed, version " +
                         std::to_string(s.active.load()) +
                         " stays active: " + (r.failure ? r.failure->message : "unknown failure"));
  }
  return reply(200, {{"message", "Weight update finished"}, {"weight_version", r.weight_version}});
}

void weight_transfer_service::impl::shards_drop() {
  std::vector<update_id> ids;
  for (const auto& m : shards) ids.push_back(m.update_id);
  nccl_forget(ids);
  shards.clear();
}

void weight_transfer_service::impl::started_drop(std::string_view call) {
  if (current != phase::started) return;
  log_warn("rank " + std::to_string(config.rank) + ": " + std::string(call) +
           " while an update was started: what it received (" + std::to_string(shards.size()) +
           " part(s)) is dropped, version " + std::to_string(active.load()) + " stays active");
  shards_drop();
  current = phase::ready;
}

rollout_report weight_transfer_service::impl::install(
    std::vector<weight_update_manifest> update, const std::optional<std::string>& label_text) {
  const std::string key = update_key(update.front().model_id, update.front().weight_version);
  auto r = executor->update_weights(update);
  std::uint64_t bytes = 0;
  for (const auto& m : update) bytes += m.total_bytes;
  if (r.acknowledged) active = r.weight_version;
  // The label with the version, under one lock: a reader never sees the new version under its
  // number and then under its label, and a relabel cannot fall between the two.
  record(config.rank, key, r, bytes, label_text);
  if (!r.acknowledged) {
    log_warn("rank " + std::to_string(config.rank) + ": update " + key +
             " rejected: " + (r.failure ? r.failure->message : "unknown failure"));
    return r;
  }
  log_info("rank " + std::to_string(config.rank) + ": active version " +
           std::to_string(r.weight_version) + " (" + key + ")");
  return r;
}

}  // namespace wsync
