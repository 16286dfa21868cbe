// Fuzz target: every transport handle decoder, on what a consumer finds in a manifest's
// transport_handle: shared-memory, file-mmap, cuda-ipc / cuda-vmm, nccl (and the header it
// broadcasts ahead of an update) and ucx (plain, relayed and striped).
//
// Input: one byte choosing the manifest's segments (count and sizes), then texts separated by
// NUL: the handle, a relay address, and further handles to stripe with the first. Decoders never
// throw; what they accept is inside the manifest's bounds, and what the ucx rewrites produce
// decodes again.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/device_pool.hpp"
#include "file_mmap/file_mmap_common.hpp"
#include "fuzz_support.hpp"
#include "nccl/handle.hpp"
#include "shared_memory/shared_memory.hpp"
#if WSYNC_HAVE_UCX
#include "ucx/handle.hpp"
#endif

namespace {

wsync::weight_update_manifest manifest_for(std::uint8_t shape) {
  wsync::weight_update_manifest m;
  m.update_id = "u-fuzz";
  m.model_id = "fuzz";
  m.weight_version = 1;
  for (int i = 0; i < shape % 4; ++i) {
    // 0, 4 KiB + 1 or 1 MiB: empty segments, partial chunks and several chunks.
    std::uint64_t sizes[] = {0, 4097, std::uint64_t{1} << 20};
    m.segments.push_back({sizes[(shape / 4 + i) % 3]});
  }
  return m;
}

void shared_memory_handle(const wsync::weight_update_manifest& m) {
  auto h = wsync::shared_memory_detail::handle_parse(m);
  if (!h) return;
  wsync::fuzz::expect(h->offsets.size() == m.segments.size(), "one offset per segment");
  for (std::size_t i = 0; i < h->offsets.size(); ++i) {
    wsync::fuzz::expect(
        h->offsets[i] <= h->capacity && m.segments[i].nbytes <= h->capacity - h->offsets[i],
        "every segment lies inside the slot");
  }
  wsync::fuzz::expect(h->name.find('/') == std::string::npos, "a slot name has no slash");
}

void file_mmap_handle(const wsync::weight_update_manifest& m) {
  auto h = wsync::file_mmap_detail::handle_parse(m, 0);
  if (!h) return;
  wsync::fuzz::expect(h->segments == m.segments.size() && h->buffer < 64,
                      "a file-mmap handle names one file per segment and a buffer below 64");
}

void device_pool_handles(const wsync::weight_update_manifest& m) {
  using wsync::device_pool::sharing;
  for (auto kind : {sharing::ipc, sharing::vmm}) {
    auto h = wsync::device_pool::handle_parse(m, kind);
    if (!h) continue;
    wsync::fuzz::expect(h->offsets.size() == m.segments.size() && h->slot < 64,
                        "a device handle has one offset per segment and a slot below 64");
    for (std::size_t i = 0; i < h->offsets.size(); ++i) {
      wsync::fuzz::expect(
          h->offsets[i] <= h->capacity && m.segments[i].nbytes <= h->capacity - h->offsets[i],
          "every segment lies inside the device slot");
    }
    wsync::fuzz::expect(h->control.find('/') == std::string::npos && h->pid > 0,
                        "a device handle's page name has no slash and its pid is positive");
    auto again = wsync::device_pool::handle_parse(
        [&] {
          auto copy = m;
          copy.transport_handle = wsync::device_pool::handle_encode(*h);
          return copy;
        }(),
        kind);
    wsync::fuzz::expect(again && again->id == h->id && again->offsets == h->offsets,
                        "a decoded device handle survives its own encoding");
  }
}

void nccl_handles(const wsync::weight_update_manifest& m) {
  namespace nh = wsync::nccl_handle;
  if (m.transport_handle.size() >= nh::header_bytes) {
    nh::header_block b{};
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = std::byte(m.transport_handle[i]);
    if (auto hd = nh::header_decode(b)) {
      auto back = nh::header_decode(nh::header_encode(*hd));
      wsync::fuzz::expect(back && *back == *hd, "a decoded nccl header survives its own encoding");
    }
  }
  auto h = nh::parse(m);
  if (!h) return;
  std::uint64_t bytes = 0;
  nh::wire_layout(m.segments, bytes);
  wsync::fuzz::expect(h->bytes == bytes && !h->members.empty() && h->buckets >= 1,
                      "an nccl handle covers the segments and names its members");
  auto again = nh::parse([&] {
    auto copy = m;
    copy.transport_handle = nh::encode(*h);
    return copy;
  }());
  wsync::fuzz::expect(again && again->id == h->id && again->members == h->members &&
                          again->sequence == h->sequence && again->epoch == h->epoch,
                      "a decoded nccl handle survives its own encoding");
}

#if WSYNC_HAVE_UCX
void ucx_handles(const wsync::weight_update_manifest& m, const std::vector<std::string>& texts) {
  using namespace wsync::ucx_detail;
  auto h = handle_parse(texts[0], &m);
  if (h) {
    auto again = handle_parse(handle_dump(*h), &m);
    wsync::fuzz::expect(again && handle_dump(*again) == handle_dump(*h),
                        "a decoded ucx handle survives its own dump");
  }
  if (texts.size() > 1) {
    auto relayed = handle_via_relay(texts[0], texts[1]);
    if (relayed) {
      wsync::fuzz::expect(handle_parse(*relayed, nullptr).has_value(), "a relayed handle decodes");
    }
    std::vector<std::string> stripes(texts.begin() + 1, texts.end());
    stripes.insert(stripes.begin(), texts[0]);
    auto striped = handle_striped(stripes);
    if (striped) {
      wsync::fuzz::expect(handle_parse(*striped, nullptr).has_value(), "a striped handle decodes");
    }
  }
}
#endif

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  auto m = manifest_for(data[0]);
  std::vector<std::string> texts;
  for (auto part : wsync::fuzz::split(wsync::fuzz::text(data + 1, size - 1), '\0')) {
    texts.emplace_back(part);
  }
  m.transport_handle = texts[0];
  shared_memory_handle(m);
  file_mmap_handle(m);
  device_pool_handles(m);
  nccl_handles(m);
#if WSYNC_HAVE_UCX
  ucx_handles(m, texts);
#endif
  return 0;
}
