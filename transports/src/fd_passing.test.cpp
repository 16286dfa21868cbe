// Descriptor passing over a Unix socket: the descriptor arrives and refers to the same open file,
// a message without one says so, extra descriptors a peer attaches are closed rather than
// leaked, and the peer is recognised as the same user.

#include "src/fd_passing.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace wsync::fd_passing {
namespace {

std::size_t open_fds() {
  std::size_t n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
    ::closedir(d);
  }
  return n - 1;
}

class fd_passing_test : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, ends_), 0)
        << std::strerror(errno);
  }
  void TearDown() override {
    ::close(ends_[0]);
    ::close(ends_[1]);
  }
  int ends_[2] = {-1, -1};
};

TEST_F(fd_passing_test, a_descriptor_arrives_for_the_same_open_file) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  const char hello[] = "slot";
  ASSERT_EQ(send_with_fd(ends_[0], hello, sizeof hello, pipe_fds[1]),
            static_cast<ssize_t>(sizeof hello));
  ::close(pipe_fds[1]);  // the sender's copy; the receiver's keeps the pipe open
  char got[16] = {};
  int fd = -1;
  ASSERT_EQ(receive_with_fd(ends_[1], got, sizeof got, &fd), static_cast<ssize_t>(sizeof hello));
  EXPECT_STREQ(got, "slot");
  ASSERT_GE(fd, 0);
  EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC);
  ASSERT_EQ(::write(fd, "x", 1), 1);  // writes into the same pipe
  char c = 0;
  ASSERT_EQ(::read(pipe_fds[0], &c, 1), 1);
  EXPECT_EQ(c, 'x');
  ::close(fd);
  ::close(pipe_fds[0]);
}

TEST_F(fd_passing_test, a_message_without_a_descriptor_says_so) {
  const char none[] = "no";
  ASSERT_EQ(send_with_fd(ends_[0], none, sizeof none, -1), static_cast<ssize_t>(sizeof none));
  char got[8] = {};
  int fd = 123;
  ASSERT_EQ(receive_with_fd(ends_[1], got, sizeof got, &fd), static_cast<ssize_t>(sizeof none));
  EXPECT_EQ(fd, -1);
}

TEST_F(fd_passing_test, extra_descriptors_from_a_peer_are_closed_not_kept) {
  const auto before = open_fds();
  int a = ::open("/dev/null", O_RDONLY | O_CLOEXEC), b = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  // Two descriptors in one message, as a misbehaving peer could send.
  char byte = 1;
  iovec iov{&byte, 1};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  auto* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(2 * sizeof(int));
  int both[2] = {a, b};
  std::memcpy(CMSG_DATA(cm), both, sizeof both);
  ASSERT_EQ(::sendmsg(ends_[0], &msg, 0), 1);
  ::close(a);
  ::close(b);
  int fd = -1;
  char got = 0;
  ASSERT_EQ(receive_with_fd(ends_[1], &got, 1, &fd), 1);
  ASSERT_GE(fd, 0);
  ::close(fd);
  EXPECT_EQ(open_fds(), before) << "the second descriptor leaked";
}

TEST_F(fd_passing_test, the_peer_is_this_user) {
  EXPECT_TRUE(same_user(ends_[0]));
  EXPECT_FALSE(same_user(-1));
}

}  // namespace
}  // namespace wsync::fd_passing
