#include "nccl/handle.hpp"

#include <nlohmann/json.hpp>

#include <cstring>
#include <set>

#include "src/json_read.hpp"
#include "src/slot_ring.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/json_bounded.hpp"

namespace wsync::nccl_handle {
namespace {

constexpr char magic[8] = {'W', 'S', 'Y', 'N', 'C', 'N', 'C', '1'};

bool is_hex(const std::string& s, std::size_t digits) {
  if (s.size() != digits) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

void put(header_block& b, std::size_t at, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = std::byte((v >> (8 * i)) & 0xff);  // little-endian
}

std::uint64_t get(const header_block& b, std::size_t at) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= std::to_integer<std::uint64_t>(b[at + i]) << (8 * i);
  return v;
}

}  // namespace

std::string encode(const handle& h) {
  return nlohmann::json{{"group", h.group},
                        {"epoch", h.epoch},
                        {"id", nccl::unique_id_to_base64(h.id)},
                        {"members", h.members},
                        {"sequence", h.sequence},
                        {"bytes", h.bytes},
                        {"bucket_bytes", h.bucket_bytes},
                        {"buckets", h.buckets}}
      .dump();
}

result<handle> parse(const weight_update_manifest& m) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + why + " (" +
                                                  update_context(m) + ")");
  };
  auto j = json_parse_bounded(m.transport_handle);
  if (j.is_discarded() || !j.is_object()) return bad("not an nccl handle");
  handle h;
  std::string id;
  try {
    h.group = j.at("group").get<std::string>();
    h.epoch = json_read::field<std::uint64_t>(j, "epoch");
    id = j.at("id").get<std::string>();
    h.members = json_read::list<std::int32_t>(j, "members");
    h.sequence = json_read::field<std::uint64_t>(j, "sequence");
    h.bytes = json_read::field<std::uint64_t>(j, "bytes");
    h.bucket_bytes = json_read::field<std::uint64_t>(j, "bucket_bytes");
    h.buckets = json_read::field<std::uint32_t>(j, "buckets");
  } catch (const std::exception& e) {
    return bad(std::string("nccl handle field: ") + e.what());
  }
  if (!is_hex(h.group, 16)) return bad("group is not 16 hex digits");
  auto decoded = nccl::unique_id_from_base64(id);
  if (!decoded) return bad("id: " + decoded.error().message);
  h.id = *decoded;
  if (h.members.empty()) return bad("members is empty");
  if (h.members.size() > max_members) {
    return bad("members lists more than " + std::to_string(max_members) + " ranks");
  }
  std::set<std::int32_t> seen;
  for (auto r : h.members) {
    if (r < 0) return bad("members: rank " + std::to_string(r) + " is negative");
    if (!seen.insert(r).second) return bad("members: rank " + std::to_string(r) + " twice");
  }
  if (h.bucket_bytes < (std::uint64_t{1} << 20) || h.bucket_bytes > (std::uint64_t{16} << 30)) {
    return bad("bucket_bytes " + std::to_string(h.bucket_bytes) + " is outside 1 MiB to 16 GiB");
  }
  if (h.buckets < 1 || h.buckets > 16) {
    return bad("buckets " + std::to_string(h.buckets) + " is outside 1 to 16");
  }
  std::uint64_t need = 0;
  wire_layout(m.segments, need);
  if (h.bytes != need) {
    return bad("bytes " + std::to_string(h.bytes) + " is not the segments' " +
               std::to_string(need) + " bytes laid out 256-byte aligned");
  }
  return h;
}

std::vector<std::uint64_t> wire_layout(const std::vector<segment_descriptor>& segments,
                                       std::uint64_t& bytes) {
  std::vector<std::uint64_t> sizes;
  for (const auto& s : segments) sizes.push_back(s.nbytes);
  return slot_ring::layout(sizes, tensor_alignment, bytes);
}

header header_of(const handle& h, const update_id& id) {
  return {h.sequence, h.bytes, checksum_compute(id.data(), id.size())};
}

header_block header_encode(const header& h) {
  header_block b{};
  std::memcpy(b.data(), magic, sizeof magic);
  put(b, 8, h.sequence);
  put(b, 16, h.bytes);
  put(b, 24, h.update_digest);
  return b;
}

result<header> header_decode(const header_block& b) {
  if (std::memcmp(b.data(), magic, sizeof magic) != 0) {
    return make_error(errc::io_error, "nccl: the bytes ahead of an update are not a wsync header");
  }
  return header{get(b, 8), get(b, 16), get(b, 24)};
}

}  // namespace wsync::nccl_handle
