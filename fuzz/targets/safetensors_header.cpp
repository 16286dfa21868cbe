// Fuzz target: a whole .safetensors file (8-byte header length, JSON header, data), as
// `wsync publish --safetensors` and the Python bridge read it. Parsing never throws, and every
// tensor it returns lies inside the file with as many bytes as its shape and dtype need.

#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_support.hpp"
#include "wsync/sources/safetensors.hpp"

namespace {
volatile unsigned sink = 0;  // keeps the reads below
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace wsync;
  std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  auto tensors = safetensors_index(file, "fuzz-input");
  if (!tensors) {
    fuzz::expect(!tensors.error().message.empty(), "a refused file says why");
    return 0;
  }
  const std::byte* end = file.data() + file.size();
  for (const auto& t : *tensors) {
    fuzz::expect(t.data >= file.data() + 8 && t.data <= end &&
                     t.nbytes <= static_cast<std::size_t>(end - t.data),
                 "every tensor lies inside the file, after the header length");
    std::uint64_t bytes = dtype_itemsize(t.dtype);
    for (auto d : t.shape) {
      fuzz::expect(d >= 0, "no negative dimension");
      if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes)) bytes = 0;
    }
    fuzz::expect(bytes == t.nbytes, "a tensor's bytes match its shape and dtype");
    // Touch the range: ASan catches one that escaped the checks above.
    unsigned sum = 0;
    for (std::size_t i = 0; i < t.nbytes; i += 4096) sum += std::to_integer<unsigned>(t.data[i]);
    if (t.nbytes) sum += std::to_integer<unsigned>(t.data[t.nbytes - 1]);
    sink = sink + sum;
  }
  return 0;
}
