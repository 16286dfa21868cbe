#include "wsync/manifest/checksum.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace wsync {
namespace {

constexpr std::size_t block = 128 * 1024;

// n usable bytes starting at a 64-byte boundary, so tests choose alignment explicitly.
class aligned_buffer {
 public:
  explicit aligned_buffer(std::size_t n) : bytes_(n + 64) {
    auto addr = reinterpret_cast<std::uintptr_t>(bytes_.data());
    base_ = bytes_.data() + ((64 - addr % 64) % 64);
  }
  unsigned char* at(std::size_t off) { return base_ + off; }

 private:
  std::vector<unsigned char> bytes_;
  unsigned char* base_ = nullptr;
};

TEST(checksum, known_answer_for_empty_input) {
  EXPECT_EQ(checksum_compute(nullptr, 0), 0x2d06800538d394c2ull);  // XXH3_64bits("")
  unsigned char byte = 0;
  EXPECT_EQ(checksum_compute(&byte, 0), 0x2d06800538d394c2ull);
}

TEST(checksum, is_xxh3_64_with_seed_0) {
  std::vector<unsigned char> data(5000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 3);
  for (std::size_t n : {1, 3, 16, 17, 128, 129, 240, 241, 1024, 5000}) {
    EXPECT_EQ(checksum_compute(data.data(), n), XXH3_64bits(data.data(), n)) << n;
  }
}

TEST(checksum, one_byte_change_changes_it) {
  std::vector<unsigned char> a(4096, 7);
  auto h = checksum_compute(a.data(), a.size());
  for (std::size_t at : {std::size_t{0}, std::size_t{2048}, a.size() - 1}) {
    a[at] ^= 1;
    EXPECT_NE(checksum_compute(a.data(), a.size()), h) << at;
    a[at] ^= 1;
  }
  EXPECT_EQ(checksum_compute(a.data(), a.size()), h);
  std::vector<unsigned char> one{42};
  auto h1 = checksum_compute(one.data(), 1);
  one[0] = 43;
  EXPECT_NE(checksum_compute(one.data(), 1), h1);
}

TEST(checksum, fused_copy_equals_copy_then_hash) {
  const std::size_t max = (std::size_t{3} << 20) + 7;
  aligned_buffer src(max + 128), dst(max + 128);
  for (std::size_t i = 0; i < max + 128; ++i) *src.at(i) = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{63},
        std::size_t{64}, std::size_t{255}, block - 1, block, block + 1, max}) {
    // src: aligned and misaligned; dst: 64- and 16-aligned (streaming stores) and misaligned.
    for (std::size_t src_off : {0, 1, 13}) {
      for (std::size_t dst_off : {16, 64, 3, 33}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " src_off=" + std::to_string(src_off) +
                     " dst_off=" + std::to_string(dst_off));
        std::memset(dst.at(0), 0xee, max + 128);
        auto h = checksum_copy(dst.at(dst_off), src.at(src_off), n);
        ASSERT_EQ(h, checksum_compute(src.at(src_off), n));
        ASSERT_EQ(h, XXH3_64bits(src.at(src_off), n));
        ASSERT_EQ(std::memcmp(dst.at(dst_off), src.at(src_off), n), 0);
        ASSERT_EQ(*dst.at(dst_off + n), 0xee) << "wrote past the end";
        ASSERT_EQ(*dst.at(dst_off - 1), 0xee) << "wrote before the start";
      }
    }
  }
}

TEST(checksum, fused_copy_at_64_byte_alignment) {
  for (std::size_t n : {block - 1, block, block + 1, 2 * block + 64}) {
    aligned_buffer src(n), dst(n + 1);
    for (std::size_t i = 0; i < n; ++i) *src.at(i) = static_cast<unsigned char>(i ^ (i >> 8));
    *dst.at(n) = 0x5a;
    auto h = checksum_copy(dst.at(0), src.at(0), n);
    EXPECT_EQ(h, checksum_compute(src.at(0), n)) << n;
    EXPECT_EQ(std::memcmp(dst.at(0), src.at(0), n), 0) << n;
    EXPECT_EQ(*dst.at(n), 0x5a) << n;
  }
}

}  // namespace
}  // namespace wsync
