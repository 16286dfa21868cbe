// vLLM's NCCL mode on the weight-transfer surface (docs/http.md#nccl): /init_weight_transfer_engine
// with init_info.nccl_unique_id_b64 joins the trainer's group, each /update_weights receives the
// tensors its update_info names (the trainer broadcasts them meanwhile), and
// /finish_weight_update installs what was received like any wsync update: each /update_weights
// becomes one manifest whose segment is the received memory, verified and switched atomically
// by the rollout executor.

#include <map>
#include <mutex>
#include <set>

#include "service_state.hpp"
#include "wsync/manifest/dtype.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/manifest/validate.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {

// The consumer half of NCCL mode: the segments receive_tensors filled, by update id, until the
// executor releases them.
class received_segments final : public consumer_transport {
 public:
  explicit received_segments(memory_location where) : where_(where) {}

  memory_location memory() const override { return where_; }

  void add(const update_id& id, nccl::block segment) {
    std::lock_guard lock(mutex_);
    blocks_[id] = std::move(segment);
  }

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& manifest) override {
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(manifest.update_id);
    if (it == blocks_.end()) {
      return make_error(errc::unknown_update, "unknown update_id: " + manifest.update_id +
                                                  ": nothing was received for this update (" +
                                                  update_context(manifest) + ")");
    }
    return std::vector<std::span<const std::byte>>{{it->second.data, it->second.nbytes}};
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    blocks_.erase(id);
  }

 private:
  memory_location where_;
  std::mutex mutex_;
  std::map<update_id, nccl::block> blocks_;
};

namespace {

constexpr std::uint64_t max_update_bytes = std::uint64_t{1} << 42;  // manifest_limits' 4 TiB

// The tensors an update_info names (names / dtype_names / shapes, each required, of one
// length), in names order. "" or the first problem, naming its field.
std::string read_specs(const json& info, const std::string& where,
                       std::vector<nccl::tensor_spec>& out) {
  for (const char* key : {"names", "dtype_names", "shapes"}) {
    if (!info.contains(key)) {
      return field(where, key) +
             ": missing (NCCL mode receives the tensors names, dtype_names and shapes list)";
    }
    if (!info[key].is_array()) return field(where, key) + ": must be a list";
    if (info[key].size() != info["names"].size()) {
      return field(where, key) + ": has " + std::to_string(info[key].size()) +
             " entries, names has " + std::to_string(info["names"].size());
    }
  }
  if (info["names"].empty()) return field(where, "names") + ": empty; name at least one tensor";
  std::set<std::string> seen;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < info["names"].size(); ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    nccl::tensor_spec spec;
    const auto& name = info["names"][i];
    if (!name.is_string()) return field(where, "names") + at + ": must be a string";
    spec.name = name.get<std::string>();
    if (!seen.insert(spec.name).second) {
      return field(where, "names") + at + ": \"" + spec.name + "\" is named twice";
    }
    const auto& dn = info["dtype_names"][i];
    auto dt = torch_dtype(dn);
    if (!dt) {
      return field(where, "dtype_names") + at + ": " + dn.dump() +
             " is not a dtype wsync knows (torch names: float32, bfloat16, float16, "
             "float8_e4m3fn, int64, uint8, bool, ...)";
    }
    spec.dtype = *dt;
    const auto& sh = info["shapes"][i];
    if (!sh.is_array()) return field(where, "shapes") + at + ": must be a list of integers";
    std::uint64_t elements = 1;
    for (const auto& d : sh) {
      if (!d.is_number_unsigned()) {
        return field(where, "shapes") + at + ": must be a list of non-negative integers";
      }
      const auto n = d.get<std::uint64_t>();
      if (n != 0 && elements > max_update_bytes / n) {
        return field(where, "shapes") + at + ": too many elements";
      }
      elements *= n;
      spec.shape.push_back(static_cast<std::int64_t>(n));
    }
    if (elements > max_update_bytes / dtype_itemsize(spec.dtype)) {
      return field(where, "shapes") + at + ": too many bytes";
    }
    spec.nbytes = elements * dtype_itemsize(spec.dtype);
    total += spec.nbytes;
    if (total > max_update_bytes) return field(where, "shapes") + ": the update exceeds 4 TiB";
    out.push_back(std::move(spec));
  }
  return "";
}

}  // namespace

// vLLM's packing fields, in init_info (newest) or update_info (older versions), over `how`.
std::string http_detail::read_packing(const json& info, const std::string& where,
                                      nccl::packing& how) {
  if (info.contains("packed")) {
    if (!info["packed"].is_boolean()) return field(where, "packed") + ": must be a boolean";
    how.packed = info["packed"].get<bool>();
  }
  for (const char* key : {"packed_buffer_size_bytes", "packed_num_buffers"}) {
    if (!info.contains(key)) continue;
    const auto& v = info[key];
    if (!v.is_number_unsigned() || v.get<std::uint64_t>() == 0) {
      return field(where, key) + ": must be a positive integer";
    }
    const auto n = v.get<std::uint64_t>();
    if (std::string(key) == "packed_buffer_size_bytes") {
      how.buffer_bytes = n;
    } else {
      if (n > 64) return field(where, key) + ": " + std::to_string(n) + " is above 64";
      how.buffers = static_cast<unsigned>(n);
    }
  }
  return "";
}

http_reply weight_transfer_service::impl::nccl_init(const json& info) {
  // One rank joins per server; a trainer that sizes its group by /get_world_size would wait
  // for ranks that never come.
  if (const auto served = std::int64_t{config.world_size} * config.data_parallel; served != 1) {
    return fail(400,
                "init_info.nccl_unique_id_b64: NCCL mode joins one rank per server, but "
                "this server answers /get_world_size " +
                    std::to_string(served) + " (--world-size " + std::to_string(config.world_size) +
                    " x --data-parallel " + std::to_string(config.data_parallel) +
                    "); serve NCCL mode with --world-size 1 --data-parallel 1");
  }
  // Where NCCL cannot run, that is the answer (a test's own join runs anywhere).
  if (auto r = nccl::ready(); !r && !config.nccl_join) {
    return fail(400, "init_info.nccl_unique_id_b64: " + r.error().message);
  }
  if (consumer && !nccl_mode()) {
    return fail(400, "init_info.nccl_unique_id_b64: NCCL mode differs from \"" + transport +
                         "\", which this rank was initialised with");
  }
  nccl::packing how;
  (void)read_packing(info, "init_info", how);  // checked by the caller
  auto id = nccl::unique_id_from_base64(info["nccl_unique_id_b64"].get<std::string>());
  if (!id) return fail(400, "init_info.nccl_unique_id_b64: " + id.error().message);
  // One wsync rank per HTTP service: it is vLLM's worker 0 of this server.
  const int rank = static_cast<int>(info["rank_offset"].get<std::int64_t>());
  const int world = static_cast<int>(info["world_size"].get<std::int64_t>());
  // A new init leaves the old group first (its trainer has moved on to the new one), and an
  // update it had started.
  started_drop("init_weight_transfer_engine");
  const bool had_group = nccl_group != nullptr;
  nccl_group.reset();
  const auto join = config.nccl_join ? config.nccl_join : nccl::join_endpoint;
  const std::string who = "rank " + std::to_string(rank) + " of " + std::to_string(world);
  auto group = join(*id, world, rank, config.cuda_device, config.nccl_timeout, cancel_for_join());
  if (!group) {
    if (had_group) {
      // The old group is gone and no new one came: the rank is as after a drop, and start
      // says so until an init joins (not "ready" with no group to receive from).
      nccl_lost = "an init to join a new group failed: " + group.error().message;
      current = phase::uninitialized;
    }
    if (group.error().code == errc::blocked) {
      return fail(400, "init_info.nccl_unique_id_b64: " + group.error().message);
    }
    return fail(500, "init_weight_transfer_engine: joining the NCCL group as " + who +
                         " failed: " + group.error().message);
  }
  if (!consumer) {
    auto segments = std::make_unique<received_segments>((*group)->memory());
    received = segments.get();
    transport = "nccl";
    transport_settings = {};
    consumer =
        std::make_unique<weight_consumer>(std::move(segments), consumer_config{config.rank, 2});
    executor = std::make_unique<rollout_executor>(*consumer, runtime, runtime.gate(),
                                                  executor_config{config.verify});
  }
  nccl_group = std::move(*group);
  nccl_packing = how;
  nccl_lost.clear();
  if (current == phase::uninitialized) current = phase::ready;
  log_info("rank " + std::to_string(config.rank) + ": joined the trainer's NCCL group as " + who +
           " (" + nccl_group->describe() + (how.packed ? ", packed" : "") + ")");
  return reply(200, {{"message", "Weight transfer initialized"}});
}

std::string weight_transfer_service::impl::nccl_check(const json& info, const std::string& where,
                                                      std::set<std::string>& taken,
                                                      nccl_entry& out) const {
  if (info.contains("manifest")) {
    return field(where, "manifest") +
           ": this rank was initialised in NCCL mode; its tensors come by broadcast, named by "
           "names / dtype_names / shapes";
  }
  out.how = nccl_packing;
  if (auto why = read_packing(info, where, out.how); !why.empty()) return why;
  if (auto why = read_specs(info, where, out.specs); !why.empty()) return why;
  for (std::size_t i = 0; i < out.specs.size(); ++i) {
    if (!taken.insert(out.specs[i].name).second) {
      return field(where, "names") + "[" + std::to_string(i) + "]: \"" + out.specs[i].name +
             "\" is already in this update";
    }
  }

  // The manifest is checked before a byte moves; the receive fills in its checksums.
  weight_update_manifest& m = out.manifest;
  m.update_id = update_id_generate();
  m.model_id = "vllm-nccl";
  m.weight_version = shards.empty() ? active.load() + 1 : shards.front().weight_version;
  m.source_worker = "nccl-rank-0";
  m.transport = "nccl";
  m.transport_handle = "received";
  m.checksum_method = {checksum_algorithm::xxh3_64_chunked, std::uint64_t{1} << 20};
  const std::string device = nccl_group ? nccl_group->memory().text() : "cpu";
  std::uint64_t at = 0;
  for (const auto& s : out.specs) {
    tensor_descriptor t;
    t.name = s.name;
    t.dtype = s.dtype;
    t.shape = s.shape;
    t.nbytes = s.nbytes;
    t.device = device;
    t.offset = at;
    at += (s.nbytes + tensor_alignment - 1) / tensor_alignment * tensor_alignment;
    m.tensors.push_back(std::move(t));
  }
  m.segments = {{at}};
  m.total_bytes = at;
  if (auto v = manifest_validate(m, transport_known); !v) {
    return where + ": " + v.error().message;
  }
  return "";
}

std::string weight_transfer_service::impl::nccl_receive(nccl_entry entry, int& status) {
  auto& specs = entry.specs;
  auto& m = entry.manifest;
  m.source_rank = static_cast<std::int32_t>(shards.size());  // its place among the shards
  status = 409;
  if (!nccl_group) {
    return "update_weights: no NCCL group" +
           (nccl_lost.empty() ? std::string() : " (it was aborted: " + nccl_lost + ")") +
           "; call /init_weight_transfer_engine";
  }
  const auto deadline = std::chrono::steady_clock::now() + config.nccl_timeout;
  auto got = nccl::receive_tensors(*nccl_group, specs, entry.how, m.checksum_method, deadline);
  if (!got) {
    // The group cannot be trusted after a failed receive (NCCL aborted it, or the broadcasts
    // and the receives no longer line up): drop it and the update with it.
    nccl_drop(got.error().message);
    status = 500;
    return "update_weights: rank " + std::to_string(config.rank) + " receiving " +
           std::to_string(specs.size()) + " tensors from the trainer failed: " + nccl_lost +
           "; the group is left and the update dropped: call /init_weight_transfer_engine again";
  }
  for (std::size_t i = 0; i < specs.size(); ++i) {
    m.tensors[i].checksum = got->checksums[i];
    m.tensors[i].offset = got->offsets[i];
  }
  received->add(m.update_id, std::move(got->segment));
  shards.push_back(std::move(m));
  return "";
}

void weight_transfer_service::impl::nccl_drop(const std::string& why) {
  log_warn("rank " + std::to_string(config.rank) + ": leaving the trainer's NCCL group: " + why);
  nccl_lost = why;
  if (nccl_group) nccl_group->abort(why);
  nccl_group.reset();
  shards_drop();
  current = phase::uninitialized;
}

std::atomic<bool>* weight_transfer_service::impl::cancel_for_join() {
  std::lock_guard lock(cancel_mutex);
  group_cancel = &group_cancels.emplace_back(stopping);
  return group_cancel;
}

void weight_transfer_service::impl::cancel_group() {
  std::lock_guard lock(cancel_mutex);
  if (group_cancel) group_cancel->store(true);
}

void weight_transfer_service::impl::nccl_forget(const std::vector<update_id>& ids) {
  if (!received) return;
  for (const auto& id : ids) received->release(id);
}

}  // namespace wsync
