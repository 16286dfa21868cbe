#pragma once
// The weight-update contract: what one publisher rank publishes for one model version.
// Plain data; validation lives in validate.hpp, the JSON form in codec.hpp.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "wsync/manifest/dtype.hpp"

namespace wsync {

/// Globally unique id of an update; see update_id_generate().
using update_id = std::string;

/// Where one tensor lives inside the update and how to check it.
struct tensor_descriptor {
  std::string name;
  wsync::dtype dtype = wsync::dtype::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  ///< in elements; empty means contiguous row-major
  std::uint64_t nbytes = 0;
  std::string device = "cpu";  ///< "cpu" or "cuda:N"
  std::uint32_t segment = 0;   ///< index into weight_update_manifest::segments
  std::uint64_t offset = 0;    ///< byte offset inside the segment, 256-byte aligned
  std::uint64_t checksum = 0;  ///< of the tensor's nbytes, by the manifest's checksum_method
  friend bool operator==(const tensor_descriptor&, const tensor_descriptor&) = default;
};

/// One contiguous byte range holding packed tensors; the unit transports move and register.
struct segment_descriptor {
  std::uint64_t nbytes = 0;
  friend bool operator==(const segment_descriptor&, const segment_descriptor&) = default;
};

/// How every tensor checksum of a manifest is computed.
enum class checksum_algorithm : std::uint8_t {
  xxh3_64,          ///< XXH3-64 of the tensor's bytes (a manifest without "checksum" means it)
  xxh3_64_chunked,  ///< XXH3-64 of each chunk_bytes chunk, then XXH3-64 of those digests
};

struct checksum_method {
  checksum_algorithm algorithm = checksum_algorithm::xxh3_64;
  std::uint64_t chunk_bytes = 0;  ///< xxh3_64_chunked only: a power of two, 4 KiB to 1 GiB
  friend bool operator==(const checksum_method&, const checksum_method&) = default;
};

/// Immutable record of one published shard of an update.
struct weight_update_manifest {
  wsync::update_id update_id;
  std::string model_id;
  std::uint64_t weight_version = 0;
  std::string source_worker;  ///< e.g. "trainer-host:1234"
  std::int32_t source_rank = 0;
  std::string transport;         ///< registry name, e.g. "shared-memory"
  std::string transport_handle;  ///< opaque, written and read only by that transport
  std::vector<tensor_descriptor> tensors;
  std::vector<segment_descriptor> segments;
  wsync::checksum_method checksum_method;
  std::map<std::string, std::string> metadata;
  std::uint64_t total_bytes = 0;  ///< sum of segment sizes
  friend bool operator==(const weight_update_manifest&, const weight_update_manifest&) = default;
};

/// Alignment of every tensor inside its segment.
inline constexpr std::uint64_t tensor_alignment = 256;

/// Returns a new update id, unique across processes, hosts and restarts: 128 random bits from the
/// kernel plus the wall-clock time, as "u-<unix-ms hex>-<32 hex>".
update_id update_id_generate();

/// `bytes` bytes from the kernel's CSPRNG as lower-case hex; empty if the kernel refused (never
/// a guessable fallback: callers treat empty as failure).
std::string random_hex(std::size_t bytes);

/// The key of one update of a model across its shards and ranks: "<model_id>@<weight_version>".
std::string update_key(const std::string& model_id, std::uint64_t weight_version);

/// An id as errors show it: "<none>" for an empty one, a valid one as it is, any other cut to
/// 64 bytes with bytes outside [A-Za-z0-9._:/@-] as \xNN and its length said.
std::string update_id_shown(const update_id& id);

/// Text naming an update and a rank in errors: "update_id=<id> rank=<r>" (the id as
/// update_id_shown gives it).
std::string update_context(const weight_update_manifest& m);
std::string update_context(const update_id& id, std::int32_t rank);

}  // namespace wsync
