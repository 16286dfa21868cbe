#include "wsync/cluster/demo.hpp"

#include <sys/mman.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "wsync/actors/stop_signals.hpp"
#include "wsync/cluster/local_cluster.hpp"
#include "wsync/cluster/status.hpp"

namespace wsync {

using json = nlohmann::json;

int demo_run(const demo_options& o, std::ostream& out) {
  auto started = std::chrono::steady_clock::now();
  // SIGINT / SIGTERM end the waits below and the demo stops its cluster in order, whether the
  // signal came to the whole terminal group or to the demo alone.
  block_stop_signals();
  local_cluster cluster(o.self_exe);
  std::string failure = cluster.start_coordinator(std::chrono::seconds(60));
  const std::string addr = cluster.coordinator_address();
  if (failure.empty()) {
    for (int r = 0; r < o.consumers && failure.empty(); ++r) {
      if (cluster.start({"consumer", "--coordinator", addr, "--rank", std::to_string(r), "--node",
                         "n" + std::to_string(r % 2), "--model", o.layout}) <= 0) {
        failure = "cannot start consumer rank " + std::to_string(r) + ": fork failed";
      }
    }
    // Publish only once every consumer joined, so each one sees every version.
    if (failure.empty()) failure = cluster.await_consumers(o.consumers, std::chrono::seconds(30));
  }
  if (failure.empty()) {
    std::vector<pid_t> publishers;
    for (int r = 0; r < o.publishers && failure.empty(); ++r) {
      auto pid =
          cluster.start({"publisher", "--coordinator", addr, "--rank", std::to_string(r), "--ranks",
                         std::to_string(o.publishers), "--node", "n" + std::to_string(r % 2),
                         "--layout", o.layout, "--versions", std::to_string(o.versions)});
      if (pid <= 0) {
        failure = "cannot start publisher rank " + std::to_string(r) + ": fork failed";
      } else {
        publishers.push_back(pid);
      }
    }
    for (auto pid : publishers) {
      int status = 0;
      if (!failure.empty()) break;
      if (!cluster.await_exit(pid, std::chrono::minutes(10), status)) {
        failure = cluster.stopped() ? "stopped by SIGINT, SIGTERM or SIGHUP"
                                    : cluster.name_of(pid) + " did not finish within 10 minutes";
      } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        failure = cluster.name_of(pid) + " (pid " + std::to_string(pid) + ") failed (" +
                  exit_text(status) + "; its log is above)";
      }
    }
  }

  std::string err;
  auto status = json::parse(coordinator_status(cluster.coordinator(), err), nullptr, false);
  cluster.stop_all();
  if (!status.is_object()) {
    status = json{
        {"status", "fail"}, {"versions", 0}, {"committed_version", 0}, {"ranks", json::array()}};
    if (failure.empty()) failure = "no status from the coordinator: " + err;
  }
  // Ranks that had to be killed leave their segments: say so (after any earlier failure) and
  // remove them, so a failed demo leaves /dev/shm as it found it.
  if (auto left = cluster.leftovers(); !left.empty()) {
    failure += (failure.empty() ? "" : "; ") + std::string("left in /dev/shm: ") + left.front() +
               (left.size() > 1 ? " and " + std::to_string(left.size() - 1) + " more" : "") +
               " (removed)";
    for (const auto& name : left) ::shm_unlink(("/" + name).c_str());
  }
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
  status["seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  status["layout"] = o.layout;

  if (o.json) {
    status.erase("updates");  // the status object: the per-rank table
    out << status.dump() << std::endl;
  } else {
    status_print(status.dump(), out);
    out << "demo " << status["status"].get<std::string>() << ": " << status["versions"]
        << " versions committed, "
        << "committed_version " << status["committed_version"] << ", "
        << status["seconds"].get<double>() << " s" << (failure.empty() ? "" : ", error: " + failure)
        << "\n";
  }
  return status["status"] == "pass" ? 0 : 1;
}

}  // namespace wsync
