#include "wsync/sources/layouts.hpp"

#include <gtest/gtest.h>

#include <set>

namespace wsync {
namespace {

TEST(layouts, qwen25_05b_matches_the_checkpoint) {
  auto l = layout_find("qwen2.5-0.5b");
  ASSERT_TRUE(l);
  EXPECT_EQ(l->tensors.size(), 290u);  // 24 layers x 12 + embeddings + final norm
  EXPECT_EQ(l->bytes(), 988065536u);   // 494,032,768 bf16 parameters
  EXPECT_EQ(l->tensors.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(l->tensors.front().shape, (std::vector<std::int64_t>{151936, 896}));
  EXPECT_EQ(l->tensors[3].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(l->tensors[3].shape, (std::vector<std::int64_t>{128, 896}));
}

TEST(layouts, llama3_8b_has_an_untied_head) {
  auto l = layout_find("llama-3-8b");
  ASSERT_TRUE(l);
  EXPECT_EQ(l->tensors.size(), 291u);  // 32 x 9 + embeddings + norm + lm_head
  EXPECT_EQ(l->tensors.back().name, "lm_head.weight");
  EXPECT_EQ(l->bytes(), 16060522496u);  // 8,030,261,248 parameters
}

TEST(layouts, names_are_unique_and_known) {
  for (const auto& name : layout_names()) {
    auto l = layout_find(name);
    ASSERT_TRUE(l) << name;
    std::set<std::string> seen;
    for (const auto& t : l->tensors) EXPECT_TRUE(seen.insert(t.name).second) << t.name;
  }
  EXPECT_FALSE(layout_find("gpt-5"));
}

TEST(layouts, synthetic_adds_up) {
  auto l = layout_synthetic(64u << 20, 10);
  EXPECT_EQ(l.tensors.size(), 10u);
  EXPECT_EQ(l.bytes(), 64u << 20);
}

}  // namespace
}  // namespace wsync
