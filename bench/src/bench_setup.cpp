// The set-up steps of a point-to-point bench run (point_run.hpp): the mode, the layout, room in
// memory (and on disk for file-mmap), the consumer process, the source tensors and the
// publisher.

#include <sys/socket.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <thread>

#include "point_run.hpp"
#include "wsync/bench/timing.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/ucx.hpp"

namespace wsync::bench_detail {
namespace {

std::uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

}  // namespace

std::optional<run_stop> mode_check(const point_run& r) {
  const auto& opt = r.opt;
  if (opt.mode != "local" && opt.mode != "shared-memory" && opt.mode != "ucx" &&
      opt.mode != "file-mmap" && !r.gpu) {
    return failed("unknown mode \"" + opt.mode +
                  "\" (known: local, shared-memory, file-mmap, ucx, cuda-ipc, cuda-vmm, nccl)");
  }
  if (r.ucx && !transport_known("ucx")) {
    return blocked(
        "blocked: this build has no ucx transport (libucx-dev was not found "
        "when it was configured)");
  }
  return std::nullopt;
}

// Layout: a named model, a synthetic size, or the smoke default; with the run's sizes and the
// transport options they imply.
std::optional<run_stop> layout_choose(point_run& r) {
  const auto& opt = r.opt;
  if (!opt.layout.empty()) {
    auto l = layout_find(opt.layout);
    if (!l) {
      std::string known;
      for (const auto& n : layout_names()) known += (known.empty() ? "" : ", ") + n;
      return failed("unknown layout \"" + opt.layout + "\" (known: " + known + ")");
    }
    r.layout = *l;
  } else if (opt.bytes > 0 || opt.smoke) {
    r.layout = layout_synthetic(opt.bytes ? opt.bytes : 8u << 20, opt.tensors ? opt.tensors : 16);
  } else {
    r.layout = *layout_find("qwen2.5-0.5b");
  }
  r.repeat = opt.smoke ? std::min(opt.repeat, 3u) : std::max(opt.repeat, 1u);
  r.slots = std::max(opt.slots, 2u);
  r.bytes = r.layout.bytes();
  r.row["layout"] = r.layout.name;
  r.row["tensors"] = r.layout.tensors.size();
  r.row["bytes"] = r.bytes;
  r.row["repeat"] = r.repeat;
  r.row["verify"] = opt.verify;

  if (r.two_processes && !r.fmm) r.topts["slots"] = std::to_string(r.slots);
  if (r.nccl) r.topts["consumers"] = std::to_string(consumer_rank);
  if (r.fmm) r.topts["buffers"] = std::to_string(r.slots);
  if (r.ucx) {
    r.topts["tls"] = opt.ucx_tls;
    if (opt.ucx_chunk_bytes) r.topts["chunk_bytes"] = std::to_string(opt.ucx_chunk_bytes);
    r.row["ucx_tls"] = opt.ucx_tls;
    r.row["op"] = ucx_auto_op(opt.ucx_tls);
    // How our consumer moves the bytes, beside the baseline's one message per segment.
    r.row["pull"] = {
        {"chunk_bytes", opt.ucx_chunk_bytes ? opt.ucx_chunk_bytes : ucx_default_chunk_bytes},
        {"window", ucx_default_window}};
  }
  return std::nullopt;
}

// Source tensors + a memcpy destination + every slot of the ring (ucx: on both sides) must fit.
std::optional<run_stop> memory_check(const point_run& r) {
  std::uint64_t need = 0;
  const bool huge = __builtin_mul_overflow(r.bytes, 2 + r.slots * (r.ucx ? 2 : 1), &need);
  std::uint64_t avail = mem_available();
  if (huge) need = ~std::uint64_t{0};
  if ((avail && need > avail / 10 * 9) || huge) {
    return blocked("blocked: layout " + r.layout.name + " needs about " +
                   std::to_string(need >> 20) + " MiB (source, baseline and " +
                   std::to_string(r.slots) + " slots of " + std::to_string(r.bytes >> 20) +
                   " MiB) but only " + std::to_string(avail >> 20) + " MiB are available");
  }
  return std::nullopt;
}

// file-mmap: a fresh directory inside --dir, with room for the buffers and the cp baseline's
// two files.
std::optional<run_stop> dir_prepare(point_run& r) {
  if (!r.fmm) return std::nullopt;
  // Not "wsync-*": in /dev/shm those names belong to the shared-memory leak checks.
  std::string tmpl = r.opt.dir + "/fmm-bench-XXXXXX";
  if (!::mkdtemp(tmpl.data())) {
    return failed("--dir " + r.opt.dir + ": mkdtemp: " + std::strerror(errno));
  }
  r.fmm_dir.path = tmpl;
  r.topts["dir"] = tmpl;
  r.row["dir"] = tmpl;
  std::ifstream mounts("/proc/self/mounts");
  std::string dev, at, type, rest;
  std::size_t best = 0;
  auto canonical = std::filesystem::canonical(tmpl).string();
  while (mounts >> dev >> at >> type && std::getline(mounts, rest)) {
    if (canonical.rfind(at, 0) == 0 && at.size() >= best) best = at.size(), r.fs_type = type;
  }
  r.row["fs_type"] = r.fs_type;
  struct statvfs sv {};
  std::uint64_t need = r.bytes * (r.slots + 2);
  if (::statvfs(tmpl.c_str(), &sv) == 0 &&
      static_cast<std::uint64_t>(sv.f_bavail) * sv.f_frsize < need / 10 * 11) {
    return blocked("blocked: --dir " + r.opt.dir + " has " +
                   std::to_string(static_cast<std::uint64_t>(sv.f_bavail) * sv.f_frsize >> 20) +
                   " MiB free; the run needs about " + std::to_string(need >> 20) + " MiB (" +
                   std::to_string(r.slots) + " buffers and the cp baseline's two files)");
  }
  return std::nullopt;
}

// Two processes: forks the consumer and waits for its "ready".
std::optional<run_stop> consumer_start(point_run& r) {
  if (!r.two_processes) return std::nullopt;
  int fds[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    return failed(std::string("socketpair: ") + std::strerror(errno));
  }
  // Everything the child needs is made before the fork: nothing that can throw runs in the child
  // before it is in bench_consumer_process (an exception would unwind into our code there).
  auto topts = r.topts;
  if (r.nccl) topts["device"] = "1";
  r.out.flush();
  r.child = r.consumer_pid = ::fork();
  if (r.child < 0) return failed(std::string("fork: ") + std::strerror(errno));
  if (r.child == 0) {
    // A terminal's Ctrl-C reaches the whole group: the parent stops the consumer itself.
    ::signal(SIGINT, SIG_IGN);
    ::close(fds[0]);
    bench_consumer_process(fds[1], r.opt.verify, r.transport_name, topts, consumer_rank);
  }
  ::close(fds[1]);
  r.channel = fds[0];
  auto ready = channel_receive(r.channel, std::chrono::seconds(60), &interrupted);
  if (!ready || (*ready)["type"] != "ready") {
    consumer_stop(r, std::chrono::seconds(5));
    std::string reason = ready ? ready->value("reason", ready->dump()) : "no answer";
    // The consumer makes its transport first: a GPU transport this machine cannot run says so.
    if (reason.rfind("blocked:", 0) == 0) {
      if (r.nccl && reason.find("no CUDA device 1") != std::string::npos) {
        reason +=
            "; the nccl bench puts its consumer on a second GPU, as NCCL refuses two ranks "
            "on one";
      }
      return blocked(reason);
    }
    return failed("the consumer process did not start: " + reason);
  }
  return std::nullopt;
}

// Source tensors, packed back to back with the publisher's alignment.
void source_fill(point_run& r) {
  std::vector<std::uint64_t> offsets;
  for (const auto& t : r.layout.tensors) {
    offsets.push_back(r.src_bytes);
    r.src_bytes =
        (r.src_bytes + t.nbytes() + tensor_alignment - 1) / tensor_alignment * tensor_alignment;
  }
  r.source.emplace(r.src_bytes);
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  pattern_fill(r.source->data(), r.src_bytes, state);
  for (std::size_t i = 0; i < r.layout.tensors.size(); ++i) {
    const auto& t = r.layout.tensors[i];
    r.tensors.push_back({t.name, t.dtype, t.shape, {}, r.source->data() + offsets[i], t.nbytes()});
  }
}

// GPU modes: the source tensors uploaded to device 0 (a trainer's parameters), and the
// device-to-device cudaMemcpy of the same bytes, timed like publish (median of `repeat`).
std::optional<run_stop> device_source_fill(point_run& r) {
  if (!r.gpu) return std::nullopt;
  auto name = gpu::device_name();
  if (!name) return blocked(name.error().message);
  r.row["device"] = *name;
  // The source, the baseline's copy of it and every slot (plus the checksum's scratch pool) on
  // cuda:0: a layout that cannot fit is blocked with the sizes, as on the host.
  const std::uint64_t need = r.src_bytes * (2 + r.slots) + (std::uint64_t{256} << 20);
  if (auto free = gpu::memory_free(0); free && *free < need) {
    return blocked("blocked: layout " + r.layout.name + " needs about " +
                   std::to_string(need >> 20) + " MiB on cuda:0 (source, baseline copy and " +
                   std::to_string(r.slots) + " slots of " + std::to_string(r.src_bytes >> 20) +
                   " MiB) but only " + std::to_string(*free >> 20) + " MiB are free");
  }
  auto src = gpu::device_buffer::make(r.src_bytes);
  if (!src) return failed(src.error().message);
  if (auto up = src->upload(r.source->data(), r.src_bytes); !up) return failed(up.error().message);
  auto dst = gpu::device_buffer::make(r.src_bytes);
  if (!dst) return failed(dst.error().message);
  for (auto& t : r.tensors) {
    t.data = static_cast<const std::byte*>(src->data()) + (t.data - r.source->data());
    t.cuda_device = 0;
  }
  r.device_source = std::move(*src);
  r.d2d_dst = std::move(*dst);
  auto d2d = d2d_seconds(r, r.repeat, true, 0.0);
  if (!d2d) return failed(d2d.error().message);
  r.d2d_s = *d2d;
  return std::nullopt;
}

result<double> d2d_seconds(point_run& r, unsigned rounds, bool warm_up, double idle_s) {
  std::vector<double> times;
  for (unsigned k = warm_up ? 0 : 1; k <= rounds; ++k) {
    if (idle_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(idle_s));
    double t0 = now_s();
    if (auto c = gpu::copy_device(r.d2d_dst->data(), r.device_source->data(), r.src_bytes); !c) {
      return c.error();
    }
    if (k > 0) times.push_back(now_s() - t0);
  }
  return median(times);
}

// The transport, its publisher and, in local mode, the consumer beside it.
std::optional<run_stop> publisher_start(point_run& r) {
  auto t = make_transport(r.transport_name, r.topts);
  if (!t) return failed(t.error().message);
  r.t = std::move(*t);
  auto pt = r.t->make_publisher();
  if (!pt) return failed(pt.error().message);
  publisher_config pcfg;
  pcfg.model_id = r.layout.name;
  pcfg.copy_threads = std::max(r.opt.copy_threads, 1u);
  pcfg.slot_wait = std::chrono::seconds(60);
  if (r.opt.checksum_chunk_bytes) {
    pcfg.checksum = {checksum_algorithm::xxh3_64_chunked, r.opt.checksum_chunk_bytes};
  }
  r.copy_threads = pcfg.copy_threads;
  r.publisher = std::make_unique<weight_publisher>(std::move(*pt), std::string(r.t->name()), pcfg);

  if (r.opt.mode == "local") {
    auto ct = r.t->make_consumer();
    if (!ct) return failed(ct.error().message);
    r.local = std::make_unique<bench_consumer>(std::move(*ct), r.opt.verify, consumer_rank);
  }
  return std::nullopt;
}

}  // namespace wsync::bench_detail
