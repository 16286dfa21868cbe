#pragma once
// What the parts of weight_transfer_service share (weight_transfer.cpp: the four phases;
// rank_metrics.cpp: /status and /metrics; generation.cpp: pause and generate): the state behind
// the public class, and the helpers that shape every reply. Private to the http module.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/http/weight_transfer.hpp"
#include "wsync/manifest/dtype.hpp"
#include "wsync/runtime/generation_control.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/nccl_receiver.hpp"
#include "wsync/transports/transport.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync {
// What the service's files share, in a namespace of its own: the short names (reply, fail,
// histogram) must not collide with anything else linked into a wsync program.
namespace http_detail {

/// A pause that a resume overtook before it took hold (vLLM's /pause, SGLang's pause).
inline constexpr const char* resumed_first = "pause: /resume came first: generation runs";

using json = nlohmann::json;

// Invalid UTF-8 (a query value echoed in an error, say) is replaced, never thrown on: every
// answer is valid JSON.
inline http_reply reply(int status, json body) {
  return {status, body.dump(-1, ' ', false, json::error_handler_t::replace)};
}
inline http_reply fail(int status, const std::string& message) {
  return reply(status, {{"error", message}});
}

// An error names the rank it was refused on ("rank=N"), where its text does not already (errors
// about an update say "update_id=... rank=N"). Not a conflict (409): that text says the rank's
// phase, and the rank with it. SGLang's shape ({"success": false, "message": ...}) too.
inline http_reply naming_rank(http_reply r, std::int32_t rank) {
  if (r.status < 400 || r.status == 409) return r;
  auto j = json::parse(r.body, nullptr, false);
  if (!j.is_object()) return r;
  const char* field = j.contains("error") ? "error" : "message";
  if (!j.contains(field) || !j[field].is_string()) return r;
  auto text = j[field].get<std::string>();
  if (text.find("rank=") != std::string::npos) return r;
  j[field] = text + " (rank=" + std::to_string(rank) + ")";
  return reply(r.status, std::move(j));
}

// A JSON object body, or nullopt and `why` ("body: ..."). An empty body is {} when allowed.
std::optional<json> read_body(std::string_view body, bool empty_ok, std::string& why);
// read_body, with the 400 of vLLM's surface.
std::optional<json> parse_body(std::string_view body, bool empty_ok, http_reply& error);

// Why a call is refused: the HTTP status (vLLM's surface) and the message naming the field.
struct refusal {
  int status = 400;
  std::string message;
};

// An optional {"key": "value"} object of transport options at `j[key]`; numbers and booleans are
// taken as their JSON text. nullopt (and `error`, naming `where`) when it is malformed.
std::optional<transport_options> options_field(const json& j, const char* key,
                                               const std::string& where, std::string& error);

// A dtype as torch spells it ("bfloat16", or str() of a dtype: "torch.bfloat16"); nullopt for
// anything else, a non-string included.
inline std::optional<dtype> torch_dtype(const json& name) {
  if (!name.is_string()) return std::nullopt;
  std::string_view text = name.get_ref<const std::string&>();
  if (text.starts_with("torch.")) text.remove_prefix(6);
  return dtype_parse(text);
}

// "<where>.<key>", or "<key>" at the top of a body: how replies name a field.
inline std::string field(const std::string& where, const std::string& key) {
  return where.empty() ? key : where + "." + key;
}

// Checks one chunk description (names, dtypes under `dtype_key`, shapes) against the manifests
// it describes (at least one); "" when it matches, else the first mismatch naming its field,
// the update and this `rank`.
std::string check_chunk(const json& info, const std::string& where,
                        const std::vector<weight_update_manifest>& known, const char* dtype_key,
                        std::int32_t rank);

// vLLM's packing fields (packed, packed_buffer_size_bytes, packed_num_buffers) of init_info or,
// in older versions, update_info (at `where`), over `how`. "" or the first problem.
std::string read_packing(const json& info, const std::string& where, nccl::packing& how);

// Prometheus histogram with fixed buckets (seconds).
class histogram {
 public:
  void observe(double seconds);
  void render(std::ostringstream& out, const std::string& name, const std::string& label) const;

 private:
  static constexpr std::array<double, 10> bounds = {0.0005, 0.001, 0.005, 0.01, 0.05,
                                                    0.1,    0.5,   1,     5,    30};
  mutable std::mutex mutex_;
  std::array<std::uint64_t, bounds.size()> counts_{};
  std::uint64_t count_ = 0;
  double sum_ = 0;
};

enum class phase { uninitialized, ready, started };
const char* phase_name(phase p);

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

}  // namespace http_detail

using namespace http_detail;

struct weight_transfer_service::impl {
  impl(weight_transfer_config c, std::string coord)
      : config(std::move(c)), coordinator(std::move(coord)) {}

  weight_transfer_config config;
  std::string coordinator;    ///< non-empty: coordinator-driven, the four phases are refused
  reference_runtime runtime;  ///< standalone: the rank's own runtime
  generation_control generation;

  // The four phases; one call at a time.
  mutable std::mutex phase_mutex;
  // Written under phase_mutex, read without it by /status: a call holds the mutex for as long as
  // an NCCL receive or join takes (up to --nccl-timeout-ms), and /status must answer meanwhile.
  std::atomic<phase> current{phase::uninitialized};
  std::string transport;                 ///< fixed by the first init
  transport_options transport_settings;  ///< and its options
  std::unique_ptr<weight_consumer> consumer;
  std::unique_ptr<rollout_executor> executor;
  std::vector<weight_update_manifest> shards;  ///< received since start
  std::string sglang_group;  ///< SGLang: the group /init_weights_update_group made

  // vLLM's NCCL mode (nccl_flow.cpp): the trainer's group this rank joined, how the trainer
  // packs, and the consumer transport (owned by `consumer`) that hands what was received to
  // the executor. An aborted receive drops the group: `nccl_lost` says why until the next init.
  // Each group's cancel flag (the group's waits end once it is set): set for the current group
  // by stop_waiting, and by an init that supersedes it, so that the init does not wait out a
  // receive the old trainer will never feed. Flags are never freed (a communicator holds its
  // own for life); cancel_mutex, not phase_mutex, guards them, as those callers run while a
  // receive holds phase_mutex.
  std::mutex cancel_mutex;
  std::deque<std::atomic<bool>> group_cancels;
  std::atomic<bool>* group_cancel = nullptr;  // the current group's
  bool stopping = false;                      // stop_waiting came: later groups start cancelled
  std::atomic<bool>* cancel_for_join();       // a fresh flag, now the current group's
  void cancel_group();                        // sets the current group's flag
  std::unique_ptr<nccl::broadcast_endpoint> nccl_group;
  nccl::packing nccl_packing;
  class received_segments* received = nullptr;
  std::string nccl_lost;
  std::string active_model;  ///< status_mutex: model of the last install

  // The weight version as a label (vLLM's /update_weight_version, SGLang's weight_version):
  // shown while `label_for` is still the active version, else the active version in decimal.
  std::string label;                                                   ///< status_mutex
  std::uint64_t label_for = 0;                                         ///< status_mutex
  std::optional<std::map<std::string, std::string>> checker_baseline;  ///< status_mutex

  // What /status and /metrics report.
  mutable std::mutex status_mutex;
  std::vector<rank_slot> ranks;
  std::deque<update_entry> recent;
  std::atomic<std::uint64_t> active{0};  ///< standalone: the version finish switched to
  std::atomic<std::uint64_t> published{0}, committed{0}, rejected{0}, bytes_moved{0};
  std::atomic<std::uint64_t> generations_completed{0}, generations_aborted{0};
  std::atomic<std::uint64_t> generation_steps{0};  ///< steps served, each on one whole version
  std::uint64_t versions = 0;         ///< distinct versions made active here (status_mutex)
  std::uint64_t highest_version = 0;  ///< status_mutex
  histogram import_s, verify_s, install_s, total_s;

  std::string conflict(std::string_view call, std::string_view hint) const {
    return std::string(call) + ": out of order: the weight transfer is '" + phase_name(current) +
           "' on rank " + std::to_string(config.rank) +
           (hint.empty() ? "" : " (" + std::string(hint) + ")");
  }

  // update and finish need a started phase: say which call comes first.
  std::string not_started(std::string_view call) const {
    return conflict(call, current == phase::uninitialized
                              ? "call /init_weight_transfer_engine first"
                              : "call /start_weight_update first");
  }

  // Under a coordinator the update calls are refused: why, or nullopt when standalone.
  std::optional<std::string> following(std::string_view call) const {
    if (coordinator.empty()) return std::nullopt;
    return std::string(call) + ": out of order: this consumer follows the coordinator at " +
           coordinator + "; updates come from it, not over HTTP";
  }
  std::optional<http_reply> refuse_when_following(std::string_view call) const {
    if (auto why = following(call)) return fail(409, *why);
    return std::nullopt;
  }

  // The transport's consumer and the executor over it, made once; later calls must name the
  // same transport. Needs phase_mutex.
  // `options` (e.g. file-mmap's dir) come from the init call's transport_options.
  std::optional<refusal> open_transport(const std::string& name, const transport_options& options,
                                        const std::string& where);

  // NCCL mode: joins the group of a checked init_info (phase_mutex held).
  http_reply nccl_init(const json& info);
  bool nccl_mode() const { return received != nullptr; }
  // NCCL mode: one update_info, checked and ready to receive.
  struct nccl_entry {
    std::vector<nccl::tensor_spec> specs;
    nccl::packing how;
    weight_update_manifest manifest;  ///< its checksums come with the receive
  };
  // /update_weights, under phase_mutex: nullopt when the update's chunks are taken.
  std::optional<refusal> update_weights(std::string_view body);
  // The answer to a refused /update_weights (under phase_mutex). In NCCL mode the trainer's
  // broadcasts for that call have no receiver: the group is aborted and the answer says so.
  http_reply update_refused(const refusal& no);
  // NCCL mode: checks one update_info (at `where`) before a byte moves; its names must not be
  // in `taken` (the names received or checked before it in this update), and join it.
  // "" or the first problem.
  std::string nccl_check(const json& info, const std::string& where, std::set<std::string>& taken,
                         nccl_entry& out) const;
  // NCCL mode: receives a checked entry's tensors and adds them to `shards` as one more
  // manifest. "" or the reason, with the HTTP status in `status`.
  std::string nccl_receive(nccl_entry entry, int& status);
  // NCCL mode: aborts and leaves the group, and drops the update received so far (`why` is
  // kept in nccl_lost). The rank needs an init again.
  void nccl_drop(const std::string& why);
  // NCCL mode: frees what was received for `ids` and not imported.
  void nccl_forget(const std::vector<update_id>& ids);
  // Forgets the update received so far (`shards`, and in NCCL mode its device memory).
  void shards_drop();
  // An init while an update is started: the update is dropped and the phase is ready again. A
  // trainer that calls init anew has begun anew (it restarted, say); finishing instead would
  // install what its last life sent, part of an update, and a first install fixes the model's
  // tensor set.
  void started_drop(std::string_view call);

  // Parses one manifest of an update (`mj`: a JSON object or its text, the field `at`) and adds
  // it to `shards` after checking it belongs: the initialised transport, the same update as the
  // shards before it, not sent twice, above the active version. "" or the reason.
  std::string accept_manifest(const json& mj, const std::string& at,
                              std::vector<weight_update_manifest>& shards) const;

  // Imports, verifies, stages and switches to `shards` (phase_mutex held), records the answer,
  // and sets the version label when one is given and the install succeeded.
  rollout_report install(std::vector<weight_update_manifest> update,
                         const std::optional<std::string>& label_text);

  // The lowest version any rank serves (0 before the first install). Needs status_mutex.
  std::uint64_t lowest_active() const {
    std::optional<std::uint64_t> lowest;
    for (const auto& slot : ranks) lowest = std::min(lowest.value_or(slot.active), slot.active);
    return lowest.value_or(0);
  }

  // The served rank `rank`, or the first one when rank < 0; nullptr when none. Needs
  // status_mutex.
  const rank_slot* slot_of(std::int64_t rank) const {
    for (const auto& slot : ranks) {
      if (rank < 0 || slot.rank == rank) return &slot;
    }
    return nullptr;
  }

  // The version label readers see now.
  std::string version_label() const;

  // Counts one rank's answer to one update (metrics, per-rank state, recent updates). An
  // acknowledged update's `label_text`, when given, becomes the version label in the same
  // moment as its version becomes the rank's active one.
  void record(std::int32_t rank, const std::string& key, const rollout_report& r,
              std::uint64_t bytes, const std::optional<std::string>& label_text = std::nullopt);
};

}  // namespace wsync
