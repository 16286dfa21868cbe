#include "baselines.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <new>
#include <sstream>
#include <thread>
#include <vector>

#include "wsync/bench/timing.hpp"
#include "wsync/manifest/checksum.hpp"

namespace wsync {

host_buffer::host_buffer(std::uint64_t n) : size_(std::max<std::uint64_t>(n, 1)) {
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  ::madvise(p, size_, MADV_HUGEPAGE);
  data_ = static_cast<std::byte*>(p);
  std::memset(data_, 0, size_);
}

host_buffer::~host_buffer() {
  ::munmap(data_, size_);
}

namespace {

// Reaps `pid`, through signals that interrupt the wait.
void reap(pid_t pid, int* status = nullptr) {
  int ignored = 0;
  while (::waitpid(pid, status ? status : &ignored, 0) < 0 && errno == EINTR) {
  }
}

// Runs `argv` (argv[0] an absolute path) and waits for it; true when it exited 0.
bool run_program(const std::vector<std::string>& argv, std::string* why) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (int rc = ::posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ); rc != 0) {
    *why = argv[0] + ": posix_spawn: " + std::strerror(rc);
    return false;
  }
  int status = 0;
  reap(pid, &status);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  *why = argv[0] + " " + argv.back() + " failed (status " + std::to_string(status) + ")";
  return false;
}

}  // namespace

std::optional<double> cp_seconds(const std::string& dir, const std::byte* source, std::uint64_t n,
                                 unsigned repeat, bool then_sync, std::string* why) {
  std::string from = dir + "/cp-baseline-source";
  std::string to = dir + "/cp-baseline-copy";
  int fd = ::open(from.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return *why = "open " + from + ": " + std::strerror(errno), std::nullopt;
  for (std::uint64_t done = 0; done < n;) {
    ssize_t w = ::write(fd, source + done, n - done);
    if (w <= 0) {
      *why = "write " + from + ": " + std::strerror(errno);
      ::close(fd);
      ::unlink(from.c_str());
      return std::nullopt;
    }
    done += static_cast<std::uint64_t>(w);
  }
  ::close(fd);
  std::vector<double> rounds;
  bool ok = true;
  for (unsigned i = 0; ok && i < repeat + 1; ++i) {
    ::unlink(to.c_str());
    double t0 = now_s();
    ok = run_program({"/bin/cp", from, to}, why) &&
         (!then_sync || run_program({"/bin/sync", "-d", to}, why));
    if (i > 0) rounds.push_back(now_s() - t0);
  }
  ::unlink(to.c_str());
  ::unlink(from.c_str());
  if (!ok) return std::nullopt;
  return median(rounds);
}

copy_baselines copy_baselines_measure(const std::byte* source, std::uint64_t n, unsigned repeat) {
  std::vector<double> memcpy_s, hash_s;
  host_buffer dst(n);
  for (unsigned i = 0; i < repeat + 1; ++i) {
    double t0 = now_s();
    std::memcpy(dst.data(), source, n);
    double t1 = now_s();
    volatile std::uint64_t h = checksum_compute(source, n);
    (void)h;
    double t2 = now_s();
    if (i > 0) memcpy_s.push_back(t1 - t0), hash_s.push_back(t2 - t1);
  }
  return {gbps(n, median(memcpy_s)), gbps(n, median(hash_s))};
}

// --- the ucx baseline: ucx_perftest between two processes on loopback -------------------------

namespace {

// A TCP port on loopback that was free a moment ago.
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

// Runs ucx_perftest with `args` and UCX_TLS=tls; returns its pid, stdout read through *out_fd
// when out_fd is given (else discarded).
pid_t perftest_spawn(const std::string& tls, const std::vector<std::string>& args, int* out_fd) {
  int p[2] = {-1, -1};
  if (out_fd && ::pipe2(p, O_CLOEXEC) != 0) return -1;
  pid_t pid = ::fork();
  if (pid == 0) {
    int sink = out_fd ? p[1] : ::open("/dev/null", O_WRONLY);
    ::dup2(sink, STDOUT_FILENO);
    ::dup2(sink, STDERR_FILENO);
    ::setenv("UCX_TLS", tls.c_str(), 1);
    std::vector<char*> argv = {const_cast<char*>("ucx_perftest")};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp("ucx_perftest", argv.data());
    ::_exit(127);
  }
  if (out_fd) {
    ::close(p[1]);
    *out_fd = pid > 0 ? p[0] : (::close(p[0]), -1);
  }
  return pid;
}

void end(pid_t pid) {
  ::kill(pid, SIGKILL);
  reap(pid);
}

// Reads `fd` to its end into `text`, for at most `limit`. False with `why` when the limit
// passed (a client that stalls: a server that accepted and hung) or a stop signal came (the
// bench's handlers do not restart calls, so a blocked poll returns EINTR).
bool read_all(int fd, std::string& text, std::chrono::seconds limit, std::string& why) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  char buf[4096];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      why = "ucx_perftest gave no result within " + std::to_string(limit.count()) + " s";
      return false;
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0) {
      why = errno == EINTR ? "interrupted while ucx_perftest ran"
                           : std::string("poll failed: ") + std::strerror(errno);
      return false;
    }
    if (ready == 0) continue;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      text.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      return true;  // its end (or an error reading it: what came is judged)
    }
  }
}

}  // namespace

std::optional<double> perftest_gbps(const std::string& tls, const std::string& test,
                                    std::uint64_t message_bytes, std::string* why,
                                    const volatile sig_atomic_t* stop) {
  std::uint64_t iterations =
      std::clamp<std::uint64_t>((std::uint64_t{4} << 30) / message_bytes, 5, 1000);
  int port = free_port();
  std::vector<std::string> args = {"-t", test,
                                   "-s", std::to_string(message_bytes),
                                   "-n", std::to_string(iterations),
                                   "-p", std::to_string(port)};
  pid_t server = perftest_spawn(tls, args, nullptr);
  if (server < 0) return *why = "could not start ucx_perftest", std::nullopt;
  std::string text;
  // The server needs a moment to listen: a refused client is retried.
  for (int attempt = 0; attempt < 50 && text.find("Final:") == std::string::npos; ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (stop && *stop) {  // a signal outside the read (the nap, a fork) is seen here
      end(server);
      return *why = "interrupted while ucx_perftest ran", std::nullopt;
    }
    int fd = -1;
    auto client_args = args;
    client_args.insert(client_args.begin(), "127.0.0.1");
    pid_t client = perftest_spawn(tls, client_args, &fd);
    if (client < 0) break;
    text.clear();
    std::string stalled;
    const bool read = read_all(fd, text, std::chrono::seconds(60), stalled);
    ::close(fd);
    if (!read) {
      end(client);
      end(server);
      return *why = stalled, std::nullopt;
    }
    int status = 0;
    reap(client, &status);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
      end(server);
      return *why = "blocked: ucx_perftest is not installed (Debian package ucx-utils)",
             std::nullopt;
    }
  }
  end(server);
  // "Final: <iters> <lat 50%> <lat avg> <lat overall> <bw avg> <bw overall> <rate avg> ..."
  auto at = text.find("Final:");
  if (at == std::string::npos) {
    *why = "ucx_perftest printed no result: " + text.substr(0, 300);
    return std::nullopt;
  }
  std::istringstream fields(text.substr(at + 6));
  double v[6] = {};
  for (auto& x : v) fields >> x;
  if (!fields) return *why = "cannot read ucx_perftest's result line", std::nullopt;
  return v[5] * 1048576.0 / 1e9;  // perftest's MB is 2^20 bytes
}

}  // namespace wsync
