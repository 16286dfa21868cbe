#include "wsync/manifest/lifecycle.hpp"

#include <gtest/gtest.h>

#include <set>

namespace wsync {
namespace {

using s = update_state;
using e = update_event;

const std::vector<s> all_states = {s::announced,    s::imported, s::verified, s::installed,
                                   s::acknowledged, s::rejected, s::released};
const std::vector<e> all_events = {e::import_ok,   e::verify_ok, e::install_ok,
                                   e::acknowledge, e::reject,    e::release};

// The legal moves, written out independently of the implementation's table.
const std::map<std::pair<s, e>, s> legal = {
    {{s::announced, e::import_ok}, s::imported},       {{s::announced, e::reject}, s::rejected},
    {{s::announced, e::release}, s::released},         {{s::imported, e::verify_ok}, s::verified},
    {{s::imported, e::install_ok}, s::installed},      {{s::imported, e::reject}, s::rejected},
    {{s::imported, e::release}, s::released},          {{s::verified, e::install_ok}, s::installed},
    {{s::verified, e::reject}, s::rejected},           {{s::verified, e::release}, s::released},
    {{s::installed, e::acknowledge}, s::acknowledged}, {{s::installed, e::reject}, s::rejected},
    {{s::installed, e::release}, s::released},         {{s::acknowledged, e::release}, s::released},
    {{s::rejected, e::release}, s::released},
};

TEST(lifecycle, every_pair_is_legal_exactly_when_the_table_says) {
  for (auto from : all_states) {
    for (auto ev : all_events) {
      auto r = update_transition(from, ev, "update_id=u rank=1");
      auto it = legal.find({from, ev});
      if (it != legal.end()) {
        ASSERT_TRUE(r) << update_state_name(from) << " + " << update_event_name(ev);
        EXPECT_EQ(*r, it->second);
      } else {
        ASSERT_FALSE(r) << update_state_name(from) << " + " << update_event_name(ev);
        EXPECT_EQ(r.error().code, errc::illegal_transition);
        EXPECT_NE(r.error().message.find("(update_id=u rank=1)"), std::string::npos);
      }
    }
  }
}

TEST(lifecycle, full_paths) {
  s state = s::announced;
  for (auto ev : {e::import_ok, e::verify_ok, e::install_ok, e::acknowledge, e::release}) {
    auto r = update_transition(state, ev, "");
    ASSERT_TRUE(r);
    state = *r;
  }
  EXPECT_EQ(state, s::released);
  auto skip_verify = update_transition(s::imported, e::install_ok, "");
  ASSERT_TRUE(skip_verify);
  EXPECT_EQ(*skip_verify, s::installed);
}

TEST(lifecycle, exact_texts) {
  auto starts = [](update_state from, update_event ev, const std::string& text) {
    auto r = update_transition(from, ev, "ctx");
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().message.rfind(text, 0), 0u) << r.error().message;
  };
  starts(s::announced, e::acknowledge, "cannot acknowledge update before import_update succeeds");
  starts(s::announced, e::verify_ok, "cannot verify update before import_update succeeds");
  starts(s::imported, e::acknowledge, "cannot acknowledge update before install succeeds");
  starts(s::verified, e::acknowledge, "cannot acknowledge update before install succeeds");
  starts(s::released, e::release, "cannot release update after release");
  starts(s::released, e::acknowledge, "cannot acknowledge update after release");
  starts(s::rejected, e::acknowledge, "cannot acknowledge update after reject");
  starts(s::acknowledged, e::reject, "cannot reject update in state acknowledged");
  starts(s::imported, e::import_ok, "cannot import update in state imported");
}

}  // namespace
}  // namespace wsync
