#pragma once
// How an update crosses an NCCL communicator, as plain arithmetic (no NCCL, no CUDA): the parts
// of the nccl transport that CI can test on machines without a GPU.
//
// - wsync publishers broadcast the manifest's segments, which consumers receive into segments of
//   the same layout: no packing on either side. A broadcast moves one contiguous range, at most
//   bucket_bytes long, so a segment goes out in slices, taking turns over `buffers` streams
//   (slice k+1 is posted while slice k is on the wire). Extra memory: none beyond the segments.
// - A vLLM NCCL trainer (update_info with names / dtype_names / shapes and packed=true) packs
//   tensors in names order into groups: a group takes tensors until its size first exceeds
//   packed_buffer_size_bytes (the tensor that crosses the bound stays in it), and each group is
//   one broadcast of exactly its bytes, unpadded. A receiver must group the same way to post
//   receives of the right sizes; packed_num_buffers groups are in flight at once, so the staging
//   memory is packed_num_buffers x the largest group.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "wsync/manifest/result.hpp"

namespace wsync::nccl_plan {

/// One broadcast of wsync's own layout: `nbytes` at `offset` of segment `segment`, on stream
/// `stream` (slices take the `buckets` streams in turn).
struct slice {
  std::size_t segment = 0;
  std::uint64_t offset = 0;
  std::uint64_t nbytes = 0;
  unsigned stream = 0;
  friend bool operator==(const slice&, const slice&) = default;
};

/// The broadcasts of segments of `segment_bytes`, in order (the transport's options
/// bucket_bytes: 1 MiB to 16 GiB, and buckets: 1 to 16 streams in flight). Empty segments send
/// nothing.
result<std::vector<slice>> segment_slices(std::span<const std::uint64_t> segment_bytes,
                                          std::uint64_t bucket_bytes, unsigned buckets);

/// One broadcast of a vLLM packed update: tensors [first, first + count) in names order,
/// `nbytes` in all.
struct group {
  std::size_t first = 0;
  std::size_t count = 0;
  std::uint64_t nbytes = 0;
  friend bool operator==(const group&, const group&) = default;
};

/// vLLM's packed grouping of tensors of `tensor_bytes` (names order) under
/// packed_buffer_size_bytes `buffer_bytes` (> 0).
result<std::vector<group>> vllm_packed_groups(std::span<const std::uint64_t> tensor_bytes,
                                              std::uint64_t buffer_bytes);

/// The most staging memory a receiver of `groups` needs with `buffers` groups in flight.
std::uint64_t staging_bytes(std::span<const group> groups, unsigned buffers);

}  // namespace wsync::nccl_plan
