// `wsync bench`: one subcommand, three drivers (bench/): point to point, cluster, fan-out.

#include <algorithm>
#include <charconv>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <streambuf>

#include "common.hpp"
#include "subcommand.hpp"
#include "wsync/bench/bench.hpp"
#include "wsync/bench/cluster_bench.hpp"
#include "wsync/bench/fanout_bench.hpp"
#include "wsync/sources/layouts.hpp"

namespace wsync::cli {
namespace {

// Flags shared by the modes live in `point` and are handed on to the mode that runs.
struct bench_state {
  bench_options point;
  cluster_bench_options cluster;
  fanout_bench_options fanout;
};

using json = nlohmann::json;

std::string row_text(const json& row) {
  return row.dump(-1, ' ', false, json::error_handler_t::replace);
}

// Passes the rows on as they come and keeps each result row's outcome (sample lines are not
// result rows), so that a run of several rows can end with its own.
class row_tee final : public std::streambuf {
 public:
  explicit row_tee(std::ostream& out) : out_(out) {}
  std::vector<json> outcomes;  ///< {"status", "blocker", "error"} of each result row

 protected:
  int overflow(int c) override {
    if (c == traits_type::eof()) return traits_type::not_eof(c);
    out_.put(static_cast<char>(c));
    if (c != '\n') {
      line_ += static_cast<char>(c);
      return c;
    }
    auto row = json::parse(line_, nullptr, false);
    line_.clear();
    // Samples are not results; other events (fanout's kill_leader row) are.
    if (row.is_object() && row.contains("status") && row.value("event", "") != "sample") {
      outcomes.push_back({{"status", row["status"]},
                          {"blocker", row.value("blocker", json())},
                          {"error", row.value("error", json())}});
    }
    return c;
  }
  int sync() override {
    out_.flush();
    return 0;
  }

 private:
  std::ostream& out_;
  std::string line_;
};

// Options a mode would silently ignore are refused instead, naming what the mode reads.
std::string misplaced_option(const bench_state& s) {
  const bench_options& p = s.point;
  const bench_state d;  // compared with defaults, so that a --dump-config file loads again
  const bool cluster = p.mode == "cluster", fanout = p.mode == "fanout";
  auto first_set = [](std::initializer_list<std::pair<bool, const char*>> flags) -> std::string {
    for (const auto& [set, name] : flags) {
      if (set) return name;
    }
    return "";
  };
  if (cluster || fanout) {
    // The cluster and fan-out drivers read none of the point-to-point settings.
    auto flag = first_set(
        {{p.verify != d.point.verify, "--verify"},
         {p.copy_threads != d.point.copy_threads, "--copy-threads"},
         {p.slots != d.point.slots, "--slots"},
         {p.dir != d.point.dir, "--dir"},
         {p.ucx_tls != d.point.ucx_tls, "--ucx-tls"},
         {p.checksum_chunk_bytes != d.point.checksum_chunk_bytes, "--checksum-chunk-bytes"},
         {cluster && p.ucx_chunk_bytes != d.point.ucx_chunk_bytes, "--ucx-chunk-bytes"}});
    if (!flag.empty()) return flag + " does not apply to --mode " + p.mode;
  }
  if (!cluster) {
    auto flag = first_set({{s.cluster.consumers != d.cluster.consumers, "--consumers"},
                           {s.cluster.processes != d.cluster.processes, "--processes"}});
    if (!flag.empty()) return flag + " applies to --mode cluster only";
  }
  if (!fanout) {
    const auto& f = s.fanout;
    const auto& df = d.fanout;
    auto flag = first_set({{f.nodes != df.nodes, "--nodes"},
                           {f.ranks_per_node != df.ranks_per_node, "--ranks-per-node"},
                           {f.plans != df.plans, "--plan"},
                           {f.degree != df.degree, "--degree"},
                           {f.rate_mbit != df.rate_mbit, "--rate-mbit"},
                           {f.kill_leader != df.kill_leader, "--kill-leader"}});
    if (!flag.empty()) return flag + " applies to --mode fanout only";
  }
  if (p.mode == "cluster" && p.bytes) {
    return "--bytes/--tensors do not apply to --mode cluster (it publishes --layout, default "
           "synthetic:65536:4)";
  }
  if (p.mode == "gpu-checksum" && !p.layout.empty()) {
    return "--layout does not apply to --mode gpu-checksum (it hashes --bytes, default 1 GiB, in "
           "--tensors pieces, default 290)";
  }
  if (p.mode == "fanout" && (!p.layout.empty() || p.tensors)) {
    return "--layout/--tensors do not apply to --mode fanout (it publishes --bytes in 16 "
           "tensors)";
  }
  return "";
}

int bench_mode(bench_state& s, std::ostream& out) {
  const bench_options& p = s.point;
  if (p.mode == "cluster") {
    s.cluster.repeat = p.smoke ? std::min(p.repeat, 3u) : p.repeat;
    s.cluster.smoke = p.smoke;
    if (!p.layout.empty()) s.cluster.layout = p.layout;
    return cluster_bench_run(s.cluster, out);
  }
  if (p.mode == "fanout") {
    if (p.bytes) s.fanout.bytes = p.bytes;
    if (p.ucx_chunk_bytes) s.fanout.chunk_bytes = p.ucx_chunk_bytes;
    s.fanout.repeat = p.smoke ? 1 : p.repeat;
    s.fanout.smoke = p.smoke;
    if (p.smoke && !p.bytes) s.fanout.bytes = std::uint64_t{8} << 20;
    return fanout_bench_run(s.fanout, out);
  }
  return bench_run(p, out);
}

// Runs the mode. Every run ends with a line that is its result (docs/benchmark.md): a mode that
// printed several rows (ucx's two transports, one per cluster size or fan-out plan) gets a last
// line {"event": "result"} with the worst outcome; a failure that escaped the mode still prints
// a row.
int bench_dispatch(bench_state& s) {
  const bench_options& p = s.point;
  row_tee tee(std::cout);
  std::ostream out(&tee);
  auto fail_row = [&](const std::string& why) {
    out << row_text({{"mode", p.mode},
                     {"smoke", p.smoke},
                     {"status", "fail"},
                     {"blocker", nullptr},
                     {"error", why}})
        << std::endl;
    return 1;
  };
  int code = 0;
  if (auto why = misplaced_option(s); !why.empty()) return fail_row(why);
  try {
    code = bench_mode(s, out);
  } catch (const std::exception& e) {
    code = fail_row(std::string("bench stopped: ") + e.what());
  }
  out.flush();
  if (tee.outcomes.size() < 2) return code;
  json worst = tee.outcomes.front();
  auto rank = [](const json& o) {
    return o["status"] == "fail" ? 2 : o["status"] == "blocked" ? 1 : 0;
  };
  json statuses = json::array();
  for (const auto& o : tee.outcomes) {
    statuses.push_back(o["status"]);
    if (rank(o) > rank(worst)) worst = o;
  }
  json result = {{"event", "result"},
                 {"mode", p.mode},
                 {"smoke", p.smoke},
                 {"status", worst["status"]},
                 {"blocker", worst["blocker"]},
                 {"rows", tee.outcomes.size()},
                 {"statuses", statuses}};
  if (!worst["error"].is_null()) result["error"] = worst["error"];
  std::cout << row_text(result) << std::endl;
  const int summary = rank(worst) == 2 ? 1 : rank(worst) == 1 ? 2 : 0;
  // The worse of the two (1 over 2 over 0): the mode may know of a failure no row shows.
  return code == 1 || summary == 1 ? 1 : std::max(code, summary);
}

// The flags of every mode but fanout.
void add_point_flags(CLI::App* bench, bench_state& s) {
  bench_options& opt = s.point;
  bench
      ->add_option("--mode", opt.mode,
                   "local: publisher and consumer in one process over local-clone; "
                   "shared-memory: the consumer is a separate process importing zero-copy; "
                   "file-mmap: the same through files in a fresh folder inside --dir, against "
                   "the real cp (and cp + sync -d) of the same bytes into that folder; "
                   "ucx: the consumer is a separate process pulling over UCX on loopback, "
                   "against ucx_perftest with the same transports, one message per segment (our "
                   "consumer pulls chunks: the row's pull); "
                   "cluster: control-plane overhead per update for each --consumers count; "
                   "fanout: time to commit across emulated nodes (network namespaces with "
                   "rate-limited links, root only) for each --plan, against one consumer; "
                   "gpu-checksum: the chunked checksum kernel against a device-to-device "
                   "cudaMemcpy of the same bytes; cuda-ipc, cuda-vmm, nccl: the GPU transports "
                   "(a blocked row names why they cannot run here)")
      ->check(CLI::IsMember({"local", "shared-memory", "file-mmap", "ucx", "cluster", "fanout",
                             "gpu-checksum", "cuda-ipc", "cuda-vmm", "nccl"}))
      ->capture_default_str();
  bench->add_flag("--smoke", opt.smoke,
                  "quick run for tests: 8 MiB in 16 tensors (unless --layout/--bytes), at most "
                  "3 repeats");
  auto* layout = bench->add_option(
      "--layout", opt.layout,
      "model whose checkpoint layout (tensor names, shapes, bf16) to publish, with random "
      "contents: " +
          join(layout_names()) +
          " (default qwen2.5-0.5b); cluster mode takes synthetic:BYTES:TENSORS as well (its "
          "default synthetic:65536:4); not for gpu-checksum or fanout");
  auto* bytes = bench
                    ->add_option("--bytes", opt.bytes,
                                 "publish a synthetic update of this many bytes instead of a "
                                 "model layout")
                    ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 44));
  bench
      ->add_option("--tensors", opt.tensors,
                   "number of tensors of the synthetic update (default 16; gpu-checksum: 290)")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1000000}))
      ->needs(bytes);
  layout->excludes(bytes);
  bench
      ->add_option("--repeat", opt.repeat,
                   "timed updates; timings are their medians (cluster mode also gives the "
                   "coordinator's RSS after 100 updates and at the end: run 10000 to see it flat)")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  bench
      ->add_option_function<std::string>(
          "--verify", [&opt](const std::string& v) { opt.verify = v == "on"; },
          "recompute every tensor checksum on import")
      ->check(CLI::IsMember({"on", "off"}))
      ->default_str(opt.verify ? "on" : "off");
  bench
      ->add_option("--copy-threads", opt.copy_threads,
                   "threads that copy and checksum tensors into the segments")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  bench
      ->add_option("--consumers", s.cluster.consumers,
                   "cluster mode: consumer rank counts to measure, e.g. 1,8,64 (the 1-rank "
                   "baseline is always measured)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1024));
  bench
      ->add_option("--processes", s.cluster.processes,
                   "cluster mode: consumer processes the ranks are spread over, as engines with "
                   "one process per GPU run them; above 1, each count is measured without node "
                   "leaders (the baseline) and with them")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  bench
      ->add_option("--slots", opt.slots,
                   "shared-memory ring size, or file-mmap buffers (at least 2: the active version "
                   "and the incoming one)")
      ->check(CLI::Range(2u, 64u))
      ->capture_default_str();
  bench
      ->add_option("--dir", opt.dir,
                   "file-mmap mode: where the run makes its folder (removed afterwards): "
                   "/dev/shm for tmpfs, /var/tmp for a disk, an NFS mount for NFS")
      ->check(CLI::ExistingDirectory)
      ->capture_default_str();
  bench->add_option("--ucx-tls", opt.ucx_tls,
                    "ucx mode: UCX_TLS for both processes and the baseline, e.g. tcp, sm, "
                    "posix,cma (default: one row for tcp, one for sm)");
}

void add_fanout_flags(CLI::App* bench, fanout_bench_options& fanout) {
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
                   "(publisher to every node's leader), naive (publisher to every rank: measured "
                   "first, the others' ratio_to_naive)")
      ->delimiter(',')
      ->check(CLI::IsMember({"tree", "chain", "star", "naive"}))
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
}

}  // namespace

subcommand add_bench(CLI::App& app) {
  auto state = std::make_shared<bench_state>();
  auto* bench = app.add_subcommand(
      "bench",
      "Time one weight update end to end (publish, import, verify, install, ack, release) and "
      "print JSON rows: one per timed update, the result row last. Baselines (single-thread "
      "memcpy into pre-faulted memory, single-thread xxh3) are measured in the same run.");
  bench->footer(
      "CPU hashing runs with the widest instruction set this CPU has (each row's "
      "env.checksum_isa); WSYNC_CHECKSUM_ISA=sse2|avx2|avx512 picks another, e.g. to measure one "
      "against the other.");
  add_point_flags(bench, *state);
  add_fanout_flags(bench, state->fanout);
  // Read by ucx and fanout modes alike, so it follows both groups.
  bench
      ->add_option("--ucx-chunk-bytes", state->point.ucx_chunk_bytes,
                   "ucx and fanout modes: bytes per pulled chunk (default 4 MiB for ucx, 256 KiB "
                   "for fanout)")
      ->check(CLI::Range(std::uint64_t{4096}, std::uint64_t{1} << 30));
  bench
      ->add_option("--checksum-chunk-bytes", state->point.checksum_chunk_bytes,
                   "checksum tensors by the chunked method (xxh3-64 of each chunk of this many "
                   "bytes, then of the digests), so that one large tensor verifies on several "
                   "threads; a power of two from 4096 to 2^30. Default: xxh3-64 of whole tensors "
                   "(gpu-checksum mode: 1 MiB)")
      ->check(CLI::Range(std::uint64_t{4096}, std::uint64_t{1} << 30) &
              CLI::Validator(
                  [](const std::string& text) {
                    // Runs even when the range check failed: parse without throwing.
                    std::uint64_t v = 0;
                    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
                    if (ec != std::errc() || end != text.data() + text.size()) {
                      return std::string("not a number");
                    }
                    return (v & (v - 1)) == 0 ? std::string() : std::string("not a power of two");
                  },
                  "POWER OF TWO"));
  return {bench, [state] {
            return bench_dispatch(*state);
          }};
}

}  // namespace wsync::cli
