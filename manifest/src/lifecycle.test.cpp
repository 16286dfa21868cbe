#include "wsync/manifest/lifecycle.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace wsync {
namespace {

using s = update_state;
using e = update_event;

const std::vector<s> all_states = {s::announced,    s::imported, s::verified, s::installed,
                                   s::acknowledged, s::rejected, s::released};
const std::vector<e> all_events = {e::import_ok,   e::verify_ok, e::install_ok,
                                   e::acknowledge, e::reject,    e::release};

// The legal moves, written out independently of the implementation's table: the happy path,
// skipping verify, reject from any state before acknowledgement, release from any live state.
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

const char* const context = "update_id=u-1 rank=4";

std::string verb(e ev) {
  switch (ev) {
    case e::import_ok:
      return "import";
    case e::verify_ok:
      return "verify";
    case e::install_ok:
      return "install";
    case e::acknowledge:
      return "acknowledge";
    case e::reject:
      return "reject";
    case e::release:
      return "release";
  }
  return "?";
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.rfind(prefix, 0) == 0;
}

TEST(lifecycle, every_pair_is_legal_exactly_when_the_table_says) {
  int legal_seen = 0, illegal_seen = 0;
  for (auto from : all_states) {
    for (auto ev : all_events) {
      SCOPED_TRACE(std::string(update_state_name(from)) + " + " +
                   std::string(update_event_name(ev)));
      auto r = update_transition(from, ev, context);
      auto it = legal.find({from, ev});
      if (it != legal.end()) {
        ++legal_seen;
        ASSERT_TRUE(r) << r.error().message;
        EXPECT_EQ(*r, it->second);
      } else {
        ++illegal_seen;
        ASSERT_FALSE(r);
        EXPECT_EQ(r.error().code, errc::illegal_transition);
        const auto& msg = r.error().message;
        EXPECT_TRUE(starts_with(msg, "cannot " + verb(ev) + " update ")) << msg;
        EXPECT_NE(msg.find(std::string("(") + context + ")"), std::string::npos) << msg;
      }
    }
  }
  EXPECT_EQ(legal_seen, 15);
  EXPECT_EQ(illegal_seen, 7 * 6 - 15);
}

TEST(lifecycle, full_path_with_verify) {
  s state = s::announced;
  const std::vector<std::pair<e, s>> path = {{e::import_ok, s::imported},
                                             {e::verify_ok, s::verified},
                                             {e::install_ok, s::installed},
                                             {e::acknowledge, s::acknowledged},
                                             {e::release, s::released}};
  for (auto [ev, want] : path) {
    auto r = update_transition(state, ev, context);
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_EQ(*r, want);
    state = *r;
  }
  EXPECT_EQ(state, s::released);
}

TEST(lifecycle, full_path_with_verify_off) {
  s state = s::announced;
  for (auto ev : {e::import_ok, e::install_ok, e::acknowledge, e::release}) {
    auto r = update_transition(state, ev, context);
    ASSERT_TRUE(r) << r.error().message;
    state = *r;
  }
  EXPECT_EQ(state, s::released);
  auto skip_verify = update_transition(s::imported, e::install_ok, context);
  ASSERT_TRUE(skip_verify);
  EXPECT_EQ(*skip_verify, s::installed);
}

TEST(lifecycle, reject_path) {
  auto r = update_transition(s::verified, e::reject, context);
  ASSERT_TRUE(r);
  EXPECT_EQ(*r, s::rejected);
  r = update_transition(*r, e::release, context);
  ASSERT_TRUE(r);
  EXPECT_EQ(*r, s::released);
}

// Starts the refusal of `ev` in `from` with `text`, then " (<context>)".
void expect_text(s from, e ev, const std::string& text) {
  SCOPED_TRACE(std::string(update_state_name(from)) + " + " + std::string(update_event_name(ev)));
  auto r = update_transition(from, ev, context);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::illegal_transition);
  EXPECT_TRUE(starts_with(r.error().message, text)) << r.error().message;
  EXPECT_EQ(r.error().message, text + " (" + context + ")");
}

TEST(lifecycle, acknowledge_before_import_text) {
  expect_text(s::announced, e::acknowledge,
              "cannot acknowledge update before import_update succeeds");
  expect_text(s::announced, e::verify_ok, "cannot verify update before import_update succeeds");
  expect_text(s::announced, e::install_ok, "cannot install update before import_update succeeds");
}

TEST(lifecycle, acknowledge_before_install_text) {
  expect_text(s::imported, e::acknowledge, "cannot acknowledge update before install succeeds");
  expect_text(s::verified, e::acknowledge, "cannot acknowledge update before install succeeds");
}

TEST(lifecycle, every_event_after_release_is_refused_with_its_verb) {
  for (auto ev : all_events) {
    expect_text(s::released, ev, "cannot " + verb(ev) + " update after release");
  }
}

TEST(lifecycle, other_texts) {
  expect_text(s::rejected, e::acknowledge, "cannot acknowledge update after reject");
  expect_text(s::rejected, e::reject, "cannot reject update after reject");
  expect_text(s::acknowledged, e::reject, "cannot reject update in state acknowledged");
  expect_text(s::imported, e::import_ok, "cannot import update in state imported");
  expect_text(s::installed, e::install_ok, "cannot install update in state installed");
}

TEST(lifecycle, context_appears_in_the_message) {
  auto r = update_transition(s::announced, e::acknowledge, "update_id=u-xyz rank=17");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("update_id=u-xyz rank=17"), std::string::npos)
      << r.error().message;
  auto bare = update_transition(s::announced, e::acknowledge, "");
  ASSERT_FALSE(bare);
  EXPECT_EQ(bare.error().message, "cannot acknowledge update before import_update succeeds");
}

TEST(lifecycle, names_are_distinct) {
  std::set<std::string_view> states, events;
  for (auto st : all_states) states.insert(update_state_name(st));
  for (auto ev : all_events) events.insert(update_event_name(ev));
  EXPECT_EQ(states.size(), all_states.size());
  EXPECT_EQ(events.size(), all_events.size());
  EXPECT_EQ(states.count("invalid"), 0u);
  EXPECT_EQ(events.count("invalid"), 0u);
}

}  // namespace
}  // namespace wsync
