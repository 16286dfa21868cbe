// receive_tensors (wsync/transports/nccl_receiver.hpp): pure C++ over a broadcast_endpoint.

#include <algorithm>

#include "nccl/plan.hpp"
#include "wsync/transports/nccl_receiver.hpp"

namespace wsync::nccl {

result<received_tensors> receive_tensors(broadcast_endpoint& endpoint,
                                         std::span<const tensor_spec> specs, const packing& how,
                                         const checksum_method& method,
                                         std::chrono::steady_clock::time_point deadline) {
  if (auto why = endpoint.broken(); !why.empty()) {
    return make_error(errc::io_error, endpoint.describe() + ": the group was aborted: " + why);
  }
  received_tensors out;
  // Until every broadcast of the update was received, a failure here leaves rank 0's later
  // broadcasts unmatched: the next update's receives would take them. So the group is aborted.
  auto out_of_step = [&](error e) -> error {
    endpoint.abort(e.message);
    return e;
  };
  std::uint64_t total = 0;
  std::vector<std::uint64_t> sizes;
  for (const auto& s : specs) {
    out.offsets.push_back(total);
    sizes.push_back(s.nbytes);
    total += (s.nbytes + tensor_alignment - 1) / tensor_alignment * tensor_alignment;
  }
  auto segment = endpoint.allocate(std::max<std::uint64_t>(total, 1));
  if (!segment) return out_of_step(segment.error());
  out.segment = std::move(*segment);
  out.segment.nbytes = total;
  std::byte* base = out.segment.data;

  if (!how.packed) {
    for (std::size_t i = 0; i < specs.size(); ++i) {
      if (auto r = endpoint.receive({base + out.offsets[i], specs[i].nbytes}, deadline); !r) {
        return out_of_step(r.error());
      }
    }
  } else {
    auto groups = nccl_plan::vllm_packed_groups(sizes, how.buffer_bytes);
    if (!groups) return out_of_step(groups.error());
    std::uint64_t largest = 0;
    for (const auto& g : *groups) largest = std::max(largest, g.nbytes);
    // One staging buffer: the endpoint runs receives and copies in order, so group k + 1 lands
    // only after group k was copied out of it.
    auto staging = endpoint.allocate(std::max<std::uint64_t>(largest, 1));
    if (!staging) return out_of_step(staging.error());
    out.staging_bytes = largest;
    for (const auto& g : *groups) {
      if (auto r = endpoint.receive({staging->data, g.nbytes}, deadline); !r) {
        return out_of_step(r.error());
      }
      std::uint64_t at = 0;
      for (std::size_t i = g.first; i < g.first + g.count; ++i) {
        if (auto r = endpoint.copy(base + out.offsets[i], staging->data + at, specs[i].nbytes);
            !r) {
          return out_of_step(r.error());
        }
        at += specs[i].nbytes;
      }
    }
    // Keep the staging buffer until the copies out of it are done.
    if (auto r = endpoint.wait(deadline); !r) return out_of_step(r.error());
  }
  if (auto r = endpoint.wait(deadline); !r) return out_of_step(r.error());

  std::vector<std::span<const std::byte>> ranges;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ranges.emplace_back(base + out.offsets[i], specs[i].nbytes);
  }
  auto sums = endpoint.checksums(ranges, method);
  if (!sums) return sums.error();
  out.checksums = std::move(*sums);
  return out;
}

}  // namespace wsync::nccl
