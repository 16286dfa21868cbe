// The `wsync` executable: thin subcommands over the libraries.

#include <CLI/CLI.hpp>

#include <iostream>

#include <cstdlib>

#include "toml_config.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/bench/bench.hpp"
#include "wsync/bench/cluster_bench.hpp"
#include "wsync/bench/fanout_bench.hpp"
#include "wsync/cluster/demo.hpp"
#include "wsync/cluster/fanout_router.hpp"
#include "wsync/cluster/standalone_publisher.hpp"
#include "wsync/cluster/status.hpp"
#include "wsync/http/consumer_process.hpp"
#include "wsync/sources/layouts.hpp"
#include "wsync/transports/registry.hpp"

namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

void add_bench(CLI::App& app, wsync::bench_options& opt, std::string& verify,
               std::vector<int>& consumers, wsync::fanout_bench_options& fanout) {
  auto* bench = app.add_subcommand(
      "bench",
      "Time one weight update end to end (publish, import, verify, install, ack, release) and "
      "print JSON rows: one per timed update, the result row last. Baselines (single-thread "
      "memcpy into pre-faulted memory, single-thread xxh3) are measured in the same run.");
  bench
      ->add_option("--mode", opt.mode,
                   "local: publisher and consumer in one process over local-clone; "
                   "shared-memory: the consumer is a separate process importing zero-copy; "
                   "ucx: the consumer is a separate process pulling over UCX on loopback, "
                   "against ucx_perftest with the same transports and message size; "
                   "cluster: control-plane overhead per update for each --consumers count; "
                   "fanout: time to commit across emulated nodes (network namespaces with "
                   "rate-limited links, root only) for each --plan, against one consumer")
      ->check(CLI::IsMember({"local", "shared-memory", "ucx", "cluster", "fanout"}))
      ->capture_default_str();
  bench->add_flag("--smoke", opt.smoke,
                  "quick run for tests: 8 MiB in 16 tensors (unless --layout/--bytes), at most "
                  "3 repeats");
  auto* layout = bench->add_option(
      "--layout", opt.layout,
      "model whose checkpoint layout (tensor names, shapes, bf16) to publish, with random "
      "contents: " +
          join(wsync::layout_names()) + " (default qwen2.5-0.5b)");
  auto* bytes = bench->add_option("--bytes", opt.bytes,
                                  "publish a synthetic update of this many bytes instead of a "
                                  "model layout");
  bench->add_option("--tensors", opt.tensors, "number of tensors of the synthetic update")
      ->needs(bytes);
  layout->excludes(bytes);
  bench->add_option("--repeat", opt.repeat, "timed updates; timings are their medians")
      ->check(CLI::Range(1u, 1000u))
      ->capture_default_str();
  bench->add_option("--verify", verify, "recompute every tensor checksum on import")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  bench
      ->add_option("--copy-threads", opt.copy_threads,
                   "threads that copy and checksum tensors into the segments")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  bench
      ->add_option("--consumers", consumers,
                   "cluster mode: consumer rank counts to measure, e.g. 1,8,64 (the 1-rank "
                   "baseline is always measured)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  bench
      ->add_option("--slots", opt.slots,
                   "shared-memory ring size (at least 2: the active version and the incoming one)")
      ->check(CLI::Range(2u, 64u))
      ->capture_default_str();
  bench->add_option("--ucx-tls", opt.ucx_tls,
                    "ucx mode: UCX_TLS for both processes and the baseline, e.g. tcp, sm, "
                    "posix,cma (default: one row for tcp, one for sm)");
  bench->add_option("--nodes", fanout.nodes, "fanout mode: consumer nodes")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  bench
      ->add_option("--ranks-per-node", fanout.ranks_per_node,
                   "fanout mode: consumer ranks per node")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  bench
      ->add_option("--plan", fanout.plans,
                   "fanout mode: plans to measure, one row each: tree, chain (degree 1), star "
                   "(publisher to every node)")
      ->delimiter(',')
      ->check(CLI::IsMember({"tree", "chain", "star"}))
      ->capture_default_str();
  bench->add_option("--degree", fanout.degree, "fanout mode: children per leader in a tree")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  bench->add_option("--rate-mbit", fanout.rate_mbit, "fanout mode: each node's link, each way")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{100000}))
      ->capture_default_str();
  bench->add_flag("--kill-leader", fanout.kill_leader,
                  "fanout mode: then one more update during which a top leader is SIGKILLed; "
                  "its subtree must still commit");
  bench
      ->add_option("--ucx-chunk-bytes", opt.ucx_chunk_bytes,
                   "ucx and fanout modes: bytes per pulled chunk (default 4 MiB for ucx, 256 KiB "
                   "for fanout)")
      ->check(CLI::Range(std::uint64_t{4096}, std::uint64_t{1} << 30));
}

// --transport NAME and --transport-option KEY=VALUE (repeatable), e.g. ucx with tls=tcp.
void add_transport(CLI::App* cmd, std::string& transport, std::vector<std::string>& settings) {
  cmd->add_option("--transport", transport,
                  "data plane: shared-memory (one node) or ucx (across nodes; consumers relay "
                  "along the coordinator's --plan)")
      ->check(CLI::IsMember(wsync::builtin_transports().names()))
      ->capture_default_str();
  cmd->add_option("--transport-option", settings,
                  "KEY=VALUE for the transport, repeatable (ucx: tls=tcp, devices=eth0, "
                  "chunk_bytes=..., see docs/transports.md)");
}

// KEY=VALUE strings -> transport options; false (with a message) on a malformed one.
bool transport_settings_from(const std::vector<std::string>& items, wsync::transport_options& out) {
  for (const auto& item : items) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::cerr << "wsync: --transport-option " << item << ": expected KEY=VALUE\n";
      return false;
    }
    out[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return true;
}

// "host:port" -> endpoint; the token comes from --token or WSYNC_TOKEN.
bool parse_endpoint(const std::string& text, wsync::endpoint& ep) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos) return false;
  ep.host = text.substr(0, colon);
  try {
    auto port = std::stoul(text.substr(colon + 1));
    if (port == 0 || port > 65535) return false;
    ep.port = static_cast<std::uint16_t>(port);
  } catch (...) {
    return false;
  }
  return true;
}

// --coordinator host:port into `ep` (host and port only), or false after saying why.
bool coordinator_from(const std::string& text, wsync::endpoint& ep) {
  if (parse_endpoint(text, ep)) return true;
  std::cerr << "wsync: --coordinator: expected host:port, got " << text << "\n";
  return false;
}

// Slurm names ranks its own way; map it onto the variables the options read, unless a launcher
// (torchrun, mpirun wrappers) already set them.
void launcher_environment() {
  auto copy = [](const char* from, const char* to) {
    if (std::getenv(to) == nullptr && std::getenv(from) != nullptr) {
      ::setenv(to, std::getenv(from), 0);
    }
  };
  copy("SLURM_PROCID", "RANK");
  copy("SLURM_NTASKS", "WORLD_SIZE");
  copy("SLURM_LOCALID", "LOCAL_RANK");
}

// --tls-cert / --tls-key / --tls-ca on every subcommand that talks to the cluster.
void add_tls(CLI::App* sub, wsync::tls_settings& tls) {
  sub->add_option("--tls-cert", tls.certificate,
                  "PEM certificate: turns on TLS between cluster processes (every process needs "
                  "one)")
      ->envname("WSYNC_TLS_CERT")
      ->check(CLI::ExistingFile);
  sub->add_option("--tls-key", tls.key, "PEM private key of --tls-cert")
      ->envname("WSYNC_TLS_KEY")
      ->check(CLI::ExistingFile);
  sub->add_option("--tls-ca", tls.ca_file, "PEM CA file that signed every peer's certificate")
      ->envname("WSYNC_TLS_CA")
      ->check(CLI::ExistingFile);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "wsync moves versioned model-weight updates from trainer ranks to rollout ranks.\n"
      "Transports: " +
      join(wsync::builtin_transports().names())};
  app.set_version_flag("--version", "wsync 0.1.0");
  app.require_subcommand(1);
  // Settings come from defaults < WSYNC_* / launcher environment variables < the --config TOML
  // file < command-line flags (CLI11's order). The file is strict: a key no option knows is an
  // error that names it, and every value goes through the same checks as its flag. Set before the
  // subcommands are added: they inherit it.
  app.set_config("--config", "",
                 "TOML file of settings, one [section] per subcommand (see configs/); flags "
                 "override it");
  app.config_formatter(std::make_shared<wsync::toml_config>());  // toml++ parses the file
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.fallthrough();
  bool dump_config = false;
  app.add_flag("--dump-config", dump_config,
               "print the subcommand's effective configuration (file, environment and flags "
               "merged) as TOML and exit")
      ->configurable(false);
  wsync::bench_options bench_opt;
  std::string verify = "on";
  std::vector<int> bench_consumers = {1, 8, 64};
  wsync::fanout_bench_options fanout_opt;
  add_bench(app, bench_opt, verify, bench_consumers, fanout_opt);

  const std::string token_help =
      "cluster token (default: $WSYNC_TOKEN); ranks without it are refused";
  wsync::coordinator_options coord_opt;
  std::int64_t deadline_ms = 30000;
  auto* coord = app.add_subcommand(
      "coordinator", "Run the coordinator: rank registry, versions, per-rank ack tracking.");
  coord->add_option("--host", coord_opt.listen.host, "address to listen on")->capture_default_str();
  coord->add_option("--port", coord_opt.listen.port, "port to listen on (0: pick a free one)")
      ->capture_default_str();
  coord->add_option("--port-file", coord_opt.port_file, "write the port here once listening");
  coord->add_option("--token", coord_opt.listen.token, token_help)
      ->envname("WSYNC_TOKEN")
      ->configurable(false);
  coord
      ->add_option("--update-deadline-ms", deadline_ms,
                   "an update not committed this long after its first shard fails its "
                   "unanswered ranks")
      ->check(CLI::Range(100, 3600000))
      ->capture_default_str();

  std::string coord_plan = "tree";
  unsigned coord_degree = 2;
  coord
      ->add_option("--plan", coord_plan,
                   "how updates cross nodes when the consumers' transport relays (ucx): tree "
                   "(striped), chain or star; one leader per node either way")
      ->check(CLI::IsMember({"tree", "chain", "star"}))
      ->capture_default_str();
  coord->add_option("--degree", coord_degree, "children per leader in a tree plan")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  add_tls(coord, coord_opt.listen.tls);

  wsync::consumer_options cons_opt;
  std::string cons_coord;
  auto* cons = app.add_subcommand(
      "consumer",
      "Run a consumer (rollout) rank with the reference runtime: imports, verifies, "
      "installs and acknowledges every update the coordinator sends.");
  cons->add_option("--coordinator", cons_coord, "coordinator host:port (not with --standalone)")
      ->envname("WSYNC_COORDINATOR");
  cons->add_option("--rank", cons_opt.rank,
                   "consumer rank (the first, with --count); default $RANK or $SLURM_PROCID")
      ->envname("RANK");
  cons->add_option("--count", cons_opt.count, "consumer ranks to run in this process")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cons->add_option("--node", cons_opt.node, "node name shown in status")->capture_default_str();
  std::vector<std::string> cons_transport_settings;
  add_transport(cons, cons_opt.transport, cons_transport_settings);
  cons->add_option("--model", cons_opt.model_id, "model id to follow (not with --standalone)");
  cons->add_option("--token", cons_opt.coordinator.token, token_help)
      ->envname("WSYNC_TOKEN")
      ->configurable(false);

  add_tls(cons, cons_opt.coordinator.tls);
  bool standalone = false, enable_http = false;
  wsync::standalone_options http_opt;
  cons->add_flag("--standalone", standalone,
                 "no coordinator: one rank driven only over HTTP, as a vLLM server would be "
                 "(needs --enable-weight-transfer)");
  cons->add_flag("--enable-weight-transfer", enable_http,
                 "serve the vLLM-compatible HTTP surface (or set WSYNC_SERVER_DEV_MODE=1); off "
                 "by default");
  cons->add_option("--http-host", http_opt.http.host, "HTTP listen address")->capture_default_str();
  cons->add_option("--http-port", http_opt.http.port, "HTTP port (0: pick a free one)")
      ->capture_default_str();
  cons->add_option("--http-port-file", http_opt.http.port_file,
                   "write the HTTP port here once listening");
  cons->add_option("--http-token", http_opt.http.token,
                   "bearer token every HTTP request must carry (Authorization: Bearer ...)")
      ->envname("WSYNC_HTTP_TOKEN");
  cons->add_option("--world-size", http_opt.rank.world_size,
                   "GET /get_world_size?include_dp=false: this server's TP x PP ranks")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cons->add_option("--data-parallel", http_opt.rank.data_parallel,
                   "GET /get_world_size (include_dp=true) answers world-size x data-parallel")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();

  wsync::publisher_options pub_opt;
  std::string pub_coord;
  std::int64_t interval_ms = 0;
  auto* pub = app.add_subcommand(
      "publisher",
      "Run a publisher (trainer) rank: publish its shard of N versions of a model "
      "layout over shared memory and wait for each outcome.");
  pub->add_option("--coordinator", pub_coord, "coordinator host:port (not with --standalone)")
      ->envname("WSYNC_COORDINATOR");
  bool pub_standalone = false;
  std::string manifest_out;
  pub->add_flag("--standalone", pub_standalone,
                "no coordinator: publish the versions into shared memory, write their manifests "
                "to --manifest-out and hold them until SIGINT/SIGTERM (feeds an HTTP-driven "
                "consumer)");
  pub->add_option("--manifest-out", manifest_out,
                  "with --standalone: file that gets one manifest JSON per line");
  pub->add_option("--rank", pub_opt.rank,
                  "publisher rank (0..ranks-1); default $RANK or $SLURM_PROCID")
      ->envname("RANK")
      ->required();
  pub->add_option("--ranks", pub_opt.ranks,
                  "publisher ranks sharing the model; default $WORLD_SIZE or $SLURM_NTASKS")
      ->envname("WORLD_SIZE")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  pub->add_option("--node", pub_opt.node, "node name shown in status")->capture_default_str();
  std::vector<std::string> pub_transport_settings;
  add_transport(pub, pub_opt.transport, pub_transport_settings);
  pub->add_option(
         "--layout", pub_opt.layout,
         "model layout (" + join(wsync::layout_names()) + ") or synthetic:<bytes>:<tensors>")
      ->capture_default_str();
  pub->add_option("--safetensors", pub_opt.safetensors,
                  "publish the tensors of this .safetensors file (mapped, zero-copy) instead of "
                  "a layout; every rank takes tensor i when i % ranks == rank")
      ->check(CLI::ExistingFile);
  pub->add_option("--model", pub_opt.model_id,
                  "model id (default: the layout name, or \"safetensors\")");
  pub->add_option("--versions", pub_opt.versions, "versions to publish")->capture_default_str();
  pub->add_option("--first-version", pub_opt.first_version, "weight_version of the first one")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 62))
      ->capture_default_str();
  pub->add_option("--interval-ms", interval_ms, "pause between versions")->capture_default_str();
  pub->add_flag("--json", pub_opt.json, "print each outcome as one JSON line");
  pub->add_option("--token", pub_opt.coordinator.token, token_help)
      ->envname("WSYNC_TOKEN")
      ->configurable(false);

  add_tls(pub, pub_opt.coordinator.tls);

  std::string status_coord;
  std::string status_token;
  bool status_json = false;
  auto* status = app.add_subcommand("status", "Print the coordinator's per-rank table.");
  status->add_option("--coordinator", status_coord, "coordinator host:port")
      ->envname("WSYNC_COORDINATOR")
      ->required();
  status->add_option("--token", status_token, token_help)
      ->envname("WSYNC_TOKEN")
      ->configurable(false);
  status->add_flag("--json", status_json, "print the DESIGN §11 status object");

  wsync::tls_settings status_tls;
  add_tls(status, status_tls);

  wsync::demo_options demo_opt;
  auto* demo = app.add_subcommand(
      "demo",
      "Local cluster demo: a coordinator, publisher ranks and consumer ranks as "
      "separate processes on loopback, versions over shared memory, then the per-rank "
      "table.");
  demo->add_option("--publishers", demo_opt.publishers, "publisher ranks")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  demo->add_option("--consumers", demo_opt.consumers, "consumer ranks")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  demo->add_option("--versions", demo_opt.versions, "versions to publish")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  demo->add_option("--layout", demo_opt.layout, "model layout or synthetic:<bytes>:<tensors>")
      ->capture_default_str();
  demo->add_flag("--json", demo_opt.json, "end with the DESIGN §11 status object");

  launcher_environment();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ConfigError& e) {
    // CLI11 words an unknown key in INI terms; say what it is in ours.
    std::string what = e.what();
    const std::string ini = "INI was not able to parse ";
    if (what.rfind(ini, 0) == 0) what = "config: unknown setting " + what.substr(ini.size());
    std::cerr << what << "\nRun with --help for more information.\n";
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (dump_config) {
    // Only the chosen subcommand's section; the token is never written (it is not configurable
    // from files either: it belongs in the environment).
    for (const auto* sub : app.get_subcommands()) {
      std::cout << "[" << sub->get_name() << "]\n" << sub->config_to_str(true, true);
    }
    return 0;
  }

  auto need_token = [](const std::string& token) {
    if (!token.empty()) return true;
    std::cerr << "wsync: no cluster token: pass --token or set WSYNC_TOKEN\n";
    return false;
  };
  if (app.got_subcommand("coordinator")) {
    if (!need_token(coord_opt.listen.token)) return 2;
    coord_opt.update_deadline = std::chrono::milliseconds(deadline_ms);
    coord_opt.router = wsync::fanout_router(*wsync::plan_shape_parse(coord_plan), coord_degree);
    return wsync::coordinator_run(coord_opt);
  }
  if (app.got_subcommand("consumer")) {
    if (const char* dev = std::getenv("WSYNC_SERVER_DEV_MODE"); dev && std::string(dev) == "1") {
      enable_http = true;
    }
    if (standalone) {
      if (!enable_http) {
        std::cerr << "wsync: --standalone: HTTP is this rank's only input; add "
                     "--enable-weight-transfer (or set WSYNC_SERVER_DEV_MODE=1)\n";
        return 2;
      }
      if (!cons_coord.empty()) {
        std::cerr << "wsync: --standalone: takes no --coordinator (unset WSYNC_COORDINATOR)\n";
        return 2;
      }
      http_opt.rank.rank = cons_opt.rank;
      http_opt.rank.node = cons_opt.node;
      http_opt.rank.verify = cons_opt.verify;
      return wsync::standalone_consumer_run(http_opt);
    }
    if (cons_coord.empty() || cons_opt.model_id.empty()) {
      std::cerr << "wsync: consumer: --coordinator and --model are required (or --standalone)\n";
      return 2;
    }
    if (!need_token(cons_opt.coordinator.token)) return 2;
    if (!coordinator_from(cons_coord, cons_opt.coordinator)) return 2;
    if (!transport_settings_from(cons_transport_settings, cons_opt.transport_settings)) return 2;
    if (enable_http) {
      http_opt.rank.node = cons_opt.node;
      return wsync::consumer_http_run(cons_opt, http_opt);
    }
    return wsync::consumer_run(cons_opt);
  }
  if (app.got_subcommand("publisher")) {
    if (pub_opt.rank < 0 || pub_opt.rank >= pub_opt.ranks) {
      std::cerr << "wsync: --rank: must be in [0, --ranks)\n";
      return 2;
    }
    if (pub_standalone) {
      if (manifest_out.empty()) {
        std::cerr << "wsync: --standalone: needs --manifest-out FILE\n";
        return 2;
      }
      return wsync::publisher_standalone_run(pub_opt, manifest_out);
    }
    if (pub_coord.empty()) {
      std::cerr << "wsync: publisher: --coordinator is required (or --standalone)\n";
      return 2;
    }
    if (!need_token(pub_opt.coordinator.token)) return 2;
    if (!transport_settings_from(pub_transport_settings, pub_opt.transport_settings)) return 2;
    if (!coordinator_from(pub_coord, pub_opt.coordinator)) return 2;
    pub_opt.interval = std::chrono::milliseconds(interval_ms);
    return wsync::publisher_run(pub_opt);
  }
  if (app.got_subcommand("status")) {
    if (!need_token(status_token)) return 2;
    wsync::endpoint ep;
    if (!coordinator_from(status_coord, ep)) return 2;
    ep.token = status_token;
    ep.tls = status_tls;
    std::string err;
    auto text = wsync::coordinator_status(ep, err);
    if (text.empty()) {
      std::cerr << "wsync status: " << err << "\n";
      return 1;
    }
    if (status_json) {
      std::cout << text << std::endl;
      return 0;
    }
    return wsync::status_print(text, std::cout);
  }
  if (app.got_subcommand("demo")) return wsync::demo_run(demo_opt, std::cout);

  if (app.got_subcommand("bench") && bench_opt.mode == "cluster") {
    wsync::cluster_bench_options cb;
    cb.consumers = bench_consumers;
    cb.repeat = bench_opt.smoke ? 3 : bench_opt.repeat;
    if (!bench_opt.layout.empty()) cb.layout = bench_opt.layout;
    return wsync::cluster_bench_run(cb, std::cout);
  }
  if (app.got_subcommand("bench") && bench_opt.mode == "fanout") {
    if (bench_opt.bytes) fanout_opt.bytes = bench_opt.bytes;
    if (bench_opt.ucx_chunk_bytes) fanout_opt.chunk_bytes = bench_opt.ucx_chunk_bytes;
    fanout_opt.repeat = bench_opt.smoke ? 1 : bench_opt.repeat;
    if (bench_opt.smoke && !bench_opt.bytes) fanout_opt.bytes = std::uint64_t{8} << 20;
    return wsync::fanout_bench_run(fanout_opt, std::cout);
  }
  if (app.got_subcommand("bench")) {
    bench_opt.verify = verify == "on";
    return wsync::bench_run(bench_opt, std::cout);
  }
  return 0;
}
