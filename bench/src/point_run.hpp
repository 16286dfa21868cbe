#pragma once
// One point-to-point bench run (wsync bench --mode local|shared-memory|file-mmap|ucx|cuda-*):
// what its steps share. bench_setup.cpp sets a run up (mode, layout, memory, folder, consumer
// process, sources, publisher); bench.cpp runs its updates and writes its row.

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <system_error>
#include <vector>

#include "baselines.hpp"
#include "gpu_bench.hpp"
#include "wsync/bench/bench.hpp"
#include "wsync/bench/rank_process.hpp"
#include "wsync/sources/layouts.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync::bench_detail {

using json = nlohmann::json;

constexpr std::int32_t consumer_rank = 0;

// Set by SIGINT/SIGTERM (bench.cpp): the run stops between updates and still cleans up.
extern volatile sig_atomic_t interrupted;

// --- the publisher side and the run -----------------------------------------------------------

struct samples {
  std::vector<double> publish, import, verify, install, ack, release, total, decode;
};

struct run_result {
  std::string status = "pass";
  std::optional<std::string> blocker;
  std::string error;
  std::uint64_t last_version = 0;
  std::uint64_t active_version = 0;
};

// Why a run ended before its updates: "fail" or "blocked", and the reason.
struct run_stop {
  std::string status;
  std::string why;
};
inline run_stop failed(std::string why) {
  return {"fail", std::move(why)};
}
inline run_stop blocked(std::string why) {
  return {"blocked", std::move(why)};
}

// One point-to-point run: what its steps share. The resources are declared in the order the
// run sets them up, so an early return tears them down in reverse.
struct point_run;
void consumer_stop(point_run& r, std::chrono::seconds grace, int* wstatus = nullptr);

struct point_run {
  point_run(const bench_options& o, std::ostream& os) : opt(o), out(os) {}
  // Whatever way the run ends (a failure half way, an exception), its consumer goes with it.
  ~point_run() { consumer_stop(*this, std::chrono::seconds(0)); }
  point_run(const point_run&) = delete;
  point_run& operator=(const point_run&) = delete;

  const bench_options& opt;
  std::ostream& out;
  // "smoke": a quick run of small sizes, whose figures are not the machine's (caches hold them).
  json row = {{"mode", opt.mode}, {"status", "pass"}, {"blocker", nullptr}, {"smoke", opt.smoke}};
  bool ucx = opt.mode == "ucx";
  bool fmm = opt.mode == "file-mmap";
  /// Device tensors, device slots; nccl's consumer on the second GPU (NCCL refuses two ranks on
  /// one).
  bool gpu = opt.mode == "cuda-ipc" || opt.mode == "cuda-vmm" || opt.mode == "nccl";
  bool nccl = opt.mode == "nccl";
  bool two_processes = opt.mode != "local";
  std::string transport_name = ucx                   ? "ucx"
                               : fmm                 ? "file-mmap"
                               : gpu                 ? opt.mode
                               : opt.mode == "local" ? "local-clone"
                                                     : "shared-memory";
  // file-mmap: the run's directory, removed when the run ends (declared before the transport,
  // so it goes after it). The forked consumer leaves with _exit and never removes it.
  struct dir_guard {
    std::string path;
    ~dir_guard() {
      std::error_code ec;
      if (!path.empty()) std::filesystem::remove_all(path, ec);
    }
  } fmm_dir;
  std::string fs_type;
  std::optional<double> cp_s, cp_sync_s;
  model_layout layout;
  unsigned repeat = 0;
  unsigned slots = 0;
  std::uint64_t bytes = 0;  ///< the layout's, without alignment padding
  transport_options topts;

  int channel = -1;         ///< two processes: our end of the socket to the consumer process
  pid_t consumer_pid = -1;  ///< two processes: the consumer process (for notes and checks)
  pid_t child = -1;         ///< the same until it is reaped, then -1

  std::uint64_t src_bytes = 0;  ///< the source tensors, packed with the publisher's alignment
  std::optional<host_buffer> source;
  std::optional<gpu::device_buffer> device_source;  ///< gpu modes: the tensors, on the device
  std::vector<tensor_source> tensors;
  copy_baselines copy;
  std::optional<double> d2d_s;  ///< gpu modes: cudaMemcpy device-to-device of the source
  std::optional<gpu::device_buffer> d2d_dst;  ///< gpu modes: where the baseline copies to
  std::optional<double> first_import_s;       ///< the first update's import (opens the slot)

  std::unique_ptr<transport> t;
  unsigned copy_threads = 1;
  std::unique_ptr<weight_publisher> publisher;
  std::unique_ptr<bench_consumer> local;  ///< local mode: the consumer, in this process

  samples s;
  run_result rr;
  std::uint64_t largest_segment = 0;
};

// --- the run's set-up steps (bench_setup.cpp), in the order the run takes them; each returns
// why the run stops there, or nothing.

std::optional<run_stop> mode_check(const point_run& r);
std::optional<run_stop> layout_choose(point_run& r);
std::optional<run_stop> memory_check(const point_run& r);
std::optional<run_stop> dir_prepare(point_run& r);
std::optional<run_stop> consumer_start(point_run& r);
void source_fill(point_run& r);
std::optional<run_stop> device_source_fill(point_run& r);
std::optional<run_stop> publisher_start(point_run& r);

/// GPU modes: the median time of `rounds` copies of the device source into the baseline's
/// buffer, each after `idle_s` of sleep; `warm_up`: one untimed copy first.
result<double> d2d_seconds(point_run& r, unsigned rounds, bool warm_up, double idle_s);

}  // namespace wsync::bench_detail
