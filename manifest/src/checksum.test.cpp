#include "wsync/manifest/checksum.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "random_bytes.hpp"
#include "src/xxh3_kernels.hpp"
#include "wsync/manifest/xxh3_parts.hpp"

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

// Every instruction set this CPU runs gives libxxhash's digest at every length to 4 KiB, at an
// odd alignment, and past the long loop's block and stripe edges; and copies every byte while
// hashing, aligned or not, across the 128 KiB blocks of the fused copy.
TEST(checksum, every_instruction_set_hashes_and_copies_like_libxxhash) {
  const auto list = detail::xxh3_kernels_available();
  ASSERT_GE(list.count, 1u);
  if (std::getenv("WSYNC_CHECKSUM_ISA") == nullptr) {
    EXPECT_EQ(checksum_isa(), list.sets[0]->isa);  // the widest, unless told otherwise
  }
  const std::size_t big = 8 * block + 1027;  // past 1 MiB
  auto data = test::random_bytes(big + 64, 11);
  aligned_buffer out(big + 64);
  for (std::size_t k = 0; k < list.count; ++k) {
    const auto& set = *list.sets[k];
    SCOPED_TRACE(set.isa);
    for (std::size_t n = 0; n <= 4096; ++n) {
      ASSERT_EQ(set.hash(data.data() + 1, n), XXH3_64bits(data.data() + 1, n)) << n;
    }
    for (std::size_t n : {block - 1, block, block + 1, std::size_t{1} << 20, big}) {
      ASSERT_EQ(set.hash(data.data() + 3, n), XXH3_64bits(data.data() + 3, n)) << n;
      for (std::size_t at : {std::size_t{0}, std::size_t{5}}) {
        std::memset(out.at(0), 0xee, big + 8);
        ASSERT_EQ(set.hash_copy(out.at(at), data.data() + 3, n), XXH3_64bits(data.data() + 3, n));
        ASSERT_EQ(std::memcmp(out.at(at), data.data() + 3, n), 0) << n << " at " << at;
        ASSERT_EQ(out.at(at)[n], 0xee) << "wrote past the end: " << n;
      }
    }
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

namespace wsync {
namespace {

using test::random_bytes;

// The split form a GPU kernel runs: block sums in any order, then the serial finish.
std::uint64_t parts_hash(const unsigned char* p, std::size_t n) {
  std::vector<xxh3::lanes> sums(n > xxh3::short_max ? xxh3::long_blocks(n) : 0);
  return xxh3::hash(p, n, checksum_default_secret(), sums.data());
}

TEST(xxh3_parts, equal_libxxhash_at_every_length_to_4_kib_and_any_alignment) {
  auto data = random_bytes(4096 + 8, 1);
  for (std::size_t n = 0; n <= 4096; ++n) {
    for (std::size_t shift : {0, 3}) {  // aligned and unaligned starts
      const auto* p = data.data() + shift;
      ASSERT_EQ(parts_hash(p, n), XXH3_64bits(p, n)) << "length " << n << " shift " << shift;
    }
  }
}

TEST(xxh3_parts, equal_libxxhash_over_long_inputs_and_block_edges) {
  auto data = random_bytes((1 << 20) + 2048, 2);
  for (std::size_t n :
       {std::size_t{1023 * 1024}, std::size_t{1024 * 1024}, std::size_t{1024 * 1024 + 1},
        std::size_t{1024 * 1024 + 63}, std::size_t{1024 * 1024 + 64}, std::size_t{1024 * 1024 + 65},
        std::size_t{(1 << 20) + 2047}}) {
    ASSERT_EQ(parts_hash(data.data(), n), XXH3_64bits(data.data(), n)) << "length " << n;
  }
  // fold_lane folds in batches of 32 block sums: whole batches, one over, one short.
  for (std::size_t blocks : {31, 32, 33, 63, 64, 65}) {
    const std::size_t n = blocks * xxh3::block_bytes + 1;  // `blocks` whole blocks, a 1-byte tail
    ASSERT_EQ(xxh3::long_blocks(n), blocks);
    ASSERT_EQ(parts_hash(data.data(), n), XXH3_64bits(data.data(), n)) << "length " << n;
  }
}

TEST(xxh3_parts, block_sums_in_any_order_give_the_same_hash) {
  auto data = random_bytes(10 * 1024 + 100, 3);
  const std::size_t n = data.size();
  std::vector<xxh3::lanes> sums(xxh3::long_blocks(n));
  for (std::size_t b = sums.size(); b-- > 0;) {  // last block first, as threads may
    sums[b] = xxh3::long_block_sum(data.data() + b * xxh3::block_bytes, checksum_default_secret());
  }
  EXPECT_EQ(xxh3::long_finish(data.data(), n, sums.data(), checksum_default_secret()),
            XXH3_64bits(data.data(), n));
}

TEST(checksum_chunked, is_xxh3_of_the_chunk_digests) {
  auto data = random_bytes(3 * 4096 + 17, 4);
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, 4096};
  std::vector<std::uint64_t> digests;
  for (std::size_t off = 0; off < data.size(); off += 4096) {
    digests.push_back(
        XXH3_64bits(data.data() + off, std::min<std::size_t>(4096, data.size() - off)));
  }
  ASSERT_EQ(digests.size(), 4u);
  EXPECT_EQ(checksum_chunks(data.size(), 4096), 4u);
  EXPECT_EQ(checksum_compute(data.data(), data.size(), method),
            XXH3_64bits(digests.data(), digests.size() * 8));
  EXPECT_EQ(checksum_compute(nullptr, 0, method), XXH3_64bits(nullptr, 0));  // no chunks
  // Whole-tensor xxh3-64 is unchanged by the overload.
  EXPECT_EQ(checksum_compute(data.data(), data.size(), checksum_method{}),
            XXH3_64bits(data.data(), data.size()));
}

TEST(checksum_chunked, copy_hashes_like_compute_and_copies_every_byte) {
  auto data = random_bytes(5 * 65536 + 4097, 5);
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, 65536};
  std::vector<unsigned char> out(data.size());
  EXPECT_EQ(checksum_copy(out.data(), data.data(), data.size(), method),
            checksum_compute(data.data(), data.size(), method));
  EXPECT_EQ(out, data);
}

TEST(checksum_chunked, a_flipped_byte_in_any_chunk_changes_it) {
  auto data = random_bytes(4 * 4096 + 100, 6);
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, 4096};
  const auto good = checksum_compute(data.data(), data.size(), method);
  for (std::size_t at :
       {std::size_t{0}, std::size_t{4095}, std::size_t{4096}, std::size_t{9000}, data.size() - 1}) {
    data[at] ^= 0x10;
    EXPECT_NE(checksum_compute(data.data(), data.size(), method), good) << "byte " << at;
    data[at] ^= 0x10;
  }
}

TEST(checksum_chunked, a_chunk_size_of_zero_hashes_the_whole_tensor_instead_of_dividing_by_it) {
  // Validation refuses such a method; a caller that skipped it must not get SIGFPE.
  std::vector<unsigned char> data(10000, 7);
  std::vector<unsigned char> out(data.size());
  const checksum_method zero{checksum_algorithm::xxh3_64_chunked, 0};
  EXPECT_EQ(checksum_compute(data.data(), data.size(), zero),
            checksum_compute(data.data(), data.size()));
  EXPECT_EQ(checksum_copy(out.data(), data.data(), data.size(), zero),
            checksum_compute(data.data(), data.size()));
  EXPECT_EQ(out, data);
}

TEST(checksum_chunked, names_round_trip) {
  for (auto a : {checksum_algorithm::xxh3_64, checksum_algorithm::xxh3_64_chunked}) {
    EXPECT_EQ(checksum_algorithm_parse(checksum_algorithm_name(a)), a);
  }
  EXPECT_EQ(checksum_algorithm_parse("crc32"), std::nullopt);
}

}  // namespace
}  // namespace wsync

namespace wsync {
namespace {

TEST(checksum_pieces, chunks_number_tensor_by_tensor_and_fold_to_the_method) {
  auto a = test::random_bytes(10000, 21), c = test::random_bytes(4096, 22);
  const std::vector<std::uint64_t> sizes = {a.size(), 0, c.size()};
  const std::vector<const unsigned char*> data = {a.data(), nullptr, c.data()};
  for (const checksum_method method :
       {checksum_method{}, checksum_method{checksum_algorithm::xxh3_64_chunked, 4096}}) {
    const checksum_pieces pieces(sizes, method);
    EXPECT_EQ(pieces.size(), method.chunk_bytes ? 3u + 0u + 1u : 3u);
    std::vector<std::uint64_t> digests(pieces.size());
    for (std::size_t k = pieces.size(); k-- > 0;) {  // any order
      const auto p = pieces.at(k);
      digests[k] = checksum_compute(data[p.tensor] + p.offset, p.nbytes);
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(pieces.fold(i, digests.data()), checksum_compute(data[i], sizes[i], method))
          << "tensor " << i << " chunk " << method.chunk_bytes;
    }
  }
}

}  // namespace
}  // namespace wsync
