#include "wsync/cluster/demo.hpp"

#include <dirent.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "wsync/actors/node.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

std::string random_token() {
  unsigned char b[16] = {};
  if (::getrandom(b, sizeof b, 0) != static_cast<ssize_t>(sizeof b)) return "wsync-demo";
  std::string s;
  for (auto c : b) s += "0123456789abcdef"[c >> 4], s += "0123456789abcdef"[c & 15];
  return s;
}

// Starts `exe args...` with the cluster token in the environment (not on the command line,
// where `ps` would show it).
pid_t launch(const std::string& exe, const std::vector<std::string>& args,
             const std::string& token) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  std::vector<char*> argv;
  std::string argv0 = "wsync";
  argv.push_back(argv0.data());
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::setenv("WSYNC_TOKEN", token.c_str(), 1);
  ::execv(exe.c_str(), argv.data());
  ::_exit(127);
}

// Waits for `pid` up to `limit`; true with its status if it ended.
bool wait_for(pid_t pid, std::chrono::milliseconds limit, int& status) {
  auto deadline = clock_type::now() + limit;
  while (clock_type::now() < deadline) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

void stop(pid_t pid) {
  int status = 0;
  ::kill(pid, SIGTERM);
  if (!wait_for(pid, std::chrono::seconds(10), status)) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
}

std::vector<std::string> leftovers(const std::vector<pid_t>& pids) {
  std::vector<std::string> found;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      for (auto pid : pids) {
        if (std::string(e->d_name).rfind("wsync-" + std::to_string(pid) + "-", 0) == 0) {
          found.emplace_back(e->d_name);
        }
      }
    }
    ::closedir(d);
  }
  return found;
}

}  // namespace

int demo_run(const demo_options& o, std::ostream& out) {
  auto started = clock_type::now();
  const std::string token = random_token();
  auto dir = std::filesystem::temp_directory_path() / ("wsync-demo-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string port_file = (dir / "coordinator.port").string();
  std::vector<pid_t> all;
  std::vector<pid_t> consumers, publishers;
  std::string failure;

  pid_t coordinator = launch(
      o.self_exe,
      {"coordinator", "--port", "0", "--port-file", port_file, "--update-deadline-ms", "60000"},
      token);
  all.push_back(coordinator);
  endpoint ep{"127.0.0.1", 0, token};
  for (auto deadline = clock_type::now() + std::chrono::seconds(20);
       ep.port == 0 && clock_type::now() < deadline;) {
    std::ifstream in(port_file);
    unsigned port = 0;
    if (in >> port)
      ep.port = static_cast<std::uint16_t>(port);
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (ep.port == 0) failure = "the coordinator did not start listening within 20 s";
  const std::string port = std::to_string(ep.port);

  if (failure.empty()) {
    for (int r = 0; r < o.consumers; ++r) {
      auto pid =
          launch(o.self_exe,
                 {"consumer", "--coordinator", "127.0.0.1:" + port, "--rank", std::to_string(r),
                  "--node", "n" + std::to_string(r % 2), "--model", o.layout},
                 token);
      consumers.push_back(pid);
      all.push_back(pid);
    }
    // Publish only once every consumer joined, so each one sees every version.
    for (auto deadline = clock_type::now() + std::chrono::seconds(30);;) {
      std::string err;
      auto s = json::parse(coordinator_status(ep, err), nullptr, false);
      int joined = 0;
      if (s.is_object()) {
        for (const auto& r : s["ranks"]) joined += r["role"] == "consumer";
      }
      if (joined == o.consumers) break;
      if (clock_type::now() > deadline) {
        failure = "only " + std::to_string(joined) + " of " + std::to_string(o.consumers) +
                  " consumers joined within 30 s";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  if (failure.empty()) {
    for (int r = 0; r < o.publishers; ++r) {
      auto pid =
          launch(o.self_exe,
                 {"publisher", "--coordinator", "127.0.0.1:" + port, "--rank", std::to_string(r),
                  "--ranks", std::to_string(o.publishers), "--node", "n" + std::to_string(r % 2),
                  "--layout", o.layout, "--versions", std::to_string(o.versions)},
                 token);
      publishers.push_back(pid);
      all.push_back(pid);
    }
    for (auto pid : publishers) {
      int status = 0;
      if (!wait_for(pid, std::chrono::minutes(10), status)) {
        failure = "publisher pid " + std::to_string(pid) + " did not finish within 10 minutes";
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
      } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        failure = "publisher pid " + std::to_string(pid) + " failed";
      }
    }
  }

  std::string err;
  auto status =
      json::parse(failure.empty() || ep.port ? coordinator_status(ep, err) : "", nullptr, false);
  for (auto pid : consumers) stop(pid);
  stop(coordinator);
  std::filesystem::remove_all(dir);
  if (!status.is_object()) {
    status = json{
        {"status", "fail"}, {"versions", 0}, {"committed_version", 0}, {"ranks", json::array()}};
    if (failure.empty()) failure = "no status from the coordinator: " + err;
  }
  status.erase("updates");
  if (auto left = leftovers(all); !left.empty()) failure = "left in /dev/shm: " + left.front();
  if (status.value("committed_version", 0u) != o.versions && failure.empty()) {
    failure = "committed version " + std::to_string(status.value("committed_version", 0u)) +
              ", expected " + std::to_string(o.versions);
  }
  for (const auto& r : status["ranks"]) {
    if (r["role"] == "consumer" && r["active_weight_version"] != o.versions && failure.empty()) {
      failure = "consumer rank " + r["rank"].dump() + " ends on version " +
                r["active_weight_version"].dump();
    }
  }
  if (!failure.empty()) {
    status["status"] = "fail";
    status["error"] = failure;
  }
  status["seconds"] = std::chrono::duration<double>(clock_type::now() - started).count();
  status["layout"] = o.layout;

  if (o.json) {
    out << status.dump() << std::endl;
  } else {
    out << "rank  node  role       state         active_version  received_from\n";
    for (const auto& r : status["ranks"]) {
      char line[256];
      std::snprintf(
          line, sizeof line, "%-5s %-5s %-10s %-13s %-15s %s\n", r["rank"].dump().c_str(),
          r.value("node", std::string()).c_str(), r.value("role", std::string()).c_str(),
          r.value("state", std::string()).c_str(),
          r["active_weight_version"].is_null() ? "-" : r["active_weight_version"].dump().c_str(),
          r["received_from"].is_null() ? "-" : r["received_from"].get<std::string>().c_str());
      out << line;
    }
    out << "demo " << status["status"].get<std::string>() << ": " << status["versions"]
        << " versions committed, "
        << "committed_version " << status["committed_version"] << ", "
        << status["seconds"].get<double>() << " s" << (failure.empty() ? "" : ", error: " + failure)
        << "\n";
  }
  return status["status"] == "pass" ? 0 : 1;
}

}  // namespace wsync
