// Fuzz target: a manifest as JSON (what a consumer receives from the coordinator, the HTTP
// surface and file-mmap's CURRENT). Decoding never throws; what decodes is validated, and its
// JSON form decodes to an equal manifest (the codec's exact round trip).

#include <cstddef>
#include <cstdint>

#include "fuzz_support.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/validate.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace wsync;
  auto m = manifest_from_json(fuzz::text(data, size));
  if (!m) {
    fuzz::expect(!m.error().message.empty(), "a refused manifest says why");
    return 0;
  }
  auto valid = manifest_validate(*m);
  fuzz::expect(valid || !valid.error().message.empty(), "an invalid manifest says why");
  auto again = manifest_from_json(manifest_to_json(*m));
  fuzz::expect(again.has_value(), "the JSON of a decoded manifest decodes");
  fuzz::expect(*again == *m, "the JSON round trip is exact");
  return 0;
}
