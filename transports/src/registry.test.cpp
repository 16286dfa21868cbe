// The transport registry, strict option parsing and the segment packer.

#include "wsync/transports/registry.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>

#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

TEST(registry, unknown_transport_lists_the_known_ones) {
  for (const char* name : {"nope", "carrier-pigeon"}) {
    auto t = make_transport(name);
    ASSERT_FALSE(t);
    EXPECT_EQ(t.error().code, errc::unknown_transport);
    EXPECT_TRUE(contains(t.error().message, name)) << t.error().message;
    EXPECT_TRUE(contains(t.error().message, "local-clone")) << t.error().message;
    EXPECT_TRUE(contains(t.error().message, "shared-memory")) << t.error().message;
  }
  EXPECT_TRUE(transport_known("local-clone"));
  EXPECT_TRUE(transport_known("shared-memory"));
  EXPECT_FALSE(transport_known("nope"));
  EXPECT_FALSE(transport_known(""));
}

TEST(registry, every_builtin_is_listed_once_and_cannot_be_added_twice) {
  auto names = builtin_transports().names();
  EXPECT_EQ(std::count(names.begin(), names.end(), "local-clone"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "shared-memory"), 1);
  transport_registry r;
  register_builtin_transports(r);
  EXPECT_EQ(r.names(), names);
  auto again = r.add(*builtin_transports().find("local-clone"));
  ASSERT_FALSE(again);
  EXPECT_TRUE(contains(again.error().message, "local-clone"));
  EXPECT_EQ(r.names(), names);
  for (const auto& name : names) {
    // file-mmap needs a directory (only its publisher and consumer touch it); the rest need none.
    transport_options options;
    if (name == "file-mmap") options["dir"] = "/wsync-never-created";
    auto t = make_transport(name, options);
    // The GPU transports answer blocked here (gpu.test.cpp checks why); every other must build.
    if (name == "cuda-ipc" || name == "cuda-vmm" || name == "nccl") continue;
    ASSERT_TRUE(t) << name << ": " << t.error().message;
    EXPECT_EQ((*t)->name(), name);
  }
}

TEST(registry, unknown_option_keys_are_refused_by_name) {
  auto shm = make_transport("shared-memory", {{"slotz", "2"}});
  ASSERT_FALSE(shm);
  EXPECT_EQ(shm.error().code, errc::invalid_argument);
  EXPECT_TRUE(contains(shm.error().message, "slotz")) << shm.error().message;
  EXPECT_TRUE(contains(shm.error().message, "known: slots")) << shm.error().message;
  // local-clone takes no options at all.
  auto local = make_transport("local-clone", {{"slots", "2"}});
  ASSERT_FALSE(local);
  EXPECT_EQ(local.error().code, errc::invalid_argument);
  EXPECT_TRUE(contains(local.error().message, "slots")) << local.error().message;
  // A known key next to an unknown one still fails, naming the unknown one.
  auto mixed = make_transport("shared-memory", {{"slots", "2"}, {"colour", "blue"}});
  ASSERT_FALSE(mixed);
  EXPECT_TRUE(contains(mixed.error().message, "colour")) << mixed.error().message;
}

TEST(registry, shared_memory_slots_must_be_a_positive_integer_in_range) {
  for (const char* bad : {"0", "abc", "2x", "", "-1", "65", "99999999999999999999999"}) {
    auto t = make_transport("shared-memory", {{"slots", bad}});
    ASSERT_FALSE(t) << "slots=" << bad;
    EXPECT_EQ(t.error().code, errc::invalid_argument) << "slots=" << bad;
    EXPECT_TRUE(contains(t.error().message, "slots")) << t.error().message;
    EXPECT_TRUE(contains(t.error().message, bad)) << t.error().message;
  }
  for (const char* good : {"1", "2", "64"}) {
    auto t = make_transport("shared-memory", {{"slots", good}});
    EXPECT_TRUE(t) << "slots=" << good << ": " << t.error().message;
  }
}

TEST(registry, capabilities_are_honest) {
  auto local = builtin_transports().find("local-clone");
  auto shm = builtin_transports().find("shared-memory");
  ASSERT_TRUE(local && shm);
  EXPECT_TRUE(local->caps.cpu_memory);
  EXPECT_FALSE(local->caps.cross_process);
  EXPECT_FALSE(local->caps.zero_copy_import);
  EXPECT_TRUE(shm->caps.cpu_memory);
  EXPECT_TRUE(shm->caps.cross_process);
  EXPECT_FALSE(shm->caps.cross_node);
  EXPECT_TRUE(shm->caps.zero_copy_import);
  auto t = make_transport("shared-memory");
  ASSERT_TRUE(t);
  EXPECT_EQ((*t)->caps().zero_copy_import, shm->caps.zero_copy_import);
}

constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

// Sizes around the interesting boundaries: empty, alignment multiples and their neighbours.
rc::Gen<std::uint64_t> tensor_size() {
  return rc::gen::oneOf(rc::gen::inRange<std::uint64_t>(0, 6000),
                        rc::gen::element<std::uint64_t>(0, 1, 255, 256, 257, 511, 512, 1001, 4096),
                        rc::gen::inRange<std::uint64_t>(6000, 40000));
}

RC_GTEST_PROP(pack_tensors, aligned_disjoint_bounded_and_in_order, ()) {
  auto sizes = *rc::gen::nonEmpty(rc::gen::container<std::vector<std::uint64_t>>(tensor_size()));
  auto limit = *rc::gen::oneOf(rc::gen::inRange<std::uint64_t>(1, 20000),
                               rc::gen::map(rc::gen::inRange<std::uint64_t>(1, 80),
                                            [](std::uint64_t k) { return k * tensor_alignment; }));
  std::vector<tensor_source> tensors;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    tensors.push_back({"t" + std::to_string(i),
                       dtype::u8,
                       {static_cast<std::int64_t>(sizes[i])},
                       {},
                       nullptr,
                       sizes[i]});
  }
  std::vector<tensor_descriptor> descs;
  std::vector<segment_descriptor> segments;
  RC_ASSERT(pack_tensors(tensors, limit, descs, segments).has_value());
  RC_ASSERT(descs.size() == sizes.size());
  RC_ASSERT(!segments.empty());
  RC_ASSERT(segments.size() <= descs.size());

  std::vector<std::vector<std::size_t>> members(segments.size());
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const auto& d = descs[i];
    RC_ASSERT(d.name == tensors[i].name);
    RC_ASSERT(d.nbytes == sizes[i]);
    RC_ASSERT(d.offset % tensor_alignment == 0);
    RC_ASSERT(d.segment < segments.size());
    RC_ASSERT(d.offset + d.nbytes <= segments[d.segment].nbytes);
    // Manifest order: segments are filled one after the other, never revisited.
    if (i > 0)
      RC_ASSERT(d.segment == descs[i - 1].segment || d.segment == descs[i - 1].segment + 1);
    members[d.segment].push_back(i);
  }
  for (std::size_t s = 0; s < segments.size(); ++s) {
    const auto& in = members[s];
    RC_ASSERT(!in.empty());  // no empty segment
    RC_ASSERT(segments[s].nbytes > 0);
    // Every pair of non-empty tensors in a segment is disjoint.
    for (std::size_t a = 0; a < in.size(); ++a) {
      for (std::size_t b = a + 1; b < in.size(); ++b) {
        const auto& x = descs[in[a]];
        const auto& y = descs[in[b]];
        if (x.nbytes == 0 || y.nbytes == 0) continue;
        RC_ASSERT(x.offset + x.nbytes <= y.offset || y.offset + y.nbytes <= x.offset);
      }
    }
    // The limit holds, except for a tensor larger than it, which has the segment to itself
    // (empty tensors take no room and may sit beside it).
    std::size_t nonempty = 0;
    bool oversize = false;
    for (auto i : in) {
      nonempty += descs[i].nbytes > 0;
      if (descs[i].nbytes > limit) {
        oversize = true;
        RC_ASSERT(descs[i].offset == 0);
      }
    }
    if (oversize) {
      RC_ASSERT(nonempty == 1);
    } else {
      RC_ASSERT(segments[s].nbytes <= std::max<std::uint64_t>(limit, 1));
    }
    // With a limit that is a multiple of the alignment, shared segments are padded to it.
    if (!oversize && limit % tensor_alignment == 0) {
      RC_ASSERT(segments[s].nbytes % tensor_alignment == 0);
    }
    // No needless segments: one is closed only when the next tensor, padded, would not fit
    // behind its last one.
    if (s + 1 < segments.size()) {
      const auto& last = descs[in.back()];
      const auto& next = descs[members[s + 1].front()];
      auto start = align_up(last.offset + last.nbytes, tensor_alignment);
      RC_ASSERT(align_up(start + next.nbytes, tensor_alignment) > limit);
    }
  }
}

TEST(pack_tensors, a_tensor_larger_than_the_limit_gets_its_own_segment) {
  std::vector<tensor_source> tensors = {{"small", dtype::u8, {100}, {}, nullptr, 100},
                                        {"big", dtype::u8, {5000}, {}, nullptr, 5000},
                                        {"after", dtype::u8, {10}, {}, nullptr, 10}};
  std::vector<tensor_descriptor> descs;
  std::vector<segment_descriptor> segments;
  ASSERT_TRUE(pack_tensors(tensors, 1024, descs, segments));
  ASSERT_EQ(segments.size(), 3u);
  EXPECT_EQ(descs[0].segment, 0u);
  EXPECT_EQ(descs[1].segment, 1u);
  EXPECT_EQ(descs[1].offset, 0u);
  EXPECT_EQ(descs[2].segment, 2u);
  EXPECT_EQ(segments[0].nbytes, 256u);
  EXPECT_GE(segments[1].nbytes, 5000u);
  EXPECT_EQ(segments[2].nbytes, 256u);
}

TEST(pack_tensors, padding_never_pushes_a_segment_past_the_limit) {
  // Behind a 10-byte tensor the next one starts at 256; under a 300-byte limit, padding that
  // segment to the alignment would make it 512 bytes.
  std::vector<tensor_source> tensors = {{"a", dtype::u8, {10}, {}, nullptr, 10},
                                        {"b", dtype::u8, {10}, {}, nullptr, 10},
                                        {"c", dtype::u8, {290}, {}, nullptr, 290}};
  std::vector<tensor_descriptor> descs;
  std::vector<segment_descriptor> segments;
  ASSERT_TRUE(pack_tensors(tensors, 300, descs, segments));
  for (std::size_t s = 0; s < segments.size(); ++s) {
    EXPECT_LE(segments[s].nbytes, 300u) << "segment " << s;
  }
  for (const auto& d : descs) {
    EXPECT_EQ(d.offset % tensor_alignment, 0u);
    EXPECT_LE(d.offset + d.nbytes, segments[d.segment].nbytes) << d.name;
  }
}

}  // namespace
}  // namespace wsync
