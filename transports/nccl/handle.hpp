#pragma once
// What the nccl transport puts in a manifest's transport handle, and the header that goes over
// the wire ahead of each update's bytes. Pure C++, tested in CI.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/nccl.hpp"

namespace wsync::nccl_handle {

/// The most consumers one group holds (its NCCL ranks 1..max_members).
inline constexpr std::size_t max_members = 65535;

/// One update's place in its publisher's broadcasts.
struct handle {
  std::string group;                  ///< 16 hex digits, random per publisher
  std::uint64_t epoch = 0;            ///< which communicator of the group (a new one per abort)
  nccl::unique_id id{};               ///< that communicator's NCCL unique id
  std::vector<std::int32_t> members;  ///< consumer ranks, NCCL ranks 1.. in this order
  std::uint64_t sequence = 0;         ///< the update's place in the publisher's broadcast order
  std::uint64_t bytes = 0;            ///< bytes on the wire: the segments, 256-byte aligned
  std::uint64_t bucket_bytes = 0;     ///< most bytes one broadcast moves
  std::uint32_t buckets = 0;          ///< broadcasts queued before each wait
};

std::string encode(const handle& h);
/// Parses and checks a handle against its manifest (bytes must be the segments' layout);
/// "invalid manifest: transport_handle: ..." naming the field.
result<handle> parse(const weight_update_manifest& m);

/// Where each segment lies in the bytes on the wire (256-byte aligned); `bytes` receives the
/// total.
std::vector<std::uint64_t> wire_layout(const std::vector<segment_descriptor>& segments,
                                       std::uint64_t& bytes);

/// The header broadcast ahead of an update's bytes.
struct header {
  std::uint64_t sequence = 0;
  std::uint64_t bytes = 0;
  std::uint64_t update_digest = 0;  ///< xxh3-64 of the update id
  friend bool operator==(const header&, const header&) = default;
};
inline constexpr std::size_t header_bytes = 64;
using header_block = std::array<std::byte, header_bytes>;

header header_of(const handle& h, const update_id& id);
header_block header_encode(const header& h);
/// errc::io_error when the block is not a wsync nccl header.
result<header> header_decode(const header_block& block);

}  // namespace wsync::nccl_handle
