#include "wsync/cluster/local_cluster.hpp"

#include "wsync/transports/shared_memory.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>
#include <thread>

#include "wsync/actors/stop_signals.hpp"

namespace wsync {
namespace {

using clock_type = std::chrono::steady_clock;

// The private folders of clusters whose launcher died (SIGKILL, a crash) before its destructor
// ran: wsync-cluster-<pid>-<token> of a pid that no longer exists, untouched for a day (a
// launcher in another PID namespace sharing this folder has a pid this one cannot see).
void sweep_dead_clusters(const std::filesystem::path& base) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    constexpr std::string_view prefix = "wsync-cluster-";
    if (name.rfind(prefix, 0) != 0) continue;
    pid_t pid = 0;  // wsync-cluster-<pid>-<token>
    const char* end = name.data() + name.size();
    auto [at, bad] = std::from_chars(name.data() + prefix.size(), end, pid);
    if (bad != std::errc() || pid <= 0 || at == end || *at != '-') continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    const auto touched = std::filesystem::last_write_time(e.path(), ec);
    if (ec || std::filesystem::file_time_type::clock::now() - touched < std::chrono::hours(24)) {
      continue;
    }
    std::filesystem::remove_all(e.path(), ec);
  }
}

}  // namespace

local_cluster::local_cluster(std::string self_exe) : exe_(std::move(self_exe)) {
  // The token keeps other local users out of the loopback cluster: never a guessable one.
  coordinator_.token = random_hex(16);
  if (coordinator_.token.empty()) {
    dir_error_ =
        "no random cluster token (getrandom failed: " + std::string(std::strerror(errno)) + ")";
    return;
  }
  // No exception out of here: an unusable TMPDIR is the first step's error, not an abort.
  std::error_code ec;
  const auto base = std::filesystem::temp_directory_path(ec);
  if (ec) {
    dir_error_ = "no temporary directory (TMPDIR): " + ec.message();
    return;
  }
  sweep_dead_clusters(base);
  dir_ = base /
         ("wsync-cluster-" + std::to_string(::getpid()) + "-" + coordinator_.token.substr(0, 8));
  // Its own, new and private (it holds the port files the launcher trusts): an existing one
  // may be someone else's.
  if (::mkdir(dir_.c_str(), 0700) != 0) {
    dir_error_ = "cannot create " + dir_.string() + ": " + std::strerror(errno);
    dir_.clear();
  }
}

local_cluster::~local_cluster() {
  stop_all();
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

pid_t local_cluster::start(const std::vector<std::string>& args, const std::string& stdout_path) {
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    // Gone with the launcher, even one killed with SIGKILL (the processes clean up on SIGTERM).
    if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || ::getppid() != parent) ::_exit(125);
    if (!stdout_path.empty()) {
      int fd = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0 || ::dup2(fd, STDOUT_FILENO) < 0) ::_exit(126);
    }
    std::vector<char*> argv;
    std::string argv0 = "wsync";
    argv.push_back(argv0.data());
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    // The token goes through the environment, not the command line that `ps` shows.
    ::setenv("WSYNC_TOKEN", coordinator_.token.c_str(), 1);
    // The cluster lives on loopback, and this launcher talks to it without TLS: certificates
    // exported for real clusters must not switch its processes to TLS.
    for (const char* v : {"WSYNC_TLS_CERT", "WSYNC_TLS_KEY", "WSYNC_TLS_CA"}) ::unsetenv(v);
    ::execv(exe_.c_str(), argv.data());
    ::_exit(127);
  }
  if (pid > 0) {
    running_.push_back(pid), started_.push_back(pid);
    // Its role and rank, for errors that name what failed rather than a pid.
    std::string name = args.empty() ? "wsync" : args[0];
    auto rank = std::find(args.begin(), args.end(), "--rank");
    if (rank != args.end() && rank + 1 != args.end()) name += " rank " + *(rank + 1);
    names_[pid] = name == "coordinator" ? "the coordinator" : name;
  }
  return pid;
}

std::string local_cluster::name_of(pid_t pid) const {
  auto it = names_.find(pid);
  return it != names_.end() ? it->second : "pid " + std::to_string(pid);
}

std::string exit_text(int status) {
  return WIFEXITED(status) ? "exit code " + std::to_string(WEXITSTATUS(status))
                           : "signal " + std::to_string(WTERMSIG(status));
}

std::string local_cluster::start_coordinator(std::chrono::milliseconds update_deadline) {
  if (!dir_error_.empty()) return dir_error_;
  const auto port_file = (dir_ / "coordinator.port").string();
  coordinator_pid_ = start({"coordinator", "--port", "0", "--port-file", port_file,
                            "--update-deadline-ms", std::to_string(update_deadline.count())});
  for (auto deadline = clock_type::now() + std::chrono::seconds(20);
       clock_type::now() < deadline;) {
    if (stop_requested()) {
      stopped_ = true;
      return "stopped by SIGINT, SIGTERM or SIGHUP while waiting for the coordinator to listen";
    }
    std::ifstream in(port_file);
    unsigned port = 0;
    if (in >> port) {
      coordinator_.port = static_cast<std::uint16_t>(port);
      return {};
    }
    // One that exited says so now, with its status, rather than after the whole wait.
    if (int status = 0; await_exit(coordinator_pid_, std::chrono::milliseconds(0), status, false)) {
      return "the coordinator exited before it listened (" + exit_text(status) +
             "; its log is above)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return "the coordinator did not start listening within 20 s";
}

std::string local_cluster::coordinator_address() const {
  return coordinator_.host + ":" + std::to_string(coordinator_.port);
}

std::string local_cluster::await_consumers(int count, std::chrono::seconds limit) {
  int joined = 0;
  for (auto deadline = clock_type::now() + limit; clock_type::now() < deadline;) {
    if (stop_requested()) {
      stopped_ = true;
      return "stopped by SIGINT, SIGTERM or SIGHUP while waiting for consumer ranks";
    }
    // A consumer that exited (a bad option, a transport that cannot run) says so now, with
    // its status, rather than after the whole wait.
    for (auto pid : std::vector(running_)) {
      if (names_[pid].rfind("consumer", 0) != 0) continue;
      if (int status = 0; await_exit(pid, std::chrono::milliseconds(0), status, false)) {
        return names_[pid] + " exited before it joined (" + exit_text(status) +
               "; its log is above)";
      }
    }
    std::string err;
    auto s = nlohmann::json::parse(coordinator_status(coordinator_, err), nullptr, false);
    joined = 0;
    if (s.is_object()) {
      for (const auto& r : s["ranks"]) joined += r["role"] == "consumer";
    }
    if (joined >= count) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return "only " + std::to_string(joined) + " of " + std::to_string(count) +
         " consumer ranks joined within " + std::to_string(limit.count()) + " s";
}

bool local_cluster::await_exit(pid_t pid, std::chrono::milliseconds limit, int& status,
                               bool kill_after) {
  // Only a process this cluster started: waitpid(-1) would reap any child, kill(-1) signal
  // every process this user may.
  if (pid <= 0 || std::find(running_.begin(), running_.end(), pid) == running_.end()) return false;
  for (auto deadline = clock_type::now() + limit;;) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      running_.erase(std::remove(running_.begin(), running_.end(), pid), running_.end());
      return true;
    }
    if (clock_type::now() >= deadline) break;
    // The caller stops everything in order (stop_all): no SIGKILL. Within stop_all a second
    // Ctrl-C changes nothing: its waits end with the SIGKILL backstop.
    if (!stopping_all_ && stop_requested()) {
      stopped_ = true;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!kill_after) return false;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  running_.erase(std::remove(running_.begin(), running_.end(), pid), running_.end());
  return false;
}

void local_cluster::stop_all() {
  stopping_all_ = true;
  // Ranks first, so they leave while the coordinator still listens. A publisher waiting for an
  // outcome that will not come (its consumers left) sees the signal only once the wait ends;
  // the coordinator going away ends it. So the coordinator follows after a short grace, and
  // whatever still runs 10 s later is killed.
  std::vector<pid_t> ranks;
  for (auto pid : running_) {
    if (pid != coordinator_pid_) ranks.push_back(pid);
  }
  for (auto pid : ranks) ::kill(pid, SIGTERM);
  const auto grace = clock_type::now() + std::chrono::seconds(2);
  for (auto pid : ranks) {
    int status = 0;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(grace - clock_type::now());
    await_exit(pid, std::max(left, std::chrono::milliseconds(0)), status, false);
  }
  if (std::find(running_.begin(), running_.end(), coordinator_pid_) != running_.end()) {
    ::kill(coordinator_pid_, SIGTERM);
  }
  auto rest = running_;
  std::stable_partition(rest.begin(), rest.end(), [&](pid_t p) { return p != coordinator_pid_; });
  const auto backstop = clock_type::now() + std::chrono::seconds(10);  // one for all of them
  for (auto pid : rest) {
    int status = 0;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(backstop - clock_type::now());
    await_exit(pid, std::max(left, std::chrono::milliseconds(0)), status);
  }
  stopping_all_ = false;
}

std::vector<std::string> local_cluster::leftovers() const {
  return shm_segments_of(std::vector<int>(started_.begin(), started_.end()));
}

}  // namespace wsync
