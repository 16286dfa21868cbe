// The TCP probe before every coordinator connect: a listener that does not answer (SYNs dropped)
// is given up within the limit, not after the kernel's SYN retries.

#include "tcp_probe.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "runtime_support.hpp"

namespace wsync {
namespace {

using namespace std::chrono_literals;

// A loopback listener that never accepts, its queue filled: the kernel then drops further SYNs,
// as a firewall or a host that is down does.
class silent_listener {
 public:
  silent_listener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), n) != 0 || ::listen(fd_, 0) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &n) != 0) {
      return;
    }
    port_ = ntohs(a.sin_port);
    for (int i = 0; i < 3; ++i) {  // what the queue holds, then SYNs that are dropped
      int f = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      (void)::connect(f, reinterpret_cast<sockaddr*>(&a), n);
      fillers_.push_back(f);
    }
    std::this_thread::sleep_for(100ms);  // the fillers' handshakes, over loopback
  }
  ~silent_listener() {
    for (int f : fillers_) ::close(f);
    if (fd_ >= 0) ::close(fd_);
  }
  std::uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::vector<int> fillers_;
};

TEST(tcp_probe, a_listener_that_does_not_answer_is_given_up_within_the_limit) {
  silent_listener silent;
  ASSERT_NE(silent.port(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(tcp_answers("127.0.0.1", silent.port(), 300ms), "no answer within 300 ms");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(tcp_probe, a_listener_answers_and_a_port_nobody_listens_on_refuses) {
  auto bound = [](int fd, bool listening) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof a;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), n) != 0 || (listening && ::listen(fd, 4)) ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) {
      return std::uint16_t{0};
    }
    return ntohs(a.sin_port);
  };
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int quiet = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // bound, not listening:
  const auto open = bound(listener, true);  // its port stays taken while the test runs
  const auto shut = bound(quiet, false);
  ASSERT_NE(open, 0);
  ASSERT_NE(shut, 0);
  EXPECT_EQ(tcp_answers("127.0.0.1", open, 2s), "");
  EXPECT_EQ(tcp_answers("127.0.0.1", shut, 2s), "Connection refused");
  ::close(listener);
  ::close(quiet);
}

// A name with several addresses, the first ones silent (a dead IPv6 route, say): the last still
// gets its turn within the limit, where the first used to take all of it.
TEST(tcp_probe, silent_first_addresses_leave_time_for_the_next) {
  silent_listener silent;
  ASSERT_NE(silent.port(), 0);
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in open{};
  open.sin_family = AF_INET;
  open.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof open;
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&open), n), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&open), &n), 0);
  sockaddr_in quiet = open;
  quiet.sin_port = htons(silent.port());
  addrinfo last{};
  last.ai_family = AF_INET;
  last.ai_socktype = SOCK_STREAM;
  last.ai_addrlen = sizeof open;
  last.ai_addr = reinterpret_cast<sockaddr*>(&open);
  addrinfo second = last;
  second.ai_addr = reinterpret_cast<sockaddr*>(&quiet);
  second.ai_next = &last;
  addrinfo first = second;
  first.ai_next = &second;
  // Three addresses, 1.5 s: each silent one waits its share (0.5 s), then the last answers. Taking
  // the whole limit at the first, the probe reached the last only with no time left, if at all.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(tcp_answers(&first, 1500ms), "");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1400ms);
  ::close(listener);
}

// The blocking connect every rank and `wsync status` make first: it used to wait in CAF's
// connect() for the kernel's SYN retries (about two minutes).
TEST(tcp_probe, a_coordinator_that_does_not_answer_fails_the_connect_within_the_limit) {
  auto silent = std::make_unique<silent_listener>();
  ASSERT_NE(silent->port(), 0);
  cluster_system sys(200ms);
  endpoint where;
  where.host = "127.0.0.1";
  where.port = silent->port();
  auto done = std::async(std::launch::async, [&] { return sys.connect(where, 300ms); });
  if (done.wait_for(10s) != std::future_status::ready) {
    silent.reset();  // the next SYN is answered with a reset, so the connect ends
    FAIL() << "connect still blocked after 10 s";
  }
  auto c = done.get();
  ASSERT_FALSE(c);
  EXPECT_NE(sys.get().render(c.error()).find("no answer within 300 ms"), std::string::npos)
      << sys.get().render(c.error());
}

}  // namespace
}  // namespace wsync
