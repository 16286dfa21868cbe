// Fuzz target: the files the file-mmap transport reads that other processes (maybe on other
// hosts of a shared filesystem) wrote: DIR/CURRENT, a reader's lease, a buffer's STAMP. One
// input feeds all three decoders; none may throw, whatever the file holds.

#include <cstddef>
#include <cstdint>
#include <string>

#include "file_mmap/file_mmap_common.hpp"
#include "fuzz_support.hpp"
#include "wsync/manifest/codec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace wsync::file_mmap_detail;
  const std::string text(wsync::fuzz::text(data, size));
  auto state = current_parse(text, "CURRENT");
  if (state) {
    auto again = wsync::manifest_from_json(wsync::manifest_to_json(state->manifest));
    wsync::fuzz::expect(again && *again == state->manifest, "CURRENT's manifest round-trips");
  } else {
    wsync::fuzz::expect(!state.error().message.empty(), "a refused CURRENT says why");
  }
  (void)lease_parse(text);
  (void)stamp_update_id(text);
  return 0;
}
