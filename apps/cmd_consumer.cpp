// `wsync consumer`: rollout ranks, driven by a coordinator, over HTTP, or both.

#include <iostream>
#include <memory>

#include <cstdlib>
#include <limits>

#include "common.hpp"
#include "subcommand.hpp"
#include "wsync/cluster/standalone_consumer.hpp"
#include "wsync/http/consumer_process.hpp"

namespace wsync::cli {
namespace {

struct consumer_state {
  consumer_options options;
  standalone_options http;  // the HTTP surface, with or without a coordinator
  std::string coordinator;  // host:port, parsed into options.coordinator after the checks
  std::vector<std::string> transport_settings;
  bool standalone = false;
  bool enable_http = false;
  // Bound as itself, not as a negated flag: --dump-config prints a negated flag's stored value
  // under its name (no-node-leader=false for --no-node-leader), which reloads inverted.
  bool no_node_leader = false;
  follow_options follow;  // --standalone --transport file-mmap: poll DIR/CURRENT
};

// Options this run would not act on are refused, not ignored. Compared with their defaults, not
// counted, so that a configuration printed by --dump-config (every setting) loads again.
std::string misplaced_option(const consumer_state& s) {
  const consumer_state d;
  const bool follow = s.standalone && s.options.transport == "file-mmap";
  if (s.follow.poll != d.follow.poll && !follow) {
    return "--poll-ms: only --standalone --transport file-mmap polls a directory";
  }
  const http_options& h = s.http.http;
  const http_options& dh = d.http.http;
  const weight_transfer_config& r = s.http.rank;
  const weight_transfer_config& dr = d.http.rank;
  const bool http_set = h.host != dh.host || h.port != dh.port || h.port_file != dh.port_file ||
                        h.api != dh.api || r.world_size != dr.world_size ||
                        r.data_parallel != dr.data_parallel;
  const bool nccl_set = r.cuda_device != dr.cuda_device || r.nccl_timeout != dr.nccl_timeout;
  if ((http_set || nccl_set) && !s.enable_http) {
    return "--http-*, --world-size, --data-parallel, --cuda-device and --nccl-timeout-ms set "
           "the HTTP surface: add --enable-weight-transfer (or set WSYNC_SERVER_DEV_MODE=1)";
  }
  if (nccl_set && !s.standalone) {
    return "--cuda-device/--nccl-timeout-ms: vLLM's NCCL mode is the standalone rank's (with "
           "--coordinator, updates come from the coordinator and the HTTP phases answer 409)";
  }
  return "";
}

int consumer_start(consumer_state& s) {
  consumer_options& opt = s.options;
  opt.node_leader = !s.no_node_leader;
  if (const char* dev = std::getenv("WSYNC_SERVER_DEV_MODE"); dev && std::string(dev) == "1") {
    s.enable_http = true;
  }
  if (auto why = misplaced_option(s); !why.empty()) {
    std::cerr << "wsync: consumer: " << why << "\n";
    return 2;
  }
  // Ranks rank .. rank + count - 1 must all be ranks (and not wrap past INT32_MAX).
  if (opt.rank < 0 || opt.rank > std::numeric_limits<std::int32_t>::max() - (opt.count - 1)) {
    std::cerr << "wsync: --rank " << opt.rank << ": must be from 0 to "
              << std::numeric_limits<std::int32_t>::max() - (opt.count - 1) << " with --count "
              << opt.count << "\n";
    return 2;
  }
  if (s.standalone && opt.count != 1) {
    std::cerr << "wsync: --count " << opt.count
              << ": a standalone consumer is one rank; start one process per rank\n";
    return 2;
  }
  if (s.standalone && opt.transport == "file-mmap") {
    if (s.enable_http || !s.coordinator.empty()) {
      std::cerr << "wsync: --standalone --transport file-mmap: polls the directory; takes no "
                   "--coordinator nor --enable-weight-transfer\n";
      return 2;
    }
    if (!transport_settings_from(s.transport_settings, s.follow.transport_settings)) return 2;
    s.follow.rank = opt.rank;
    s.follow.transport = opt.transport;
    s.follow.model_id = opt.model_id;
    s.follow.verify = opt.verify;
    return consumer_follow_run(s.follow);
  }
  if (s.standalone) {
    if (!s.enable_http) {
      std::cerr << "wsync: --standalone: HTTP is this rank's only input; add "
                   "--enable-weight-transfer (or set WSYNC_SERVER_DEV_MODE=1)\n";
      return 2;
    }
    if (!s.coordinator.empty()) {
      std::cerr << "wsync: --standalone: takes no --coordinator (unset WSYNC_COORDINATOR)\n";
      return 2;
    }
    if (!s.transport_settings.empty()) {
      std::cerr << "wsync: --standalone over HTTP: the trainer names the transport and its "
                   "options in the init call (init_info.transport, init_info.transport_options; "
                   "SGLang: backend, transport_options), not --transport-option\n";
      return 2;
    }
    s.http.rank.rank = opt.rank;
    s.http.rank.node = opt.node;
    s.http.rank.verify = opt.verify;
    return standalone_consumer_run(s.http);
  }
  if (s.coordinator.empty() || opt.model_id.empty()) {
    std::cerr << "wsync: consumer: --coordinator and --model are required (or --standalone)\n";
    return 2;
  }
  if (!need_token(opt.coordinator.token)) return 2;
  if (!coordinator_from(s.coordinator, opt.coordinator)) return 2;
  if (!transport_settings_from(s.transport_settings, opt.transport_settings)) return 2;
  if (opt.transport == "nccl" && opt.count > 1) {
    std::cerr << "wsync: consumer: --transport nccl takes one rank per process, each on its own "
                 "GPU (--transport-option device=N): NCCL refuses two ranks on one GPU (got "
                 "--count "
              << opt.count << ")\n";
    return 2;
  }
  if (s.enable_http) {
    s.http.rank.node = opt.node;
    return consumer_http_run(opt, s.http);
  }
  return consumer_run(opt);
}

void add_http_flags(CLI::App* cons, consumer_state& s) {
  cons->add_flag("--standalone", s.standalone,
                 "no coordinator: one rank driven only over HTTP, as a vLLM server would be "
                 "(needs --enable-weight-transfer); or, with --transport file-mmap "
                 "--transport-option dir=DIR, one rank that polls DIR/CURRENT and installs each "
                 "new version it finds there (TorchRL's pull model) until SIGINT/SIGTERM/SIGHUP");
  add_milliseconds(cons, "--poll-ms", s.follow.poll,
                   "with --standalone --transport file-mmap: how often DIR/CURRENT is read");
  cons->add_flag("--enable-weight-transfer", s.enable_http,
                 "serve the vLLM-compatible HTTP surface (or set WSYNC_SERVER_DEV_MODE=1); off "
                 "by default");
  http_options& http = s.http.http;
  cons->add_option("--http-host", http.host, "HTTP listen address")->capture_default_str();
  cons->add_option("--http-port", http.port, "HTTP port (0: pick a free one)")
      ->capture_default_str();
  cons->add_option("--http-port-file", http.port_file, "write the HTTP port here once listening");
  cons->add_option("--http-token", http.token,
                   "bearer token every HTTP request must carry (Authorization: Bearer ...)")
      ->envname("WSYNC_HTTP_TOKEN");
  cons->add_option(
          "--http-api", http.api,
          "HTTP route set: vllm (vLLM's weight-transfer routes), sglang (SGLang's "
          "weight-update routes) or both; /status, /metrics, /generate and /health in each")
      ->check(CLI::IsMember({"vllm", "sglang", "both"}))
      ->capture_default_str();
  cons->add_option("--world-size", s.http.rank.world_size,
                   "GET /get_world_size?include_dp=false: this server's TP x PP ranks")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cons->add_option("--cuda-device", s.http.rank.cuda_device,
                   "with --standalone, vLLM's NCCL mode (init_info.nccl_unique_id_b64): the CUDA "
                   "device this rank receives the trainer's broadcasts on")
      ->check(CLI::Range(0, 1023))
      ->capture_default_str();
  add_milliseconds(cons, "--nccl-timeout-ms", s.http.rank.nccl_timeout,
                   "vLLM's NCCL mode: joining the trainer's group (with the warm-up) and each "
                   "/update_weights' receive must end within this, or the group is aborted");
  cons->add_option("--data-parallel", s.http.rank.data_parallel,
                   "GET /get_world_size (include_dp=true) answers world-size x data-parallel")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
}

}  // namespace

subcommand add_consumer(CLI::App& app) {
  auto state = std::make_shared<consumer_state>();
  consumer_options& opt = state->options;
  auto* cons = app.add_subcommand(
      "consumer",
      "Run a consumer (rollout) rank with the reference runtime: imports, verifies, "
      "installs and acknowledges every update the coordinator sends; with --standalone, "
      "driven over HTTP (vLLM's or SGLang's calls) or polling a file-mmap folder instead.");
  cons->add_option("--coordinator", state->coordinator,
                   "coordinator host:port (not with --standalone)")
      ->envname("WSYNC_COORDINATOR");
  cons->add_option("--rank", opt.rank,
                   "consumer rank (the first, with --count); default $RANK or $SLURM_PROCID")
      ->envname("RANK");
  cons->add_option("--count", opt.count, "consumer ranks to run in this process")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  add_node(cons, opt.node,
           "node name shown in status; the consumer processes of one node (one host) share a "
           "node leader that carries their updates and reports");
  cons->add_flag("--no-node-leader", state->no_node_leader,
                 "never lead this node's other consumer processes (it opens no loopback port); "
                 "it still reports through the node's leader if another process leads");
  add_transport(cons, opt.transport, state->transport_settings);
  cons->add_option("--model", opt.model_id,
                   "model id to follow (with --standalone: only file-mmap, optional)");
  add_token(cons, opt.coordinator.token);
  add_tls(cons, opt.coordinator.tls);
  add_http_flags(cons, *state);
  return {cons, [state] {
            return consumer_start(*state);
          }};
}

}  // namespace wsync::cli
