#include "wsync/cluster/status.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

namespace wsync {
namespace {

using nlohmann::json;

// A status object with `n` consumers of one update, the last one failed with a reason.
json many_ranks(int n) {
  json ranks = json::array(), update_ranks = json::array();
  for (int r = 0; r < n; ++r) {
    const bool failed = r == n - 1;
    ranks.push_back({{"rank", r},
                     {"node", "n" + std::to_string(r % 4)},
                     {"role", "consumer"},
                     {"model", "m"},
                     {"state", failed ? "failed" : "acknowledged"},
                     {"active_weight_version", failed ? 0 : 3},
                     {"received_from", "publisher:0"},
                     {"reason", failed ? json("down: exit_reason(kill)") : json(nullptr)},
                     {"via", nullptr}});
    update_ranks.push_back({{"rank", r}, {"state", failed ? "failed" : "acknowledged"}});
  }
  return {{"status", "fail"},
          {"ranks", ranks},
          {"updates", json::array({{{"key", "m@3"},
                                    {"phase", "committed"},
                                    {"commit_s", 0.012},
                                    {"ranks", update_ranks}}})}};
}

TEST(status_print, every_rank_of_a_large_cluster_keeps_its_line_and_reasons_show) {
  std::ostringstream out;
  EXPECT_EQ(status_print(many_ranks(64).dump(), out), 1);  // "fail"
  std::istringstream lines(out.str());
  std::vector<std::string> rows;
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  // Header, 64 ranks, a blank line, the update header and one update row.
  ASSERT_EQ(rows.size(), 1u + 64 + 1 + 1 + 1) << out.str();
  EXPECT_NE(rows[64].find("failed"), std::string::npos) << rows[64];
  EXPECT_NE(rows[64].find("(down: exit_reason(kill))"), std::string::npos) << rows[64];
  EXPECT_EQ(rows[1].find('('), std::string::npos) << "no reason, no parentheses: " << rows[1];
  const auto& update = rows.back();
  EXPECT_EQ(update.rfind("m@3", 0), 0u) << update;
  EXPECT_NE(update.find("0.0120"), std::string::npos) << update;
  EXPECT_NE(update.find("63:failed"), std::string::npos) << "the row was cut: " << update;
}

TEST(status_print, a_passing_status_exits_0_and_garbage_is_refused) {
  auto s = many_ranks(1);
  s["status"] = "pass";
  std::ostringstream out;
  EXPECT_EQ(status_print(s.dump(), out), 0);
  EXPECT_EQ(status_print("not json", out), 1);
}

// A status of another build (fields missing, or of other types) prints with "-" for what it
// lacks, and fails, rather than reading past an entry or throwing.
TEST(status_print, a_status_missing_fields_prints_dashes) {
  auto s = nlohmann::json::parse(
      R"({"status":"pass","ranks":[{"rank":3},7],"updates":[{"key":"m@1","commit_s":null},{}]})");
  std::ostringstream out;
  EXPECT_EQ(status_print(s.dump(), out), 0);
  EXPECT_NE(out.str().find("3     -"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("m@1"), std::string::npos) << out.str();
  EXPECT_EQ(status_print(R"({"ranks":{"a":1}})", out), 1);
}

}  // namespace
}  // namespace wsync
