// One event, one line: what a peer sent cannot forge log lines or reach the terminal raw.

#include "wsync/manifest/log.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

namespace wsync {
namespace {

TEST(log, control_bytes_are_escaped_and_long_lines_cut) {
  testing::internal::CaptureStderr();
  log_warn("refused a report (acknowledged of m@1\nwsync info: coordinator: forged\x1b[2J)");
  log_warn(std::string(10000, 'k'));
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_EQ(out.substr(0, out.find('\n') + 1),
            "wsync warn: refused a report (acknowledged of m@1\\x0awsync info: coordinator: "
            "forged\\x1b[2J)\n");
  const auto second = out.substr(out.find('\n') + 1);
  EXPECT_EQ(second.size(), std::string("wsync warn: ").size() + 8192 +
                               std::string(" ... (1808 more bytes not logged)\n").size());
  EXPECT_NE(second.find(" ... (1808 more bytes not logged)\n"), std::string::npos);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2);
}

// A C1 control (U+009B is ESC [ for a terminal) and bytes that are not UTF-8 are escaped;
// text in other scripts is not.
TEST(log, c1_controls_and_bytes_that_are_not_utf8_are_escaped) {
  testing::internal::CaptureStderr();
  log_warn(
      "name \xc2\x9b"
      "2J, caf\xc3\xa9 \xe6\x9d\x83\xe9\x87\x8d, cut \xc3, lone \x9b\xff");
  EXPECT_EQ(testing::internal::GetCapturedStderr(),
            "wsync warn: name \\xc2\\x9b2J, caf\xc3\xa9 \xe6\x9d\x83\xe9\x87\x8d, cut \\xc3, lone "
            "\\x9b\\xff\n");
}

}  // namespace
}  // namespace wsync
