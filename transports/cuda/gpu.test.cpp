// The GPU parts. Everywhere: the GPU transports answer "blocked" with the precise cause. With a
// CUDA device: the kernel's chunked checksums equal the CPU's for the same bytes, over tensor
// sizes around every edge of the algorithm, and a flipped byte in any chunk is caught. Without
// one these skip, saying why (the arithmetic is checked on the CPU by manifest's xxh3_parts
// tests).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cuda/chunk_jobs.hpp"
#include "random_bytes.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

using test::random_bytes;

TEST(gpu_transports, answer_blocked_with_the_cause) {
  for (const char* name : {"cuda-ipc", "cuda-vmm", "nccl"}) {
    ASSERT_TRUE(transport_known(name)) << name;
    // With a device, cuda-ipc and cuda-vmm run (device_transports.test.cpp and the suite), and
    // nccl too where libnccl.so.2 loads.
    if (gpu::ready() && (std::string(name) != "nccl" || nccl::ready())) continue;
    auto t = make_transport(name);
    ASSERT_FALSE(t) << name << " claims to run";
    EXPECT_EQ(t.error().code, errc::blocked) << t.error().message;
    EXPECT_EQ(t.error().message.rfind("blocked: ", 0), 0u) << t.error().message;
    EXPECT_NE(t.error().message.find(name), std::string::npos) << t.error().message;
    if (auto r = gpu::ready(); !r) {  // the machine's own reason, word for word
      EXPECT_EQ(t.error().message.rfind(r.error().message, 0), 0u) << t.error().message;
    }
  }
}

TEST(gpu_ready, says_exactly_why_not) {
  auto r = gpu::ready();
  if (r) GTEST_SKIP() << "a CUDA device is here";
  EXPECT_EQ(r.error().code, errc::blocked);
  const auto& m = r.error().message;
  EXPECT_TRUE(m == "blocked: built without CUDA (no CUDA toolkit found at configure time)" ||
              m.rfind("blocked: no CUDA device (", 0) == 0)
      << m;
}

class gpu_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto r = gpu::ready(); !r) GTEST_SKIP() << r.error().message;
  }
};

TEST_F(gpu_test, chunked_checksums_on_the_gpu_equal_the_cpu) {
  constexpr std::uint64_t chunk = 4096;
  // Sizes around every edge: empty, short paths, one block, chunk edges, many chunks.
  const std::vector<std::size_t> sizes = {
      0,   1,    3,    4,    8,    9,    16,   17,   128,  129,  240,
      241, 1023, 1024, 1025, 4095, 4096, 4097, 4336, 8192, 8193, (1 << 20) + 77};
  std::size_t total = 0;
  std::vector<std::size_t> offsets;
  for (auto n : sizes) {
    offsets.push_back(total);
    total += (n + 255) / 256 * 256 + 256;  // 256-aligned like packed tensors
  }
  auto host = random_bytes(total, 11);
  auto dev = gpu::device_buffer::make(total);
  ASSERT_TRUE(dev) << dev.error().message;
  ASSERT_TRUE(dev->upload(host.data(), total));
  std::vector<gpu::device_range> ranges;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ranges.push_back({static_cast<const unsigned char*>(dev->data()) + offsets[i], sizes[i]});
  }
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, chunk};
  auto got = gpu::chunked_checksums(ranges, chunk);
  ASSERT_TRUE(got) << got.error().message;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ((*got)[i], checksum_compute(host.data() + offsets[i], sizes[i], method))
        << "size " << sizes[i];
  }
  // Views into a tensor: an unaligned start takes the byte-wise reads, one 8- but not 16-byte
  // aligned the 8-byte ones.
  for (std::size_t shift : {3, 8}) {
    gpu::device_range odd{static_cast<const unsigned char*>(dev->data()) + shift, 10000};
    auto odd_sum = gpu::chunked_checksums({&odd, 1}, chunk);
    ASSERT_TRUE(odd_sum) << odd_sum.error().message;
    EXPECT_EQ((*odd_sum)[0], checksum_compute(host.data() + shift, 10000, method)) << shift;
  }
}

// Publishing device tensors: one pass copies every byte and hashes it; the copy is exact and
// the digests are the hash-only ones, whatever the sizes and alignments.
TEST_F(gpu_test, copy_with_checksums_copies_every_byte_and_equals_the_cpu) {
  constexpr std::uint64_t chunk = 4096;
  const std::vector<std::size_t> sizes = {0, 1, 240, 241, 1024, 1025, 4097, (1 << 20) + 77, 9000};
  std::size_t total = 0;
  std::vector<std::size_t> offsets, to;
  for (auto n : sizes) {
    offsets.push_back(total + (offsets.size() % 3 == 2 ? 2 : 0));  // some unaligned sources
    // ...and some destinations 8- but not 16-byte aligned beside aligned sources.
    to.push_back(offsets.back() + (to.size() % 3 == 1 ? 8 : 0));
    total += (n + 255) / 256 * 256 + 256;
  }
  auto host = random_bytes(total, 13);
  auto src = gpu::device_buffer::make(total);
  auto dst = gpu::device_buffer::make(total);
  ASSERT_TRUE(src && dst);
  ASSERT_TRUE(src->upload(host.data(), total));
  std::vector<unsigned char> poison(total, 0xA5);
  ASSERT_TRUE(dst->upload(poison.data(), total));
  std::vector<gpu::device_copy> copies;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    copies.push_back({static_cast<unsigned char*>(dst->data()) + to[i],
                      static_cast<const unsigned char*>(src->data()) + offsets[i], sizes[i]});
  }
  auto got = gpu::copy_with_checksums(copies, chunk);
  ASSERT_TRUE(got) << got.error().message;
  std::vector<unsigned char> back(total);
  ASSERT_TRUE(dst->download(back.data(), total));
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, chunk};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ((*got)[i], checksum_compute(host.data() + offsets[i], sizes[i], method))
        << "size " << sizes[i];
    EXPECT_EQ(std::memcmp(back.data() + to[i], host.data() + offsets[i], sizes[i]), 0)
        << "size " << sizes[i];
  }
}

// Tensors of tens of MiB in 1 MiB chunks (four times more threads than a GPU runs at once),
// beside small ones: hashed, and hashed while copied, they equal the CPU's digests.
TEST_F(gpu_test, large_tensors_in_many_chunks_equal_the_cpu) {
  constexpr std::uint64_t chunk = 1 << 20;
  const std::vector<std::size_t> sizes = {(std::size_t{40} << 20) + 77,   3000, 241,
                                          (std::size_t{24} << 20) + 1024, 5,    (1 << 20) - 1};
  std::size_t total = 0;
  std::vector<std::size_t> offsets;
  for (auto n : sizes) {
    offsets.push_back(total);
    total += (n + 255) / 256 * 256;
  }
  auto host = random_bytes(total, 14);
  auto src = gpu::device_buffer::make(total);
  auto dst = gpu::device_buffer::make(total);
  ASSERT_TRUE(src && dst);
  ASSERT_TRUE(src->upload(host.data(), total));
  std::vector<gpu::device_range> ranges;
  std::vector<gpu::device_copy> copies;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    ranges.push_back({static_cast<const unsigned char*>(src->data()) + offsets[i], sizes[i]});
    copies.push_back({static_cast<unsigned char*>(dst->data()) + offsets[i],
                      static_cast<const unsigned char*>(src->data()) + offsets[i], sizes[i]});
  }
  auto hashed = gpu::chunked_checksums(ranges, chunk);
  ASSERT_TRUE(hashed) << hashed.error().message;
  auto copied = gpu::copy_with_checksums(copies, chunk);
  ASSERT_TRUE(copied) << copied.error().message;
  std::vector<unsigned char> back(total);
  ASSERT_TRUE(dst->download(back.data(), total));
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, chunk};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto want = checksum_compute(host.data() + offsets[i], sizes[i], method);
    EXPECT_EQ((*hashed)[i], want) << "size " << sizes[i];
    EXPECT_EQ((*copied)[i], want) << "size " << sizes[i];
    EXPECT_EQ(std::memcmp(back.data() + offsets[i], host.data() + offsets[i], sizes[i]), 0)
        << "size " << sizes[i];
  }
}

TEST_F(gpu_test, a_flipped_byte_in_any_chunk_is_caught) {
  constexpr std::uint64_t chunk = 65536;
  const std::size_t n = 5 * chunk + 1000;
  auto host = random_bytes(n, 12);
  auto dev = gpu::device_buffer::make(n);
  ASSERT_TRUE(dev) << dev.error().message;
  ASSERT_TRUE(dev->upload(host.data(), n));
  gpu::device_range all{dev->data(), n};
  const auto good = checksum_compute(host.data(), n, {checksum_algorithm::xxh3_64_chunked, chunk});
  for (std::size_t at : {std::size_t{0}, chunk - 1, chunk, 3 * chunk + 17, n - 1}) {
    unsigned char flipped = host[at] ^ 0x01;
    ASSERT_TRUE(dev->upload(&flipped, 1, at));
    auto got = gpu::chunked_checksums({&all, 1}, chunk);
    ASSERT_TRUE(got) << got.error().message;
    EXPECT_NE((*got)[0], good) << "byte " << at;
    ASSERT_TRUE(dev->upload(&host[at], 1, at));
  }
  auto back = gpu::chunked_checksums({&all, 1}, chunk);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ((*back)[0], good);
}

}  // namespace
}  // namespace wsync

namespace wsync::gpu {
namespace {

// What the kernels run, run on the CPU in their decomposition: the job plan (chunks, block
// indices, jobs without blocks), the binary search from block to job, the four threads per
// block with two partner lanes each, and the per-chunk finish. Only the launch is left for a
// GPU to check.
TEST(gpu_kernel_plan, equals_the_cpu_checksum_in_the_kernels_decomposition) {
  constexpr std::uint64_t chunk = 4096;
  const std::vector<std::size_t> sizes = {0,    1,    17,   240,  241,  1023, 1024,         1025,
                                          4095, 4096, 4097, 8192, 9000, 3,    (1 << 16) + 5};
  std::vector<std::vector<unsigned char>> bytes;
  std::vector<device_range> ranges;  // host memory stands in for the device's
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    bytes.push_back(random_bytes(sizes[i] + 3, 40 + i));
    ranges.push_back({bytes.back().data() + (i % 2 ? 3 : 0), sizes[i]});  // some unaligned
  }
  std::vector<detail::chunk_job> jobs;
  std::vector<std::size_t> first;
  const auto blocks = detail::plan_jobs(ranges, chunk, jobs, first);
  std::uint64_t want_blocks = 0;
  for (const auto& j : jobs) want_blocks += detail::blocks_of(j.len);
  EXPECT_EQ(blocks, want_blocks);
  auto digests = detail::run_on_cpu(jobs, blocks, checksum_default_secret());
  const checksum_method method{checksum_algorithm::xxh3_64_chunked, chunk};
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    auto got = checksum_of_chunks(digests.data() + first[i], first[i + 1] - first[i]);
    EXPECT_EQ(got, checksum_compute(ranges[i].data, ranges[i].nbytes, method))
        << "size " << sizes[i];
  }
}

// The copying form: every byte lands at its destination (blocks by their four threads, tails
// and short chunks by copy_tail), and the digests do not change.
TEST(gpu_kernel_plan, copies_every_byte_while_hashing) {
  constexpr std::uint64_t chunk = 4096;
  const std::vector<std::size_t> sizes = {0, 1, 17, 240, 241, 1023, 1024, 1025, 4097, 9000};
  std::vector<std::vector<unsigned char>> bytes, copies;
  std::vector<device_range> ranges;
  std::vector<void*> to;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    bytes.push_back(random_bytes(sizes[i] + 3, 60 + i));
    copies.emplace_back(sizes[i] + 3, 0xA5);
    ranges.push_back({bytes.back().data() + (i % 2 ? 3 : 0), sizes[i]});
    to.push_back(copies.back().data() + (i % 3 ? 1 : 0));
  }
  std::vector<detail::chunk_job> jobs, plain_jobs;
  std::vector<std::size_t> first, plain_first;
  const auto blocks = detail::plan_jobs(ranges, chunk, jobs, first, &to);
  detail::plan_jobs(ranges, chunk, plain_jobs, plain_first);
  auto digests = detail::run_on_cpu(jobs, blocks, checksum_default_secret());
  EXPECT_EQ(digests, detail::run_on_cpu(plain_jobs, blocks, checksum_default_secret()));
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(std::memcmp(to[i], ranges[i].data, sizes[i]), 0) << "size " << sizes[i];
    // Nothing written past the end (the buffers hold 3 bytes more than a copy at offset 0 or 1).
    const auto* end = static_cast<const unsigned char*>(to[i]) + sizes[i];
    for (const auto* p = end; p < copies[i].data() + copies[i].size(); ++p) {
      EXPECT_EQ(*p, 0xA5) << "size " << sizes[i] << ", byte " << (p - end) << " past the end";
    }
  }
}

// Large updates are hashed in runs of jobs (bounded scratch): run by run, rebased, the digests
// are those of the whole, at every run size down to one block.
TEST(gpu_kernel_plan, runs_of_jobs_give_the_digests_of_the_whole) {
  constexpr std::uint64_t chunk = 4096;
  const std::vector<std::size_t> sizes = {0, 5000, 17, 9000, 4096, 1025, 12288 + 7, 241};
  std::vector<std::vector<unsigned char>> bytes;
  std::vector<device_range> ranges;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    bytes.push_back(random_bytes(sizes[i], 80 + i));
    ranges.push_back({bytes.back().data(), sizes[i]});
  }
  std::vector<detail::chunk_job> jobs;
  std::vector<std::size_t> first;
  const auto blocks = detail::plan_jobs(ranges, chunk, jobs, first);
  const auto whole = detail::run_on_cpu(jobs, blocks, checksum_default_secret());
  for (std::uint64_t max_blocks : {std::uint64_t{1}, std::uint64_t{3}, std::uint64_t{4}, blocks}) {
    SCOPED_TRACE("max_blocks " + std::to_string(max_blocks));
    std::vector<std::uint64_t> got(jobs.size(), 0);
    std::size_t covered = 0;
    for (const auto& run : detail::batch_jobs(jobs, max_blocks)) {
      EXPECT_EQ(run.first, covered);
      EXPECT_TRUE(run.blocks <= max_blocks || run.jobs.size() == 1) << run.blocks;
      auto part = detail::run_on_cpu(run.jobs, run.blocks, checksum_default_secret());
      std::copy(part.begin(), part.end(), got.begin() + static_cast<std::ptrdiff_t>(run.first));
      covered += run.jobs.size();
    }
    EXPECT_EQ(covered, jobs.size());
    EXPECT_EQ(got, whole);
  }
}

TEST(gpu_kernel_plan, every_block_maps_to_the_job_that_owns_it) {
  std::vector<detail::chunk_job> jobs = {
      {nullptr, 5000, 0}, {nullptr, 100, 4}, {nullptr, 10, 4}, {nullptr, 2048, 4}, {nullptr, 1, 5}};
  // Job 0 owns blocks 0..3 (5000 bytes: 4 whole blocks before its tail), jobs 1 and 2 none,
  // job 3 block 4 (2048 bytes: 1 whole block), job 4 none.
  EXPECT_EQ(detail::job_of(jobs.data(), jobs.size(), 0), 0u);
  EXPECT_EQ(detail::job_of(jobs.data(), jobs.size(), 3), 0u);
  EXPECT_EQ(detail::job_of(jobs.data(), jobs.size(), 4), 3u);
  EXPECT_EQ(detail::blocks_of(5000), 4u);
  EXPECT_EQ(detail::blocks_of(2048), 1u);
  EXPECT_EQ(detail::blocks_of(240), 0u);
}

}  // namespace
}  // namespace wsync::gpu
