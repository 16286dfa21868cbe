// wsync::nccl and vLLM's NCCL receive pipeline. Everywhere: the unique-id codec, the blocked
// answers, and receive_tensors against an in-process trainer (tests/support/host_trainer.hpp),
// unpacked and packed. With a CUDA device and NCCL: a one-rank communicator (join, warm-up, the
// bucketed broadcast, abort), a join whose peer never comes ending at its deadline, and the
// receive pipeline on device memory. NCCL refuses two ranks on one GPU, so nothing here moves
// bytes between two members (docs/transports.md says what is untested).

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "host_trainer.hpp"
#include "nccl/plan.hpp"
#include "random_bytes.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl.hpp"
#include "wsync/transports/nccl_receiver.hpp"

namespace wsync::nccl {
namespace {

using namespace std::chrono_literals;

unique_id id_of(std::uint64_t seed) {
  auto bytes = test::random_bytes(unique_id_bytes, seed);
  unique_id id{};
  std::memcpy(id.data(), bytes.data(), id.size());
  return id;
}

TEST(nccl_unique_id, round_trips_through_standard_base64) {
  for (std::uint64_t seed = 1; seed < 50; ++seed) {
    const auto id = id_of(seed);
    const auto text = unique_id_to_base64(id);
    EXPECT_EQ(text.size(), 172u);
    EXPECT_EQ(text.substr(171), "=");  // 128 = 42 x 3 + 2: one pad
    auto back = unique_id_from_base64(text);
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(*back, id);
  }
  unique_id zeros{};
  EXPECT_EQ(unique_id_to_base64(zeros), std::string(171, 'A') + "=");
  unique_id ones;
  ones.fill(std::byte{0xff});
  EXPECT_EQ(unique_id_to_base64(ones).substr(0, 8), "////////");
}

TEST(nccl_unique_id, refuses_what_is_not_standard_padded_base64_of_128_bytes) {
  const auto good = unique_id_to_base64(id_of(3));
  auto refused = [](const std::string& text) {
    auto r = unique_id_from_base64(text);
    return r ? std::string("accepted") : r.error().message;
  };
  std::string url = good;
  url[5] = '-';  // the URL-safe alphabet
  EXPECT_EQ(refused(url).rfind("not standard base64", 0), 0u);
  std::string mid = good;
  mid[8] = '=';  // padding inside
  EXPECT_EQ(refused(mid).rfind("not standard base64", 0), 0u);
  EXPECT_EQ(refused(good.substr(0, 171)).rfind("not standard base64", 0), 0u);  // unpadded
  EXPECT_EQ(refused(""),
            "not standard base64 (RFC 4648, padded; the URL-safe alphabet is refused)");
  EXPECT_EQ(refused("AAAA"), "decodes to 3 bytes; an NCCL unique id has 128");
  EXPECT_EQ(refused(good.substr(0, 168) + "AAAAAAA="),
            "decodes to 131 bytes; an NCCL unique id has 128");
  EXPECT_EQ(refused(good.substr(0, 168) + "AAA="), "accepted");  // "xxx=": two bytes
  EXPECT_EQ(refused(good.substr(0, 168) + "A=A=").rfind("not standard base64", 0), 0u);
}

TEST(nccl_ready, says_exactly_why_not) {
  auto r = ready();
  if (r) GTEST_SKIP() << "NCCL can run here";
  EXPECT_EQ(r.error().code, errc::blocked);
  const auto& m = r.error().message;
  const bool known = m.rfind("blocked: built without CUDA", 0) == 0 ||
                     m.rfind("blocked: no CUDA device (", 0) == 0 ||
                     m.rfind("blocked: NCCL library not loadable (", 0) == 0 ||
                     m.rfind("blocked: built without NCCL", 0) == 0;
  EXPECT_TRUE(known) << m;
  if (auto g = gpu::ready(); !g) {
    EXPECT_EQ(m, g.error().message);  // the GPU's reason comes first
  }
  auto c = communicator::join(id_of(1), 2, 1, 0, 100ms);
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().message, m);
  auto e = join_endpoint(id_of(1), 2, 1, 0, 100ms);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().message, m);
  EXPECT_FALSE(make_unique_id());
}

TEST(nccl_communicator, refuses_a_rank_outside_the_group_before_anything_else) {
  for (auto [n, rank] : {std::pair{2, 2}, std::pair{2, -1}, std::pair{0, 0}}) {
    auto c = communicator::join(id_of(2), n, rank, 0, 100ms);
    ASSERT_FALSE(c);
    EXPECT_EQ(c.error().code, errc::invalid_argument) << c.error().message;
  }
}

// --- the receive pipeline against an in-process trainer --------------------------------------

struct trainer_update {
  std::vector<tensor_spec> specs;
  std::vector<std::vector<std::byte>> bytes;
};

// Tensors of awkward sizes (odd, empty, larger than a packing buffer) and several dtypes.
trainer_update make_update(std::uint64_t seed) {
  trainer_update u;
  const std::vector<std::pair<dtype, std::vector<std::int64_t>>> shapes = {
      {dtype::bf16, {3, 5}}, {dtype::f32, {1000}},    {dtype::u8, {7}},  {dtype::f16, {0, 4}},
      {dtype::i64, {33}},    {dtype::bf16, {64, 64}}, {dtype::f32, {1}}, {dtype::u8, {4099}},
  };
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    tensor_spec s;
    s.name = "layer." + std::to_string(i);
    s.dtype = shapes[i].first;
    s.shape = shapes[i].second;
    std::uint64_t n = dtype_itemsize(s.dtype);
    for (auto d : s.shape) n *= static_cast<std::uint64_t>(d);
    s.nbytes = n;
    auto raw = test::random_bytes(n, seed * 100 + i);
    std::vector<std::byte> b(n);
    if (n > 0) std::memcpy(b.data(), raw.data(), n);
    u.specs.push_back(s);
    u.bytes.push_back(std::move(b));
  }
  return u;
}

const checksum_method chunked{checksum_algorithm::xxh3_64_chunked, 4096};

void expect_received(const trainer_update& u, const received_tensors& got) {
  ASSERT_EQ(got.offsets.size(), u.specs.size());
  ASSERT_EQ(got.checksums.size(), u.specs.size());
  for (std::size_t i = 0; i < u.specs.size(); ++i) {
    EXPECT_EQ(got.offsets[i] % tensor_alignment, 0u) << i;
    ASSERT_LE(got.offsets[i] + u.specs[i].nbytes, got.segment.nbytes) << i;
    if (i > 0) {
      EXPECT_GE(got.offsets[i], got.offsets[i - 1] + u.specs[i - 1].nbytes) << i;
    }
    const std::byte* at = got.segment.data + got.offsets[i];
    EXPECT_TRUE(u.bytes[i].empty() || std::memcmp(at, u.bytes[i].data(), u.bytes[i].size()) == 0)
        << u.specs[i].name;
    EXPECT_EQ(got.checksums[i], checksum_compute(u.bytes[i].data(), u.bytes[i].size(), chunked))
        << u.specs[i].name;
  }
}

TEST(nccl_receiver, lands_each_unpacked_broadcast_at_its_aligned_place) {
  auto u = make_update(1);
  testing::host_trainer trainer;
  trainer.sends = testing::trainer_broadcasts(u.bytes, false, 0);
  auto got = receive_tensors(trainer, u.specs, {}, chunked, std::chrono::steady_clock::now() + 1s);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(trainer.receives_done, u.specs.size());
  EXPECT_TRUE(trainer.sends.empty());
  EXPECT_EQ(got->staging_bytes, 0u);
  expect_received(u, *got);
}

TEST(nccl_receiver, unpacks_vllm_packed_groups_through_one_staging_buffer) {
  auto u = make_update(2);
  for (std::uint64_t bound :
       {std::uint64_t{1}, std::uint64_t{100}, std::uint64_t{5000}, std::uint64_t{1} << 30}) {
    SCOPED_TRACE("packed_buffer_size_bytes " + std::to_string(bound));
    testing::host_trainer trainer;
    trainer.sends = testing::trainer_broadcasts(u.bytes, true, bound);
    const auto broadcasts = trainer.sends.size();
    std::uint64_t largest = 0;
    for (const auto& b : trainer.sends) largest = std::max<std::uint64_t>(largest, b.size());
    packing how{true, bound, 2};
    auto got =
        receive_tensors(trainer, u.specs, how, chunked, std::chrono::steady_clock::now() + 1s);
    ASSERT_TRUE(got) << got.error().message;
    EXPECT_EQ(trainer.receives_done, broadcasts);
    EXPECT_EQ(got->staging_bytes, largest);
    expect_received(u, *got);
  }
}

TEST(nccl_receiver, a_trainer_that_stops_or_sends_other_sizes_fails_the_receive_and_the_group) {
  auto u = make_update(3);
  {
    testing::host_trainer trainer;
    trainer.sends = testing::trainer_broadcasts(u.bytes, false, 0);
    trainer.sends.pop_back();  // the trainer stops one tensor short
    auto got =
        receive_tensors(trainer, u.specs, {}, chunked, std::chrono::steady_clock::now() + 1s);
    ASSERT_FALSE(got);
    EXPECT_EQ(got.error().code, errc::timeout) << got.error().message;
    EXPECT_FALSE(trainer.broken().empty());
    auto again =
        receive_tensors(trainer, u.specs, {}, chunked, std::chrono::steady_clock::now() + 1s);
    ASSERT_FALSE(again);
    EXPECT_NE(again.error().message.find("the group was aborted"), std::string::npos)
        << again.error().message;
  }
  {
    testing::host_trainer trainer;
    trainer.sends = testing::trainer_broadcasts(u.bytes, true, 100);  // packed; receiver not
    auto got =
        receive_tensors(trainer, u.specs, {}, chunked, std::chrono::steady_clock::now() + 1s);
    ASSERT_FALSE(got);
    EXPECT_EQ(got.error().code, errc::io_error) << got.error().message;
  }
}

TEST(nccl_receiver, a_receiver_that_cannot_allocate_aborts_the_group) {
  // Rank 0 broadcasts the update anyway: were the group kept, the next update's receives would
  // take this one's bytes.
  auto u = make_update(4);
  for (bool packed : {false, true}) {
    SCOPED_TRACE(packed ? "packed" : "unpacked");
    testing::host_trainer trainer;
    trainer.sends = testing::trainer_broadcasts(u.bytes, packed, packed ? 100 : 0);
    trainer.allocations_left = packed ? 1 : 0;  // packed: the staging buffer fails
    packing how{packed, 100, 2};
    auto got =
        receive_tensors(trainer, u.specs, how, chunked, std::chrono::steady_clock::now() + 1s);
    ASSERT_FALSE(got);
    EXPECT_NE(got.error().message.find("out of device memory"), std::string::npos)
        << got.error().message;
    EXPECT_EQ(trainer.broken(), got.error().message);
    trainer.allocations_left = -1;
    auto again =
        receive_tensors(trainer, u.specs, how, chunked, std::chrono::steady_clock::now() + 1s);
    ASSERT_FALSE(again);
    EXPECT_NE(again.error().message.find("the group was aborted"), std::string::npos)
        << again.error().message;
  }
}

// --- with a CUDA device and NCCL ---------------------------------------------------------------

TEST(nccl_gpu, a_one_rank_group_joins_warms_up_and_broadcasts_in_buckets) {
  if (auto r = ready(); !r) GTEST_SKIP() << r.error().message;
  auto id = make_unique_id();
  ASSERT_TRUE(id) << id.error().message;
  auto comm = communicator::join(*id, 1, 0, 0, 60s);
  ASSERT_TRUE(comm) << comm.error().message;
  ASSERT_TRUE(comm->warm_up(60s));
  constexpr std::uint64_t MiB = std::uint64_t{1} << 20;
  const std::vector<std::uint64_t> segment = {9 * MiB + 77};
  auto bytes = test::random_bytes(segment[0], 5);
  auto buf = gpu::device_buffer::make(segment[0]);
  ASSERT_TRUE(buf) << buf.error().message;
  ASSERT_TRUE(buf->upload(bytes.data(), bytes.size()));
  auto slices = nccl_plan::segment_slices(segment, 2 * MiB, 2);
  ASSERT_TRUE(slices);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  for (const auto& s : *slices) {
    auto r = comm->broadcast(static_cast<char*>(buf->data()) + s.offset, s.nbytes, 0, deadline);
    ASSERT_TRUE(r) << r.error().message;
  }
  ASSERT_TRUE(comm->wait(deadline));
  std::vector<unsigned char> back(bytes.size());
  ASSERT_TRUE(buf->download(back.data(), back.size()));
  EXPECT_EQ(back, bytes);  // the root's bytes are its own
  comm->abort("test abort");
  auto after = comm->broadcast(buf->data(), 16, 0, deadline);
  ASSERT_FALSE(after);
  EXPECT_NE(after.error().message.find("test abort"), std::string::npos);
}

TEST(nccl_gpu, a_join_whose_peer_never_comes_ends_at_its_deadline) {
  if (auto r = ready(); !r) GTEST_SKIP() << r.error().message;
  auto id = make_unique_id();
  ASSERT_TRUE(id) << id.error().message;
  const auto start = std::chrono::steady_clock::now();
  auto comm = communicator::join(*id, 2, 1, 0, 2s);  // rank 0 never joins
  ASSERT_FALSE(comm);
  EXPECT_EQ(comm.error().code, errc::timeout) << comm.error().message;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
}

TEST(nccl_gpu, the_receive_pipeline_runs_on_device_memory) {
  if (auto r = ready(); !r) GTEST_SKIP() << r.error().message;
  auto id = make_unique_id();
  ASSERT_TRUE(id) << id.error().message;
  // A one-rank group: rank 0 "broadcasts" to itself, so the bytes are whatever the buffers
  // held; what is checked is that every NCCL call, copy and checksum runs on the device.
  auto ep = join_endpoint(*id, 1, 0, 0, 60s);
  ASSERT_TRUE(ep) << ep.error().message;
  EXPECT_EQ((*ep)->memory().text(), "cuda:0");
  auto u = make_update(4);
  auto got = receive_tensors(**ep, u.specs, {true, 100, 2}, chunked,
                             std::chrono::steady_clock::now() + 60s);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(got->checksums.size(), u.specs.size());
  EXPECT_GT(got->staging_bytes, 0u);
}

}  // namespace
}  // namespace wsync::nccl
