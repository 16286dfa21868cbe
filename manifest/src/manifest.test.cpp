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
  EXPECT_EQ(update_context("", 7), "update_id=<none> rank=7");
}

// Errors about an id come before, or instead of, its check: a peer's id that is not one is cut
// and escaped there, not carried whole into every report and log.
TEST(manifest, update_context_cuts_and_escapes_an_id_that_is_not_one) {
  EXPECT_EQ(update_context("u-\n\x1b[2J", 1), "update_id=u-\\x0a\\x1b\\x5b2J rank=1");
  const std::string huge(50000, 'a');
  EXPECT_EQ(update_context(huge, 1),
            "update_id=" + std::string(64, 'a') + "...(50000 bytes) rank=1");
  const std::string longest(128, 'b');  // the longest valid id is shown whole
  EXPECT_EQ(update_context(longest, 1), "update_id=" + longest + " rank=1");
}

}  // namespace
}  // namespace wsync
