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
  const auto text = fuzz::text(data, size);
  auto m = manifest_from_json(text);
  // Its fast paths (our plain lexer, then nlohmann's SAX) answer as the document reader does.
  auto reference = detail::manifest_from_json_document(text);
  fuzz::expect(m.has_value() == reference.has_value(), "both decoder paths accept alike");
  if (m) fuzz::expect(*m == *reference, "both decoder paths read the same manifest");
  if (!m) fuzz::expect(m.error().message == reference.error().message, "and refuse alike");
  if (auto plain = detail::manifest_from_plain_json(text)) {
    fuzz::expect(reference.has_value() && *plain == *reference, "the plain lexer reads alike");
  }
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
