#include "wsync/sources/shard.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <set>

namespace wsync {
namespace {

TEST(shard, ranks_split_a_layout_between_them) {
  std::set<std::string> seen;
  std::uint64_t bytes = 0;
  for (std::int32_t r = 0; r < 3; ++r) {
    auto s = shard_load({"synthetic:65536:7", "", r, 3});
    ASSERT_TRUE(s) << s.error().message;
    for (const auto& t : s->tensors) {
      EXPECT_TRUE(seen.insert(t.name).second) << t.name << " published twice";
      bytes += t.nbytes;
    }
  }
  auto whole = layout_parse("synthetic:65536:7");
  ASSERT_TRUE(whole);
  EXPECT_EQ(seen.size(), whole->tensors.size());
  EXPECT_EQ(bytes, whole->bytes());
}

TEST(shard, generated_contents_differ_between_tensors) {
  auto s = shard_load({"synthetic:65536:2", "", 0, 1});
  ASSERT_TRUE(s);
  ASSERT_EQ(s->tensors.size(), 2u);
  ASSERT_EQ(s->tensors[0].nbytes, s->tensors[1].nbytes);
  EXPECT_NE(std::memcmp(s->tensors[0].data, s->tensors[1].data, s->tensors[0].nbytes), 0);
}

TEST(shard, bad_specs_say_what_is_wrong) {
  auto unknown = shard_load({"no-such-model", "", 0, 1});
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().code, errc::invalid_argument);
  EXPECT_NE(unknown.error().message.find("no-such-model"), std::string::npos);
  EXPECT_NE(unknown.error().message.find("(publisher rank 0)"), std::string::npos)
      << unknown.error().message;
  auto missing = shard_load({"", "/nonexistent/model.safetensors", 1, 2});
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("(publisher rank 1)"), std::string::npos)
      << missing.error().message;

  auto malformed = shard_load({"synthetic:x", "", 0, 1});
  ASSERT_FALSE(malformed);
  EXPECT_NE(malformed.error().message.find("synthetic:<bytes>:<tensors>"), std::string::npos);

  auto empty = shard_load({"synthetic:65536:2", "", 2, 3});
  ASSERT_FALSE(empty);
  EXPECT_NE(empty.error().message.find("no tensor falls to rank 2 of 3"), std::string::npos);

  auto outside = shard_load({"synthetic:65536:2", "", 3, 3});
  ASSERT_FALSE(outside);
  EXPECT_NE(outside.error().message.find("rank 3"), std::string::npos);
}

TEST(shard, model_id_defaults_to_what_is_published) {
  EXPECT_EQ(shard_model_id({"qwen2.5-0.5b", "", 0, 1}), "qwen2.5-0.5b");
  EXPECT_EQ(shard_model_id({"qwen2.5-0.5b", "/tmp/x.safetensors", 0, 1}), "safetensors");
}

TEST(layout_parse, synthetic_sizes_are_decimal_whole_and_bounded) {
  for (const char* bad : {"synthetic:-1:1", "synthetic:1:2x", "synthetic:1", "synthetic::1",
                          "synthetic:1:", "synthetic:0:1", "synthetic:1:0", "synthetic:+4096:1",
                          "synthetic:1:99999999999", "synthetic:99999999999999999999:1",
                          "synthetic:4398046511105:1"}) {
    auto l = layout_parse(bad);
    EXPECT_FALSE(l) << bad;
    if (!l) {
      EXPECT_NE(l.error().message.find("layout: "), std::string::npos);
    }
  }
  auto ok = layout_parse("synthetic:8192:2");
  ASSERT_TRUE(ok) << ok.error().message;
  EXPECT_EQ(ok->tensors.size(), 2u);
}

}  // namespace
}  // namespace wsync
