#pragma once
// Launches cluster processes (the wsync binary itself) on loopback for the demo and the cluster
// benchmark: a coordinator on a free port, then ranks; stops and reaps them all.

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "wsync/actors/node.hpp"

namespace wsync {

/// A wait status as people read it: "exit code 3", "signal 9".
std::string exit_text(int status);

class local_cluster {
 public:
  explicit local_cluster(std::string self_exe);
  ~local_cluster();  ///< stops whatever still runs
  local_cluster(const local_cluster&) = delete;
  local_cluster& operator=(const local_cluster&) = delete;

  /// Starts the coordinator and waits until it listens. Empty string, or what went wrong.
  std::string start_coordinator(std::chrono::milliseconds update_deadline);
  /// Starts `wsync <args...>` with the cluster token in its environment; its stdout goes to
  /// `stdout_path` when given. -1 when fork failed. A started process gets SIGTERM when this one
  /// dies, so a killed launcher leaves no cluster behind.
  pid_t start(const std::vector<std::string>& args, const std::string& stdout_path = "");
  /// A file name in the cluster's private temporary directory.
  std::string temp_path(const std::string& name) const { return (dir_ / name).string(); }
  /// Waits until `count` consumer ranks joined. Empty string, or what went wrong.
  std::string await_consumers(int count, std::chrono::seconds limit);
  /// Waits for `pid` to exit; false if it ran past `limit` (it is then killed, unless
  /// `kill_after` is false: then it runs on and can be awaited again), or is not a process this
  /// cluster started. Both waits end early when SIGINT, SIGTERM or SIGHUP is pending for a caller
  /// that blocked them (see stopped()).
  bool await_exit(pid_t pid, std::chrono::milliseconds limit, int& status, bool kill_after = true);
  /// Whether a wait ended because SIGINT, SIGTERM or SIGHUP came.
  bool stopped() const { return stopped_; }
  /// SIGTERM to every rank still running, then (after up to 2 s) to the coordinator; SIGKILL to
  /// whatever still runs 10 s later.
  void stop_all();
  /// /dev/shm entries left by any process this cluster started.
  std::vector<std::string> leftovers() const;

  /// "consumer rank 2", "publisher rank 0", "the coordinator": what a process it started is.
  std::string name_of(pid_t pid) const;

  const endpoint& coordinator() const { return coordinator_; }
  pid_t coordinator_pid() const { return coordinator_pid_; }
  std::string coordinator_address() const;

 private:
  bool stopped_ = false;
  bool stopping_all_ = false;
  std::string exe_;
  std::filesystem::path dir_;
  std::string dir_error_;  ///< why dir_ could not be made: start_coordinator's answer
  endpoint coordinator_;
  pid_t coordinator_pid_ = -1;
  std::vector<pid_t> running_;
  std::vector<pid_t> started_;
  std::map<pid_t, std::string> names_;  ///< see name_of
};

}  // namespace wsync
