#include "shared_memory/peer_fd.hpp"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "src/fd_passing.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/manifest/manifest.hpp"

namespace wsync::shm_peer {
namespace {

constexpr std::size_t max_name = 200;
constexpr int io_timeout_ms = 1000;

std::string prefix() {
  return "wsync-peer-" + std::to_string(::getuid()) + "-";
}

using fd_passing::same_user;

void set_timeouts(int fd) {
  fd_passing::set_timeouts(fd, io_timeout_ms);
}

// The answer: found (1 byte), the peer's rank, and with found a descriptor.
struct answer_body {
  std::uint8_t found = 0;
  std::int32_t rank = -1;
};

// Answers peers' requests on a thread of its own until destroyed.
class server {
 public:
  using find_fn = std::function<fetched(const std::string& name)>;
  explicit server(find_fn find);
  ~server();
  server(const server&) = delete;
  server& operator=(const server&) = delete;
  /// The socket's abstract name (without the leading NUL); empty when it could not listen (the
  /// consumers then work as before, without serving peers).
  const std::string& name() const { return name_; }
  /// In a forked child: closes this process's copies of the sockets; the thread is not there.
  void forget_in_child() {
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

 private:
  void run();
  void answer(int connection);

  find_fn find_;
  std::string name_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  ///< eventfd: tells the thread to stop
  std::thread thread_;
};

// The process's consumers that serve slots, and the one server that answers for them.
struct process_peers {
  struct entry {
    lookup_fn lookup;
    std::function<std::int32_t()> rank;
  };
  std::mutex mu;
  std::map<std::uint64_t, entry> consumers;
  std::uint64_t next_id = 1;
  std::unique_ptr<server> listening;

  // The first consumer but `skip` that maps `name`; mu held.
  fetched find_locked(const std::string& name, std::uint64_t skip) {
    for (auto& [id, e] : consumers) {
      if (id == skip) continue;
      if (int fd = e.lookup(name); fd >= 0) return {fd, e.rank()};
    }
    return {};
  }
};

process_peers& peers();

// A forked child has none of the parent's threads: it must not stop or join the parent's
// server, nor answer on its socket. It forgets them (the server object leaks, on purpose) and
// starts afresh with its own first consumer.
void forget_after_fork() {
  auto& p = peers();
  new (&p.mu) std::mutex;  // another thread may have held it at the fork
  if (auto* s = p.listening.release()) s->forget_in_child();
  p.consumers.clear();
}

process_peers& peers() {
  static process_peers* p = [] {
    ::pthread_atfork(nullptr, nullptr, &forget_after_fork);
    return new process_peers;  // never destroyed: consumers may outlive static destructors
  }();
  return *p;
}

}  // namespace

std::vector<std::string> peers_listening() {
  // Columns: Num RefCount Protocol Flags Type St Inode Path; abstract paths start with '@'.
  // Accepted connections show their listener's name too, hence the set.
  std::set<std::string> names;
  std::ifstream in("/proc/net/unix");
  std::string line;
  const auto want = "@" + prefix();
  while (std::getline(in, line)) {
    auto at = line.rfind(' ');
    if (at == std::string::npos) continue;
    auto path = line.substr(at + 1);
    if (path.rfind(want, 0) == 0 && path.size() - 1 <= max_name) names.insert(path.substr(1));
  }
  return {names.begin(), names.end()};
}

server::server(find_fn find) : find_(std::move(find)) {
  auto fail = [&](const char* what) {
    log_warn(std::string("shared-memory: cannot serve slots to peers on this node (") + what +
             ": " + std::strerror(errno) + "); a rank joining after the publisher exited " +
             "cannot get the current version from this one");
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    listen_fd_ = wake_fd_ = -1;
    name_.clear();
  };
  name_ = prefix() + std::to_string(::getpid()) + "-" + random_hex(8);
  listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) {
    fail("socket");
    return;
  }
  sockaddr_un a{};
  auto len = fd_passing::abstract_address(name_, a);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    fail("bind");
    return;
  }
  if (::listen(listen_fd_, 16) != 0) {
    fail("listen");
    return;
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    fail("eventfd");
    return;
  }
  thread_ = std::thread([this] { run(); });
}

server::~server() {
  if (thread_.joinable()) {
    std::uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
    thread_.join();
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void server::run() {
  fd_passing::serve(listen_fd_, wake_fd_, [this](int c) { answer(c); });
}

void server::answer(int c) {
  set_timeouts(c);
  if (!same_user(c)) return;  // another user's process: no answer at all
  char request[max_name + 1];
  auto n = ::recv(c, request, sizeof request, 0);
  if (n <= 0 || static_cast<std::size_t>(n) > max_name) return;
  auto found = find_(std::string(request, static_cast<std::size_t>(n)));
  const int fd = found.fd;
  answer_body body{static_cast<std::uint8_t>(fd >= 0), found.rank};
  (void)fd_passing::send_with_fd(c, &body, sizeof body, fd);
  if (fd >= 0) ::close(fd);
}

registration::registration(lookup_fn lookup, std::function<std::int32_t()> rank) {
  auto& p = peers();
  std::lock_guard lock(p.mu);
  id_ = p.next_id++;
  p.consumers[id_] = {std::move(lookup), std::move(rank)};
  if (!p.listening) {
    p.listening = std::make_unique<server>([&p](const std::string& name) {
      std::lock_guard inner(p.mu);
      return p.find_locked(name, 0);
    });
  }
}

registration::~registration() {
  auto& p = peers();
  std::unique_ptr<server> last;
  {
    std::lock_guard lock(p.mu);
    p.consumers.erase(id_);
    if (p.consumers.empty()) last = std::move(p.listening);
  }
  // Stopped outside the lock: its thread may be waiting for it to answer a request.
}

result<fetched> fetch(const std::string& name, const registration& me) {
  if (name.empty() || name.size() > max_name) {
    return make_error(errc::invalid_argument, "shared-memory: slot name of " +
                                                  std::to_string(name.size()) +
                                                  " bytes cannot be asked of peers");
  }
  std::string self;
  {
    auto& p = peers();
    std::lock_guard lock(p.mu);
    if (auto found = p.find_locked(name, me.id()); found.fd >= 0) return found;
    if (p.listening) self = p.listening->name();
  }
  int asked = 0;
  for (const auto& peer : peers_listening()) {
    if (peer == self) continue;
    int c = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (c < 0) break;
    set_timeouts(c);
    sockaddr_un a{};
    auto len = fd_passing::abstract_address(peer, a);
    if (::connect(c, reinterpret_cast<sockaddr*>(&a), len) != 0 || !same_user(c)) {
      ::close(c);
      continue;
    }
    ++asked;
    if (::send(c, name.data(), name.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(name.size())) {
      ::close(c);
      continue;
    }
    answer_body body;
    int fd = -1;
    auto n = fd_passing::receive_with_fd(c, &body, sizeof body, &fd);
    ::close(c);
    if (n == static_cast<ssize_t>(sizeof body) && body.found && fd >= 0) {
      return fetched{fd, body.rank};
    }
    if (fd >= 0) ::close(fd);
  }
  return make_error(errc::unknown_update,
                    "no peer on this node holds it (" + std::to_string(asked) + " asked)");
}

}  // namespace wsync::shm_peer
