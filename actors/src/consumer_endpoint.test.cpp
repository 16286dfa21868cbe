#include "consumer_endpoint.hpp"

#include <gtest/gtest.h>

namespace wsync::consumer_detail {
namespace {

// A key nobody owes an answer for any more (its ranks went, or moved on to the next update)
// goes, and its rejections with it: before, they stayed for good under node-leader churn.
TEST(endpoint_state, a_key_owed_by_nobody_goes_with_its_rejections) {
  endpoint_state st;
  st.owed["m@1"] = {};
  st.rejected["m@1"] = {{3, "tensor checksum mismatch"}};
  st.owed["m@2"] = {4};
  st.rejected["m@2"] = {{5, "waiting for the next version"}};
  forget_settled(st);
  EXPECT_EQ(st.owed.count("m@1"), 0u);
  EXPECT_EQ(st.rejected.count("m@1"), 0u);
  EXPECT_EQ(st.owed.count("m@2"), 1u);
  EXPECT_EQ(st.rejected.count("m@2"), 1u);
}

}  // namespace
}  // namespace wsync::consumer_detail
