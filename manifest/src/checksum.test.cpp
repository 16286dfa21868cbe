#include "wsync/manifest/checksum.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace wsync {
namespace {

TEST(checksum, known_answer_for_empty_input) {
  EXPECT_EQ(checksum_compute(nullptr, 0), 0x2d06800538d394c2ull);  // XXH3_64bits("")
}

TEST(checksum, one_byte_changes_it) {
  std::vector<unsigned char> a(4096, 7);
  auto h = checksum_compute(a.data(), a.size());
  a[2048] ^= 1;
  EXPECT_NE(checksum_compute(a.data(), a.size()), h);
}

TEST(checksum, fused_copy_equals_copy_then_hash) {
  const std::size_t block = 128 * 1024;
  std::vector<unsigned char> src(4 << 20), dst(4 << 20);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16},
                        std::size_t{63}, std::size_t{64}, std::size_t{255}, block - 1, block,
                        block + 1, (std::size_t{3} << 20) + 7}) {
    for (std::size_t src_off : {0, 1, 13}) {
      for (std::size_t dst_off : {0, 16, 3}) {  // streaming stores need 16-byte alignment
        std::memset(dst.data(), 0xee, dst.size());
        auto h = checksum_copy(dst.data() + dst_off, src.data() + src_off, n);
        ASSERT_EQ(h, checksum_compute(src.data() + src_off, n)) << n;
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, n), 0) << n;
        ASSERT_EQ(dst[dst_off + n], 0xee) << "wrote past the end";
        if (dst_off > 0) {
          ASSERT_EQ(dst[dst_off - 1], 0xee) << "wrote before the start";
        }
      }
    }
  }
}

}  // namespace
}  // namespace wsync
