// The local cluster launcher (wsync demo's): a rank that exits before joining is named, with
// its status, at once rather than after the whole wait.

#include "wsync/cluster/local_cluster.hpp"

#include <gtest/gtest.h>

namespace wsync {
namespace {

TEST(local_cluster, a_consumer_that_exits_before_joining_is_named_at_once) {
  // Not wsync: /bin/sh given "consumer" as its script (which does not exist) exits at once.
  local_cluster cluster("/bin/sh");
  const pid_t pid = cluster.start({"consumer", "--rank", "3"});
  ASSERT_GT(pid, 0);
  EXPECT_EQ(cluster.name_of(pid), "consumer rank 3");
  const auto start = std::chrono::steady_clock::now();
  const auto why = cluster.await_consumers(1, std::chrono::seconds(20));
  EXPECT_EQ(why.rfind("consumer rank 3 exited before it joined (exit code ", 0), 0u) << why;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

}  // namespace
}  // namespace wsync
