#include "src/parallel.hpp"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

namespace wsync {
namespace {

// Runs the work loop the way the publisher and consumer hash: items pulled from a counter.
int hash_like(unsigned threads) {
  constexpr std::size_t items = 10000;
  std::vector<int> done(items, 0);
  std::atomic<std::size_t> next{0};
  parallel::run(threads, [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < items;) ++done[k];
  });
  for (int d : done) {
    if (d != 1) return 1;
  }
  return 0;
}

TEST(parallel, every_item_is_done_once) {
  EXPECT_EQ(hash_like(1), 0);
  EXPECT_EQ(hash_like(8), 0);
}

// At a thread limit (RLIMIT_NPROC, a cgroup's pids.max) std::thread throws; a vector of joinable
// threads unwinding then ended the process. Now the caller's thread does the work alone.
TEST(parallel, a_thread_the_system_refuses_is_not_the_end_of_the_process) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root: a child takes an unused uid so that a thread limit of 1 binds";
  }
  pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    ::alarm(30);
    // Root is not held to RLIMIT_NPROC: become a uid with no process, then allow it one.
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    rlimit one{1, 1};
    if (::setrlimit(RLIMIT_NPROC, &one) != 0) ::_exit(4);
    ::_exit(hash_like(8));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  // A root in a user namespace may have no uid 65534 to become, or no say over limits.
  if (WEXITSTATUS(status) == 3) GTEST_SKIP() << "this root cannot become uid 65534 (setuid failed)";
  if (WEXITSTATUS(status) == 4) GTEST_SKIP() << "this root cannot set RLIMIT_NPROC";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace wsync
