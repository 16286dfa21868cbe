#include "nccl/plan.hpp"

#include <algorithm>
#include <string>

namespace wsync::nccl_plan {

result<std::vector<slice>> segment_slices(std::span<const std::uint64_t> segment_bytes,
                                          std::uint64_t bucket_bytes, unsigned buckets) {
  constexpr std::uint64_t min_bucket = std::uint64_t{1} << 20;
  constexpr std::uint64_t max_bucket = std::uint64_t{16} << 30;
  if (bucket_bytes < min_bucket || bucket_bytes > max_bucket) {
    return make_error(errc::invalid_argument, "nccl: bucket_bytes " + std::to_string(bucket_bytes) +
                                                  " is outside 1 MiB to 16 GiB");
  }
  if (buckets < 1 || buckets > 16) {
    return make_error(errc::invalid_argument,
                      "nccl: buckets " + std::to_string(buckets) + " is outside 1 to 16");
  }
  std::vector<slice> out;
  unsigned stream = 0;
  for (std::size_t s = 0; s < segment_bytes.size(); ++s) {
    for (std::uint64_t off = 0; off < segment_bytes[s]; off += bucket_bytes) {
      out.push_back({s, off, std::min(bucket_bytes, segment_bytes[s] - off), stream});
      stream = (stream + 1) % buckets;
    }
  }
  return out;
}

result<std::vector<group>> vllm_packed_groups(std::span<const std::uint64_t> tensor_bytes,
                                              std::uint64_t buffer_bytes) {
  if (buffer_bytes == 0) {
    return make_error(errc::invalid_argument, "packed_buffer_size_bytes: must be positive");
  }
  std::vector<group> out;
  group g;
  for (std::size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (g.count == 0) g.first = i;
    ++g.count;
    g.nbytes += tensor_bytes[i];
    if (g.nbytes > buffer_bytes) {  // the tensor that crossed the bound goes with this group
      out.push_back(g);
      g = {};
    }
  }
  if (g.count > 0) out.push_back(g);
  return out;
}

std::uint64_t staging_bytes(std::span<const group> groups, unsigned buffers) {
  std::uint64_t largest = 0;
  for (const auto& g : groups) largest = std::max(largest, g.nbytes);
  const auto in_flight = std::min<std::uint64_t>(buffers, groups.size());
  return largest * in_flight;
}

}  // namespace wsync::nccl_plan
