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

// What a rank reported of an update is kept by key and attempt, so that a resend of an update
// it answered (the answer lost with a node leader) sends exactly that answer again.
TEST(endpoint_state, a_ranks_answers_are_kept_per_attempt_for_a_resend) {
  endpoint_state st;
  auto report = [](std::string key, std::string state, std::string id) {
    rank_report r;
    r.key = std::move(key);
    r.rank = 3;
    r.state = std::move(state);
    r.update_id = std::move(id);
    return r;
  };
  remember_answer(st, report("m@1", "acknowledged", "a1"));
  remember_answer(st, report("m@2", "rejected", "b1"));
  remember_answer(st, report("m@2", "released", "b1"));
  remember_answer(st, report("m@2", "acknowledged", "b2"));  // a retry of version 2
  auto answers = answers_to(st, 3, "m@2", "b1");
  ASSERT_EQ(answers.size(), 2u);
  EXPECT_EQ(answers[0].state, "rejected");
  EXPECT_EQ(answers[1].state, "released");
  EXPECT_EQ(answers_to(st, 3, "m@2", "b2").size(), 1u);
  EXPECT_TRUE(answers_to(st, 4, "m@2", "b1").empty());
  for (int v = 3; v < 3 + int(endpoint_state::answers_kept); ++v) {
    remember_answer(st, report("m@" + std::to_string(v), "acknowledged", "x"));
  }
  EXPECT_TRUE(answers_to(st, 3, "m@1", "a1").empty()) << "kept beyond the bound";
  EXPECT_EQ(st.answers[3].size(), endpoint_state::answers_kept);
}

// The same update handed again (a catch-up of it): a resend then replays this delivery's
// answers, never the earlier delivery's (a 'waiting' of then would land on the catch-up).
TEST(endpoint_state, an_update_handed_again_forgets_the_earlier_answers) {
  endpoint_state st;
  rank_report waiting;
  waiting.key = "m@4";
  waiting.rank = 2;
  waiting.state = "waiting";
  waiting.update_id = "d1";
  remember_answer(st, waiting);
  forget_answers(st, 2, "m@4", "d1");
  EXPECT_TRUE(answers_to(st, 2, "m@4", "d1").empty());
  auto acked = waiting;
  acked.state = "acknowledged";
  remember_answer(st, acked);
  auto now = answers_to(st, 2, "m@4", "d1");
  ASSERT_EQ(now.size(), 1u);
  EXPECT_EQ(now[0].state, "acknowledged");
}

}  // namespace
}  // namespace wsync::consumer_detail
