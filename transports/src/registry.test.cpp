#include "wsync/transports/registry.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

TEST(registry, unknown_transport_lists_the_known_ones) {
  auto t = make_transport("carrier-pigeon");
  ASSERT_FALSE(t);
  EXPECT_EQ(t.error().code, errc::unknown_transport);
  EXPECT_NE(t.error().message.find("carrier-pigeon"), std::string::npos);
  EXPECT_NE(t.error().message.find("local-clone"), std::string::npos);
  EXPECT_NE(t.error().message.find("shared-memory"), std::string::npos);
  EXPECT_TRUE(transport_known("shared-memory"));
  EXPECT_FALSE(transport_known("ucx-over-smoke-signals"));
}

TEST(registry, options_are_checked_by_name_and_value) {
  auto unknown = make_transport("shared-memory", {{"slotz", "2"}});
  ASSERT_FALSE(unknown);
  EXPECT_NE(unknown.error().message.find("slotz"), std::string::npos);
  EXPECT_NE(unknown.error().message.find("known: slots"), std::string::npos);
  EXPECT_FALSE(make_transport("shared-memory", {{"slots", "0"}}));
  EXPECT_FALSE(make_transport("shared-memory", {{"slots", "abc"}}));
  EXPECT_FALSE(make_transport("shared-memory", {{"slots", "2x"}}));
  EXPECT_FALSE(make_transport("local-clone", {{"slots", "2"}}));
  EXPECT_TRUE(make_transport("shared-memory", {{"slots", "3"}}));
}

TEST(registry, capabilities_are_honest) {
  auto local = builtin_transports().find("local-clone");
  auto shm = builtin_transports().find("shared-memory");
  ASSERT_TRUE(local && shm);
  EXPECT_FALSE(local->caps.cross_process);
  EXPECT_FALSE(local->caps.zero_copy_import);
  EXPECT_TRUE(shm->caps.cross_process);
  EXPECT_FALSE(shm->caps.cross_node);
  EXPECT_TRUE(shm->caps.zero_copy_import);
}

RC_GTEST_PROP(pack_tensors, aligned_disjoint_and_bounded, ()) {
  auto sizes =
      *rc::gen::container<std::vector<std::uint64_t>>(rc::gen::inRange<std::uint64_t>(0, 5000));
  RC_PRE(!sizes.empty());
  auto limit = *rc::gen::inRange<std::uint64_t>(256, 20000);
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
  std::uint64_t prev_end = 0;
  std::uint32_t prev_segment = 0;
  for (std::size_t i = 0; i < descs.size(); ++i) {
    const auto& d = descs[i];
    RC_ASSERT(d.offset % tensor_alignment == 0);
    RC_ASSERT(d.segment < segments.size());
    RC_ASSERT(d.offset + d.nbytes <= segments[d.segment].nbytes);
    if (d.segment == prev_segment && i > 0) RC_ASSERT(d.offset >= prev_end);
    // Only a tensor alone at the start of its segment may exceed the limit.
    if (d.offset + d.nbytes > limit) RC_ASSERT(d.offset == 0);
    prev_end = d.offset + d.nbytes;
    prev_segment = d.segment;
  }
  for (const auto& s : segments) RC_ASSERT(s.nbytes % tensor_alignment == 0);
}

}  // namespace
}  // namespace wsync
