#include "wsync/bench/bench.hpp"
#include "wsync/manifest/checksum.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "baselines.hpp"
#include "gpu_bench.hpp"
#include "point_run.hpp"
#include "wsync/bench/rank_process.hpp"
#include "wsync/bench/timing.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/shared_memory.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace bench_detail {

// Set by SIGINT/SIGTERM: the run stops between updates and still cleans up (consumer released,
// slots unlinked), instead of leaving segments for the next publisher's sweep.
volatile sig_atomic_t interrupted = 0;
extern "C" void on_interrupt(int) {
  interrupted = 1;
}

void install_interrupt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a blocked poll returns EINTR and sees the flag
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

// Ends the consumer process: closes the channel (it exits when it reads the end), waits up to
// `grace` for it, then kills it. Reaped once; a no-op without one.
void consumer_stop(point_run& r, std::chrono::seconds grace, int* wstatus) {
  if (r.channel >= 0) ::close(r.channel);
  r.channel = -1;
  if (r.child <= 0) return;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  pid_t done = 0;
  while ((done = ::waitpid(r.child, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) {
    ::kill(r.child, SIGKILL);
    ::waitpid(r.child, &status, 0);
  }
  if (wstatus) *wstatus = status;
  r.child = -1;
}

}  // namespace bench_detail

namespace {

using namespace bench_detail;

// Prints the result row with its outcome; returns the exit code (0 pass, 1 fail, 2 blocked).
int row_finish(point_run& r, const std::string& status, const std::string& why) {
  r.row["status"] = status;
  if (status == "blocked") r.row["blocker"] = why;
  if (status == "fail") r.row["error"] = why;
  r.out << r.row.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
  return status == "pass" ? 0 : status == "fail" ? 1 : 2;
}

// The consumer's report on manifest `m`, from the consumer beside us or over the channel;
// nullopt with rr.error set when none came.
std::optional<json> report_receive(point_run& r, const weight_update_manifest& m) {
  if (r.local) return r.local->handle(m, 0);
  if (!channel_send(r.channel, {{"type", "update"}, {"manifest", manifest_to_json(m)}})) {
    return r.rr.error = "consumer process went away", std::nullopt;
  }
  auto report = channel_receive(r.channel, std::chrono::seconds(120), &interrupted);
  if (!report) return r.rr.error = "no report from the consumer process within 120 s", std::nullopt;
  return report;
}

// When one update's steps happened on the publisher's clock, and its own bookkeeping times.
struct update_times {
  double start = 0;      ///< publish called
  double published = 0;  ///< publish returned
  double received = 0;   ///< the consumer's report arrived
  double end = 0;        ///< acknowledge and releases recorded
  double ack_pub = 0;    ///< publisher's on_acknowledged
  double release_pub = 0;
};

// Records one timed update's stages and prints its sample row.
void sample_record(point_run& r, std::uint64_t version, const json& report,
                   const update_times& at) {
  const auto& ct = report["timings"];
  double ack = ct["ack"].get<double>() + at.ack_pub +
               (r.local ? 0.0 : std::max(0.0, at.received - report["ack_sent_s"].get<double>()));
  auto& s = r.s;
  s.publish.push_back(at.published - at.start);
  s.import.push_back(ct["import"].get<double>());
  s.verify.push_back(ct["verify"].get<double>());
  s.install.push_back(ct["install"].get<double>());
  s.ack.push_back(ack);
  s.release.push_back(ct["release"].get<double>() + at.release_pub);
  s.decode.push_back(ct["decode"].get<double>());
  s.total.push_back(at.end - at.start);
  r.out << json{{"event", "sample"},          {"mode", r.opt.mode},
                {"weight_version", version},  {"publish_s", at.published - at.start},
                {"import_s", ct["import"]},   {"verify_s", ct["verify"]},
                {"install_s", ct["install"]}, {"total_s", at.end - at.start}}
               .dump()
        << std::endl;
}

// One update end to end; `timed` updates are recorded after the warm-up ones. False with
// rr.error set when it failed.
bool update_once(point_run& r, std::uint64_t version, bool timed) {
  auto& rr = r.rr;
  if (interrupted) return rr.error = "interrupted", false;
  update_times at;
  at.start = now_s();
  auto m = r.publisher->publish(r.tensors, version, {consumer_rank}, {{"bench", "true"}});
  at.published = now_s();
  if (!m) return rr.error = m.error().message, false;
  for (const auto& seg : m->segments) r.largest_segment = std::max(r.largest_segment, seg.nbytes);
  auto report = report_receive(r, *m);
  if (!report) return false;
  at.received = now_s();
  if (!report->value("acknowledged", false)) {
    (void)r.publisher->on_rejected(m->update_id, consumer_rank, report->value("reason", ""));
    return rr.error = "update rejected: " + report->value("reason", std::string("?")), false;
  }
  double a0 = now_s();
  if (auto ok = r.publisher->on_acknowledged(m->update_id, consumer_rank); !ok) {
    return rr.error = ok.error().message, false;
  }
  at.ack_pub = now_s() - a0;
  double r0 = now_s();
  // The previous versions the consumer let go of, and this one when it read it only to copy
  // it (a device update installed into host memory): released_self.
  auto released = (*report)["released"].get<std::vector<std::string>>();
  if (report->value("released_self", false)) released.push_back(m->update_id);
  for (const auto& id : released) {
    if (auto ok = r.publisher->on_released(id, consumer_rank); !ok) {
      return rr.error = ok.error().message, false;
    }
  }
  at.end = now_s();
  at.release_pub = at.end - r0;
  rr.last_version = version;
  rr.active_version = report->value("active_weight_version", std::uint64_t{0});
  if (rr.active_version != version) {
    return rr.error = "consumer reports active_weight_version " +
                      std::to_string(rr.active_version) + " after installing " +
                      std::to_string(version),
           false;
  }
  if (timed) sample_record(r, version, *report, at);
  if (!r.first_import_s) r.first_import_s = (*report)["timings"]["import"].get<double>();
  return true;
}

// Warm-up, one update per slot (so every slot and every consumer mapping is faulted in before
// timing starts), then the timed updates.
bool updates_run(point_run& r) {
  bool ok = true;
  std::uint64_t version = 0;
  for (unsigned w = 0; ok && w < r.slots; ++w) ok = update_once(r, ++version, false);
  for (unsigned i = 0; ok && i < r.repeat; ++i) ok = update_once(r, ++version, true);
  return ok;
}

// GPU modes: the baseline's copy again, each after as long an idle spell as a publish had (the
// median time from a publish's return to the end of its update: the consumer's import, install
// and answer, and the publisher's bookkeeping; the next publish starts right after). A GPU that
// sat idle starts slower (the clocks ramp back up); this shows how much of publish_over_d2d is
// that, against the copy timed back to back. A sleep is not the consumer's work: the GPU idles
// in both, but the install's copy to host also runs in the gap.
void d2d_after_idle_add(point_run& r) {
  if (!r.gpu || !r.d2d_dst || r.s.total.empty()) return;
  std::vector<double> gaps;
  for (std::size_t i = 0; i < r.s.total.size(); ++i) gaps.push_back(r.s.total[i] - r.s.publish[i]);
  const double idle_s = median(gaps);
  auto d2d = d2d_seconds(r, r.repeat, false, idle_s);
  if (!d2d) {
    r.row["d2d_after_idle"] = {{"error", d2d.error().message}};
    return;
  }
  r.row["d2d_after_idle"] = {
      {"seconds", *d2d}, {"idle_s", idle_s}, {"gbps", gbps(r.src_bytes, *d2d)}};
  r.row["publish_over_d2d_after_idle"] = *d2d > 0 ? median(r.s.publish) / *d2d : 0;
}

// Shutdown: the consumer releases what it still holds, then every segment must be gone.
// Returns `ok`, turned false with rr.error set by the first leftover found.
bool run_shutdown(point_run& r, bool ok) {
  std::vector<std::string> last_held;
  if (r.local) {
    last_held = r.local->shutdown();
    r.local.reset();
  } else {
    channel_send(r.channel, {{"type", "stop"}});
    if (auto m = channel_receive(r.channel, std::chrono::seconds(120), &interrupted);
        m && (*m)["update_ids"].is_array()) {
      last_held = (*m)["update_ids"].get<std::vector<std::string>>();
    }
    int wstatus = 0;
    consumer_stop(r, std::chrono::seconds(30), &wstatus);
    if (ok && !(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0)) {
      ok = false, r.rr.error = "consumer process exited abnormally (or did not exit within 30 s)";
    }
  }
  for (const auto& id : last_held) (void)r.publisher->on_released(id, consumer_rank);
  if (ok && !r.publisher->held_updates().empty()) {
    ok = false, r.rr.error = "publisher still holds memory after every consumer released";
  }
  r.publisher.reset();
  r.t.reset();
  if (auto left = shm_segments_of({::getpid(), r.consumer_pid}); !left.empty()) {
    ok = false, r.rr.error = "left in /dev/shm: " + left.front();
  }
  return ok;
}

// Point to point: our import against ucx_perftest moving messages of our largest segment with
// the same transports and the operation our consumer used, measured now: one large message
// per operation, UCX's best case, where our consumer pulls chunks (the row's "pull"). The
// memcpy baseline moves to "memcpy_baseline". False with rr.error set when perftest could not
// measure: the row then has no baseline and no ratio, not the memcpy one under a ucx name.
bool ucx_baseline_add(point_run& r) {
  auto& row = r.row;
  std::string test = row["op"] == "get" ? "ucp_get" : "tag_bw";
  std::string why;
  auto base = perftest_gbps(r.opt.ucx_tls, test, r.largest_segment, &why, &interrupted);
  if (!base) {
    row["memcpy_baseline"] = row["baseline"];
    row["baseline"] = nullptr;
    row["ratio_to_baseline"] = nullptr;
    return r.rr.error = why, false;
  }
  double ours = gbps(r.bytes, median(r.s.import));
  row["import_gbps"] = ours;
  row["memcpy_baseline"] = row["baseline"];
  row["baseline"] = {{"name", "ucx_perftest"},
                     {"gbps", *base},
                     {"test", test},
                     {"message_bytes", r.largest_segment}};
  row["ratio_to_baseline"] = *base > 0 ? json(ours / *base) : json(nullptr);
  return true;
}

// The result row: medians, baselines and their ratios, the environment. Returns `ok`, false
// when the ucx baseline could not be measured.
bool row_fill(point_run& r, bool ok) {
  const auto& opt = r.opt;
  auto& row = r.row;
  const auto& s = r.s;
  const auto bytes = r.bytes;
  row["weight_version"] = r.rr.last_version;
  row["active_weight_version"] = r.rr.active_version;
  double publish = median(s.publish), verify = median(s.verify);
  row["timings_s"] = {{"publish", publish},       {"import", median(s.import)},
                      {"verify", verify},         {"install", median(s.install)},
                      {"ack", median(s.ack)},     {"release", median(s.release)},
                      {"total", median(s.total)}, {"decode", median(s.decode)}};
  const double memcpy_gbps = r.copy.memcpy_gbps;
  const double hash_gbps = r.copy.hash_gbps;
  row["baseline"] = {{"name", "memcpy"}, {"gbps", memcpy_gbps}};
  row["ratio_to_baseline"] =
      memcpy_gbps > 0 ? json(gbps(bytes, publish) / memcpy_gbps) : json(nullptr);
  if (r.ucx && ok) ok = ucx_baseline_add(r);
  if (r.gpu && r.d2d_s) {
    // Against cudaMemcpy device-to-device of the same bytes: publish copies them on the
    // publisher's stream and hashes them on the GPU.
    row["memcpy_baseline"] = row["baseline"];
    row["baseline"] = {
        {"name", "cudaMemcpy-d2d"}, {"seconds", *r.d2d_s}, {"gbps", gbps(r.src_bytes, *r.d2d_s)}};
    row["ratio_to_baseline"] = publish > 0 ? json(*r.d2d_s / publish) : json(nullptr);
    row["publish_over_d2d"] = *r.d2d_s > 0 ? publish / *r.d2d_s : 0;
    row["first_import_s"] = r.first_import_s.value_or(0);
    row["checksum"] = "xxh3-64-chunked";
  }
  if (r.nccl) {
    // No staging buffers: the sender broadcasts from the slot, the consumer receives into a
    // block of the same layout. A bound from the layout, not a reading of the device.
    row["extra_gpu_bytes_bound"] = {
        {"publisher", r.slots * r.src_bytes}, {"consumer", r.slots * r.src_bytes}, {"staging", 0}};
  }
  if (r.fmm && r.cp_s) {
    // Against cp of the same bytes into the same directory: publish time over cp time, as
    // bandwidths (> 1: publishing is faster than cp).
    row["memcpy_baseline"] = row["baseline"];
    row["baseline"] = {{"name", "cp"}, {"seconds", *r.cp_s}, {"gbps", gbps(r.src_bytes, *r.cp_s)}};
    row["ratio_to_baseline"] = publish > 0 ? json(*r.cp_s / publish) : json(nullptr);
    row["cp_sync_baseline"] = {{"name", "cp+sync -d"},
                               {"seconds", r.cp_sync_s.value_or(0)},
                               {"gbps", gbps(r.src_bytes, r.cp_sync_s.value_or(0))}};
    row["ratio_to_cp_sync"] =
        publish > 0 && r.cp_sync_s ? json(*r.cp_sync_s / publish) : json(nullptr);
  }
  row["publish_gbps"] = gbps(bytes, publish);
  row["verify_gbps"] = opt.verify ? gbps(bytes, verify) : 0;
  row["hash_baseline"] = {{"name", "xxh3-1thread"}, {"gbps", hash_gbps}};
  row["verify_ratio"] = opt.verify && hash_gbps > 0 ? gbps(bytes, verify) / hash_gbps : 0;
  row["copy_threads"] = r.copy_threads;
  std::string transport_notes =
      r.fmm ? "file-mmap: " + std::to_string(r.slots) + " buffers of pre-sized files in " +
                  r.fmm_dir.path + " (" + r.fs_type +
                  "); publish = copy into the writable mapping + fdatasync + STAMP and CURRENT "
                  "renames with fsyncs; the consumer is a separate process (pid " +
                  std::to_string(r.consumer_pid) + ") mapping the files read-only per update"
      : opt.mode == "local"
          ? "local-clone: publisher and consumer in one process; import copies"
          : opt.mode + ": " + std::to_string(r.slots) +
                "-slot pooled ring; consumer is a separate process (pid " +
                std::to_string(r.consumer_pid) + ")" +
                (r.ucx ? ", pulls chunks over UCX_TLS=" + opt.ucx_tls + " with " +
                             row["op"].get<std::string>() + " into its own registered slots"
                 : r.nccl ? ", on cuda:1: NCCL broadcasts from the publisher's slot into the "
                            "consumer's pooled blocks (import = the broadcast); publish = copy "
                            "into the slot and expose"
                 : r.gpu  ? ", opens each device slot once, zero-copy import; the publisher "
                            "copies device tensors on its stream and checksums on the GPU; the "
                            "reference runtime installs by copying to host memory"
                          : ", maps each slot once, zero-copy import");
  row["env"] = {{"host", host_name()},
                {"cores", std::thread::hardware_concurrency()},
                {"checksum_isa", std::string(checksum_isa())},
                {"transport_notes", transport_notes}};
  return ok;
}

int bench_one(const bench_options& opt, std::ostream& out) {
  point_run r(opt, out);
  if (auto stop = mode_check(r)) return row_finish(r, stop->status, stop->why);
  install_interrupt_handlers();
  if (auto stop = layout_choose(r)) return row_finish(r, stop->status, stop->why);
  if (auto stop = memory_check(r)) return row_finish(r, stop->status, stop->why);
  if (auto stop = dir_prepare(r)) return row_finish(r, stop->status, stop->why);
  // Fork the consumer before anything else exists in this process: no threads, no mappings.
  if (auto stop = consumer_start(r)) return row_finish(r, stop->status, stop->why);
  source_fill(r);
  // Baselines in the same run: single-thread memcpy into pre-faulted memory, single-thread xxh3.
  r.copy = copy_baselines_measure(r.source->data(), r.src_bytes, r.repeat);
  if (r.fmm) {
    // cp of the same bytes into the same directory, with and without syncing the copy.
    std::string why;
    r.cp_s = cp_seconds(r.fmm_dir.path, r.source->data(), r.src_bytes, r.repeat, false, &why);
    if (r.cp_s) {
      r.cp_sync_s = cp_seconds(r.fmm_dir.path, r.source->data(), r.src_bytes, r.repeat, true, &why);
    }
    if (!r.cp_s || !r.cp_sync_s) return row_finish(r, "fail", "cp baseline: " + why);
  }
  // A stop from here on leaves the consumer to ~point_run, which ends it (it holds nothing).
  if (auto stop = device_source_fill(r)) return row_finish(r, stop->status, stop->why);
  if (auto stop = publisher_start(r)) return row_finish(r, stop->status, stop->why);
  bool ok = updates_run(r);
  ok = run_shutdown(r, ok);
  if (ok) d2d_after_idle_add(r);
  ok = row_fill(r, ok);
  if (ok) return row_finish(r, "pass", "");
  // A baseline this machine cannot measure (no ucx_perftest) blocks the row, not fails it.
  const bool blocker = r.rr.error.rfind("blocked:", 0) == 0;
  return row_finish(r, blocker ? "blocked" : "fail", r.rr.error);
}

}  // namespace

int bench_run(const bench_options& opt, std::ostream& out) {
  // cuda-ipc, cuda-vmm and nccl run like the host transports, with device tensors and slots.
  if (gpu_mode(opt.mode) && opt.mode != "cuda-ipc" && opt.mode != "cuda-vmm" &&
      opt.mode != "nccl") {
    return gpu_bench_run(opt, out);
  }
  if (opt.mode != "ucx" || !opt.ucx_tls.empty()) return bench_one(opt, out);
  // One row over TCP, one over shared memory; the worst outcome is the run's.
  int worst = 0;
  for (const char* tls : {"tcp", "sm"}) {
    auto o = opt;
    o.ucx_tls = tls;
    int rc = bench_one(o, out);
    if (rc == 1 || (rc == 2 && worst == 0)) worst = rc;
  }
  return worst;
}

}  // namespace wsync
