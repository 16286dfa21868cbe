// The nccl transport's arithmetic: slicing wsync segments into bounded broadcasts over a ring of
// streams, and vLLM's packed grouping (which a receiver must reproduce to post receives of the
// right sizes).

#include "nccl/plan.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace wsync::nccl_plan {
namespace {

constexpr std::uint64_t MiB = std::uint64_t{1} << 20;

TEST(nccl_plan, segments_go_out_in_bounded_slices_over_the_streams_in_turn) {
  const std::vector<std::uint64_t> segments = {5 * MiB + 3, 0, 2 * MiB};
  auto s = segment_slices(segments, 2 * MiB, 2);
  ASSERT_TRUE(s) << s.error().message;
  const std::vector<slice> want = {
      {0, 0, 2 * MiB, 0}, {0, 2 * MiB, 2 * MiB, 1}, {0, 4 * MiB, MiB + 3, 0}, {2, 0, 2 * MiB, 1}};
  EXPECT_EQ(*s, want);
}

TEST(nccl_plan, every_byte_is_sent_once_and_no_slice_passes_the_bound) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::uint64_t> segments(1 + rng() % 5);
    for (auto& n : segments) n = rng() % (20 * MiB);
    const std::uint64_t bucket = MiB << (rng() % 4);
    const unsigned buffers = 1 + static_cast<unsigned>(rng() % 3);
    auto s = segment_slices(segments, bucket, buffers);
    ASSERT_TRUE(s) << s.error().message;
    std::vector<std::uint64_t> covered(segments.size(), 0);
    for (std::size_t k = 0; k < s->size(); ++k) {
      const auto& x = (*s)[k];
      ASSERT_GT(x.nbytes, 0u);
      ASSERT_LE(x.nbytes, bucket);
      ASSERT_EQ(x.offset, covered[x.segment]) << "slices of a segment are in order, no gap";
      ASSERT_EQ(x.stream, k % buffers);
      covered[x.segment] += x.nbytes;
    }
    EXPECT_EQ(covered, segments);
  }
}

TEST(nccl_plan, bad_bucket_settings_are_refused_by_name) {
  const std::vector<std::uint64_t> one = {MiB};
  auto small = segment_slices(one, 4096, 2);
  ASSERT_FALSE(small);
  EXPECT_EQ(small.error().message, "nccl: bucket_bytes 4096 is outside 1 MiB to 16 GiB");
  auto none = segment_slices(one, MiB, 0);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().message, "nccl: buckets 0 is outside 1 to 16");
}

TEST(nccl_plan, vllm_groups_close_after_the_tensor_that_crosses_the_bound) {
  // Bound 10: 4+4 = 8 stays open, +4 = 12 > 10 closes with it; 11 alone passes the bound and
  // closes at once; the rest ends the update.
  const std::vector<std::uint64_t> sizes = {4, 4, 4, 11, 3, 3};
  auto g = vllm_packed_groups(sizes, 10);
  ASSERT_TRUE(g) << g.error().message;
  const std::vector<group> want = {{0, 3, 12}, {3, 1, 11}, {4, 2, 6}};
  EXPECT_EQ(*g, want);
  EXPECT_EQ(staging_bytes(*g, 2), 24u);  // two groups in flight, each at most 12 bytes
  EXPECT_EQ(staging_bytes(*g, 1), 12u);
  // Exactly at the bound does not close a group: only passing it does.
  auto exact = vllm_packed_groups(std::vector<std::uint64_t>{5, 5, 1}, 10);
  ASSERT_TRUE(exact);
  EXPECT_EQ(*exact, (std::vector<group>{{0, 3, 11}}));
  auto empty = vllm_packed_groups(std::vector<std::uint64_t>{}, 10);
  ASSERT_TRUE(empty);
  EXPECT_TRUE(empty->empty());
  EXPECT_FALSE(vllm_packed_groups(sizes, 0));
}

TEST(nccl_plan, vllm_groups_cover_every_tensor_in_order) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::uint64_t> sizes(rng() % 300);
    for (auto& n : sizes) n = rng() % (64 * MiB);
    const std::uint64_t bound = 1 + rng() % (256 * MiB);
    auto g = vllm_packed_groups(sizes, bound);
    ASSERT_TRUE(g);
    std::size_t next = 0;
    for (std::size_t k = 0; k < g->size(); ++k) {
      const auto& x = (*g)[k];
      ASSERT_EQ(x.first, next);
      ASSERT_GT(x.count, 0u);
      const auto bytes = std::accumulate(
          sizes.begin() + static_cast<std::ptrdiff_t>(x.first),
          sizes.begin() + static_cast<std::ptrdiff_t>(x.first + x.count), std::uint64_t{0});
      ASSERT_EQ(x.nbytes, bytes);
      if (k + 1 < g->size()) {
        ASSERT_GT(x.nbytes, bound) << "a group closes only once it passes the bound";
        ASSERT_LE(x.nbytes - sizes[x.first + x.count - 1], bound) << "and not a tensor later";
      }
      next += x.count;
    }
    EXPECT_EQ(next, sizes.size());
  }
}

}  // namespace
}  // namespace wsync::nccl_plan
