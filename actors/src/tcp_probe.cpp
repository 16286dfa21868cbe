// A non-blocking TCP connect with a deadline (tcp_probe.hpp).

#include "tcp_probe.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace wsync {

std::string tcp_answers(const std::string& host, std::uint16_t port,
                        std::chrono::milliseconds limit) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); rc) {
    return "cannot resolve " + host + ": " + ::gai_strerror(rc);
  }
  auto why = tcp_answers(found, limit);
  ::freeaddrinfo(found);
  return why == "no address" ? "no address for " + host : why;
}

std::string tcp_answers(const addrinfo* found, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::string why = "no address";
  int untried = 0;
  for (auto* a = found; a; a = a->ai_next) ++untried;
  // Each address gets an equal share of the time left, so that a silent first address (a dead
  // IPv6 route, say) leaves time for the next.
  for (auto* a = found; a; a = a->ai_next, --untried) {
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    bool silent = false;
    if (err == EINPROGRESS) {
      const auto now = std::chrono::steady_clock::now();
      const auto until = now + (deadline - now) / untried;
      pollfd p{fd, POLLOUT, 0};
      int ready = -1;
      do {  // an interrupted wait goes on for what is left of it, not the whole share again
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            until - std::chrono::steady_clock::now());
        ready = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
      } while (ready < 0 && errno == EINTR);
      socklen_t len = sizeof err;
      if (ready == 0) {
        silent = true;
      } else if (ready < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
        err = errno;
      }
    }
    ::close(fd);
    if (!silent && err == 0) {
      why.clear();
      break;
    }
    why = silent ? "no answer within " + std::to_string(limit.count()) + " ms"
                 : std::string(std::strerror(err));
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
  return why;
}

}  // namespace wsync
