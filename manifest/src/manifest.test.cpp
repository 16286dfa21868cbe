#include "wsync/manifest/manifest.hpp"

#include <gtest/gtest.h>

#include <set>

namespace wsync {
namespace {

TEST(manifest, update_key_names_model_and_version) {
  EXPECT_EQ(update_key("qwen2.5-0.5b", 3), "qwen2.5-0.5b@3");
  EXPECT_NE(update_key("m", 1), update_key("m", 10));
  EXPECT_NE(update_key("m", 1), update_key("n", 1));
}

TEST(manifest, update_ids_are_unique_and_shaped) {
  std::set<update_id> ids;
  for (int i = 0; i < 64; ++i) {
    auto id = update_id_generate();
    EXPECT_EQ(id.rfind("u-", 0), 0u) << id;
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 64u);
}

TEST(manifest, update_context_names_id_and_rank) {
  EXPECT_EQ(update_context("u-1", 7), "update_id=u-1 rank=7");
}

}  // namespace
}  // namespace wsync
