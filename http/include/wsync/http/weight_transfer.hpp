#pragma once
// The vLLM weight-transfer contract on a wsync consumer rank, free of HTTP so it can be tested
// call by call: every method takes what the request carried and returns the status and JSON
// body to answer with. The HTTP gateway (http_gateway.hpp) only routes to it.
//
// Four phases, in order: init -> start -> update (once or more) -> finish. Out of order: 409
// naming the current phase. Malformed JSON or a missing/wrong field: 400 naming the field. A
// failed install: 500 with the reason, the previous version stays active. The weights change
// only at a successful finish, atomically (under the generation gate).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "wsync/transports/nccl.hpp"

namespace wsync {

class reference_runtime;
struct rollout_report;
namespace nccl {
class broadcast_endpoint;
}

/// How vLLM's NCCL mode joins the trainer's group: (unique id, world size, this rank, CUDA
/// device, timeout, cancel flag) -> the receiving endpoint. Once the flag (it outlives the
/// endpoint) is set, the join and every later wait of the endpoint fail at once.
using nccl_join_fn = std::function<result<std::unique_ptr<nccl::broadcast_endpoint>>(
    const nccl::unique_id&, int, int, int, std::chrono::milliseconds, const std::atomic<bool>*)>;

struct http_reply {
  int status = 200;
  std::string body;  ///< JSON
};

struct weight_transfer_config {
  std::int32_t rank = 0;
  std::int32_t world_size = 1;     ///< GET /get_world_size?include_dp=false (TP x PP)
  std::int32_t data_parallel = 1;  ///< include_dp=true answers world_size x data_parallel
  std::string node = "n0";
  bool verify = true;  ///< recompute checksums before installing
  // vLLM's NCCL mode (init_info.nccl_unique_id_b64; docs/http.md#nccl).
  int cuda_device = 0;  ///< the device this rank receives broadcasts on
  /// Joining the group (with its warm-up), and each /update_weights' receive.
  std::chrono::milliseconds nccl_timeout{std::chrono::minutes(5)};
  /// Empty: nccl::join_endpoint (NCCL). Tests put an in-process trainer here.
  nccl_join_fn nccl_join;
};

/// A boolean query parameter as FastAPI reads one (vLLM's server): true, 1, yes or on, false, 0,
/// no or off, in any case; nullopt for anything else.
std::optional<bool> query_flag(std::string_view text);

class weight_transfer_service {
 public:
  /// A standalone rank: it owns its runtime and the four phases install into it.
  explicit weight_transfer_service(weight_transfer_config config);
  /// A coordinator-driven process: its ranks (add_rank) belong to the consumer actors, the four
  /// phases answer 409 (updates come from the coordinator at `coordinator`), and status,
  /// metrics, pause and generate work across the ranks.
  weight_transfer_service(weight_transfer_config config, std::string coordinator);
  ~weight_transfer_service();

  // Coordinator-driven mode; thread-safe.
  void add_rank(std::int32_t rank, reference_runtime& runtime);
  void record_update(std::int32_t rank, const std::string& key, const rollout_report& report,
                     std::uint64_t bytes);
  /// The ranks' runtimes are going away: /generate answers 503 from now on.
  void detach_ranks();
  /// Shutting down (either mode), from any thread: every generation in flight, held by a pause
  /// or waiting to begin ends as aborted, and any later one at its first step; an NCCL join or
  /// receive in progress fails at once (its group aborted), and so does any later one. Returns
  /// once no generation runs. Call it before the gateway stops: these hold the gateway's
  /// threads (an NCCL wait for up to --nccl-timeout-ms).
  void stop_waiting();
  weight_transfer_service(const weight_transfer_service&) = delete;
  weight_transfer_service& operator=(const weight_transfer_service&) = delete;

  // POST bodies as received (may be empty where vLLM allows no body).
  http_reply init(std::string_view body);
  http_reply start(std::string_view body);
  http_reply update(std::string_view body);
  /// An /update_weights refused before its body was read (`status`, `why`: too large, cut off,
  /// compressed): nothing is done, except in NCCL mode, where the trainer's broadcasts for the
  /// call have no receiver and the group is aborted, as for any refused update.
  http_reply update_unread(int status, const std::string& why);
  http_reply finish(std::string_view body);
  /// `mode`: the query parameter (the gateway passes "abort", vLLM's default, when it is absent;
  /// given empty, it is refused). Returns when the mode's promise holds (generation_control.hpp).
  http_reply pause(std::string_view mode);
  http_reply resume();
  http_reply is_paused() const;
  /// `include_dp`: the query parameter, a boolean (the gateway passes "true" when it is absent).
  http_reply world_size(std::string_view include_dp) const;
  http_reply status() const;
  /// Prometheus text exposition (version 0.0.4).
  std::string metrics() const;
  /// POST /generate on the reference runtime: {"steps": n, "step_ms": t, "rank": r (default:
  /// the first rank)}. Each step reads the
  /// active weights under the generation gate; the reply lists the versions the steps saw and
  /// says whether the generation completed or was aborted by a pause.
  http_reply generate(std::string_view body);

  // SGLang's weight-update surface (sglang.cpp, docs/http.md#sglang): flat JSON bodies,
  // replies {"success": bool, "message": str} with 200, or 400 on any failure. The backend part
  // of an update is a wsync manifest, as on vLLM's surface; both surfaces share one state.
  http_reply sglang_init_group(std::string_view body);
  http_reply sglang_destroy_group(std::string_view body);
  http_reply sglang_update(std::string_view body);
  /// {"mode": "abort" | "retract" | "in_place"} (default abort) -> wsync's abort / keep / keep.
  http_reply sglang_pause(std::string_view body);
  http_reply sglang_continue(std::string_view body);
  /// GET /get_weight_version and /model_info: {"weight_version": label, ...}.
  http_reply sglang_model_info() const;

  // The weight version and the weight checker (weight_checker.cpp).
  /// POST /update_weight_version {"new_version": str}: labels the active weights.
  http_reply update_weight_version(std::string_view body);
  /// GET /weight_info: {"weight_version": label}.
  http_reply weight_info() const;
  /// POST /weight_checker {"action": "checksum" | "reset" | "compare", "baseline": {...},
  /// "rank": r}: per-tensor SHA-256 of the active weights, compared with a baseline.
  http_reply weight_checker(std::string_view body);

  /// The lowest version any rank serves (0 before the first successful install).
  std::uint64_t active_version() const;

 private:
  // The calls before their errors are made to name the rank (init and start concern no update
  // yet; a refused update or finish body may come before the update is known).
  http_reply init_answer(std::string_view body);
  http_reply start_answer(std::string_view body);
  http_reply update_answer(std::string_view body);
  http_reply finish_answer(std::string_view body);
  http_reply sglang_update_answer(std::string_view body);

  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace wsync
