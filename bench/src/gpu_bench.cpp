// The GPU modes of `wsync bench`: cuda-ipc, cuda-vmm and nccl print the row every mode prints,
// blocked with the precise cause where they cannot run; gpu-checksum measures the chunked
// checksum kernel against a device-to-device cudaMemcpy of the same bytes in the same run.

#include "gpu_bench.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <thread>

#include "wsync/bench/timing.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;

int row_print(std::ostream& out, json row, const std::string& status, const std::string& why) {
  row["status"] = status;
  row["blocker"] = status == "blocked" ? json(why) : json(nullptr);
  if (status == "fail") row["error"] = why;
  out << row.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
  return status == "pass" ? 0 : status == "fail" ? 1 : 2;
}

int checksum_mode(const bench_options& opt, std::ostream& out, json row) {
  if (auto r = gpu::ready(); !r) return row_print(out, row, "blocked", r.error().message);
  const std::uint64_t bytes = opt.bytes ? opt.bytes : opt.smoke ? (64ull << 20) : (1ull << 30);
  const std::uint64_t tensors = opt.tensors ? opt.tensors : 290;  // qwen2.5-0.5b has 290
  const std::uint64_t chunk = opt.checksum_chunk_bytes ? opt.checksum_chunk_bytes : (1ull << 20);
  const unsigned repeat = std::max(1u, opt.smoke ? std::min(opt.repeat, 3u) : opt.repeat);
  auto device = gpu::device_name();
  if (!device) return row_print(out, row, "fail", device.error().message);
  row["device"] = *device;
  row["bytes"] = bytes;
  row["tensors"] = tensors;
  row["chunk_bytes"] = chunk;
  row["repeat"] = repeat;
  auto src = gpu::device_buffer::make(bytes);
  if (!src) return row_print(out, row, "fail", src.error().message);
  auto dst = gpu::device_buffer::make(bytes);
  if (!dst) return row_print(out, row, "fail", dst.error().message);
  // Contents: a host pattern uploaded once (the hash does not care what the bytes are).
  {
    std::vector<unsigned char> host(std::min<std::uint64_t>(bytes, 64ull << 20));
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>(i * 131);
    for (std::uint64_t off = 0; off < bytes; off += host.size()) {
      auto n = std::min<std::uint64_t>(host.size(), bytes - off);
      if (auto up = src->upload(host.data(), n, off); !up) {
        return row_print(out, row, "fail", up.error().message);
      }
    }
  }
  // Tensors of equal size, 256-byte aligned as the publisher packs them.
  std::vector<gpu::device_range> ranges;
  const std::uint64_t each = bytes / tensors / 256 * 256;
  for (std::uint64_t i = 0; i < tensors; ++i) {
    ranges.push_back({static_cast<const unsigned char*>(src->data()) + i * each,
                      i + 1 == tensors ? bytes - i * each : each});
  }
  std::vector<double> copy_s, hash_s;
  for (unsigned k = 0; k < repeat + 1; ++k) {  // the first of each is a warm-up
    double t0 = now_s();
    if (auto c = gpu::copy_device(dst->data(), src->data(), bytes); !c) {
      return row_print(out, row, "fail", c.error().message);
    }
    double t1 = now_s();
    auto h = gpu::chunked_checksums(ranges, chunk);
    if (!h) return row_print(out, row, "fail", h.error().message);
    double t2 = now_s();
    if (k > 0) copy_s.push_back(t1 - t0), hash_s.push_back(t2 - t1);
  }
  const double copy_gbps = bytes / median(copy_s) / 1e9;
  const double hash_gbps = bytes / median(hash_s) / 1e9;
  row["checksum_gbps"] = hash_gbps;
  row["baseline"] = {{"name", "cudaMemcpy-d2d"}, {"gbps", copy_gbps}};
  row["ratio_to_baseline"] = hash_gbps / copy_gbps;
  return row_print(out, row, "pass", "");
}

}  // namespace

bool gpu_mode(const std::string& mode) {
  return mode == "cuda-ipc" || mode == "cuda-vmm" || mode == "nccl" || mode == "gpu-checksum";
}

int gpu_bench_run(const bench_options& opt, std::ostream& out) {
  json row = {{"mode", opt.mode}, {"status", "pass"}, {"blocker", nullptr}, {"smoke", opt.smoke}};
  row["env"] = {{"host", host_name()}, {"cores", std::thread::hardware_concurrency()}};
  if (opt.mode == "gpu-checksum") return checksum_mode(opt, out, row);
  auto t = make_transport(opt.mode);
  if (!t) {
    return row_print(out, row, t.error().code == errc::blocked ? "blocked" : "fail",
                     t.error().message);
  }
  return row_print(out, row, "fail", opt.mode + ": no benchmark for this transport yet");
}

}  // namespace wsync
