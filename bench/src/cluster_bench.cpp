#include "wsync/bench/cluster_bench.hpp"
#include "wsync/manifest/checksum.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "wsync/bench/timing.hpp"
#include "wsync/cluster/local_cluster.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;

struct run_figures {
  std::string error;
  double publish = 0, commit = 0, data_max = 0, data_sum = 0, overhead = 0, overhead_cores = 0;
  std::uint64_t last_version = 0;
  /// The lowest version a consumer rank serves at the end, from the coordinator's status (0:
  /// none reported): the row's active_weight_version, measured rather than assumed.
  std::uint64_t active_version = 0;
  long rss_after_100 = -1, rss_at_end = -1;  ///< the coordinator's, in KiB (-1: not reached)
  long consumer_fds = -1;  ///< open descriptors of the consumer process after the last update
  /// The coordinator's control-plane messages per update (status `messages`), all updates.
  double updates_sent = -1, report_messages = -1;
  double coordinator_cpu_ms = -1;  ///< the coordinator's CPU time (user + system) per update
};

// CPU time (user + system) `pid` has used, in seconds, or -1.
double cpu_seconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return -1;
  std::istringstream fields(text.substr(close + 2));
  std::string skip;
  for (int i = 3; i < 14; ++i) fields >> skip;  // fields 3..13
  unsigned long long utime = 0, stime = 0;
  if (!(fields >> utime >> stime)) return -1;
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Resident set of `pid` in KiB, or -1.
long rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

// Open descriptors of `pid`, or -1.
long open_fds(pid_t pid) {
  std::error_code ec;
  long n = 0;
  for (std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec), end;
       !ec && it != end; it.increment(ec)) {
    ++n;
  }
  return ec ? -1 : n;
}

// Newlines in `path` from `offset` on (which moves past what was read).
std::size_t count_new_lines(const std::string& path, std::streamoff& offset) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(offset);
  std::size_t lines = 0;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    lines += static_cast<std::size_t>(std::count(buf, buf + in.gcount(), '\n'));
    offset += in.gcount();
  }
  return lines;
}

// The coordinator's status object, or null.
json status_of(const local_cluster& cluster) {
  std::string err;
  return json::parse(coordinator_status(cluster.coordinator(), err), nullptr, false);
}

// Waits until `count` consumer ranks are carried by their node's leader.
std::string await_carried(const local_cluster& cluster, int count) {
  int carried = 0;
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
       std::chrono::steady_clock::now() < deadline;) {
    auto s = status_of(cluster);
    carried = 0;
    if (s.is_object()) {
      for (const auto& r : s["ranks"]) carried += r.contains("via") && r["via"].is_string();
    }
    if (carried >= count) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return "only " + std::to_string(carried) + " of " + std::to_string(count) +
         " ranks were carried by their node's leader within 60 s";
}

// `consumers` ranks over `processes` consumer processes (rank r in process r * processes /
// consumers), node leaders offered or not.
run_figures run_one(const cluster_bench_options& o, int consumers, int processes,
                    bool node_leader) {
  run_figures f;
  local_cluster cluster(o.self_exe);
  if (f.error = cluster.start_coordinator(std::chrono::seconds(60)); !f.error.empty()) return f;
  const auto addr = cluster.coordinator_address();
  pid_t consumer = -1;
  int first_process_ranks = 0;
  for (int p = 0, rank = 0; p < processes; ++p) {
    const int count = (p + 1) * consumers / processes - rank;
    std::vector<std::string> args{
        "consumer", "--coordinator",       addr,      "--rank", std::to_string(rank),
        "--count",  std::to_string(count), "--model", o.layout};
    if (!node_leader) args.push_back("--no-node-leader");
    auto pid = cluster.start(args);
    if (p == 0) consumer = pid, first_process_ranks = count;
    rank += count;
  }
  if (f.error = cluster.await_consumers(consumers, std::chrono::seconds(60)); !f.error.empty()) {
    return f;
  }
  if (node_leader && processes > 1) {
    if (f.error = await_carried(cluster, consumers - first_process_ranks); !f.error.empty()) {
      return f;
    }
  }
  const double cpu_before = cpu_seconds(cluster.coordinator_pid());
  const auto outcomes = cluster.temp_path("outcomes.jsonl");
  auto pid = cluster.start({"publisher", "--coordinator", addr, "--rank", "0", "--layout", o.layout,
                            "--versions", std::to_string(o.repeat + 1), "--json"},
                           outcomes);
  // Wait for the publisher, taking the coordinator's RSS once 100 updates are done and again
  // at the end: history is bounded, so memory must stay flat however long the run.
  int status = 0;
  const auto limit = std::chrono::minutes(5) + std::chrono::milliseconds(50) * o.repeat;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::streamoff read = 0;
  std::size_t done = 0;
  while (!cluster.await_exit(pid, std::chrono::milliseconds(50), status, false)) {
    if (std::chrono::steady_clock::now() > deadline) {
      cluster.await_exit(pid, std::chrono::milliseconds(0), status);  // kills it
      f.error = "the publisher did not finish within " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(limit).count()) +
                " s";
      return f;
    }
    done += count_new_lines(outcomes, read);
    if (f.rss_after_100 < 0 && done >= 100) f.rss_after_100 = rss_kib(cluster.coordinator_pid());
  }
  f.rss_at_end = rss_kib(cluster.coordinator_pid());
  if (const double cpu = cpu_seconds(cluster.coordinator_pid()); cpu >= 0 && cpu_before >= 0) {
    f.coordinator_cpu_ms = (cpu - cpu_before) * 1e3 / (o.repeat + 1);
  }
  f.consumer_fds = open_fds(consumer);
  if (auto s = status_of(cluster); s.is_object()) {
    if (s.contains("messages") && s["messages"].is_object()) {
      const double updates = o.repeat + 1;
      f.updates_sent = s["messages"].value("updates_sent", 0.0) / updates;
      f.report_messages = s["messages"].value("report_messages", 0.0) / updates;
    }
    std::optional<std::uint64_t> lowest;
    for (const auto& r : s.value("ranks", json::array())) {
      if (!r.is_object() || r.value("role", std::string()) != "consumer") continue;
      const auto v = r.value("active_weight_version", std::uint64_t{0});
      lowest = lowest ? std::min(*lowest, v) : v;
    }
    f.active_version = lowest.value_or(0);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    f.error = WIFEXITED(status)
                  ? "the publisher exited with status " + std::to_string(WEXITSTATUS(status))
                  : "the publisher died of signal " + std::to_string(WTERMSIG(status));
    return f;
  }
  std::vector<double> publish, commit, data_max, data_sum, overhead, overhead_cores;
  // The ranks' own work cannot finish sooner than spread over this machine's cores.
  const double cores =
      std::min<double>(std::max(1u, std::thread::hardware_concurrency()), consumers);
  std::ifstream in(outcomes);
  std::string line;
  for (bool warm_up = true; std::getline(in, line); warm_up = false) {
    auto j = json::parse(line, nullptr, false);
    if (!j.is_object() || j.value("phase", std::string()) != "committed") {
      f.error = "an update did not commit: " + line;
      return f;
    }
    f.last_version = j.value("weight_version", std::uint64_t{0});
    int acked = 0;
    double mx = 0, sum = 0;
    for (const auto& r : j["ranks"]) {
      acked += r.value("acknowledged", false);
      mx = std::max(mx, r.value("data_s", 0.0));
      sum += r.value("data_s", 0.0);
    }
    if (acked != consumers) {
      f.error = std::to_string(acked) + " of " + std::to_string(consumers) + " acknowledged";
      return f;
    }
    if (warm_up) continue;  // the first update maps every slot
    double p = j.value("publish_s", 0.0), c = j.value("commit_s", 0.0);
    publish.push_back(p);
    commit.push_back(c + p);  // commit_s counts from the coordinator's receipt of the shard
    data_max.push_back(mx);
    data_sum.push_back(sum);
    overhead.push_back(c - mx);
    overhead_cores.push_back(c - std::max(mx, sum / cores));
  }
  // A publisher stopped early (a signal between versions) exits 0 with fewer outcomes: medians
  // of a short sample, or of none, are no figures.
  if (publish.size() != static_cast<std::size_t>(o.repeat)) {
    f.error = std::to_string(publish.size()) + " of " + std::to_string(o.repeat) +
              " timed updates committed";
    return f;
  }
  if (f.active_version != f.last_version) {
    f.error = "a consumer serves version " + std::to_string(f.active_version) + ", not the last, " +
              std::to_string(f.last_version);
    return f;
  }
  f.publish = median(publish);
  f.commit = median(commit);
  f.data_max = median(data_max);
  f.data_sum = median(data_sum);
  f.overhead = median(overhead);
  f.overhead_cores = median(overhead_cores);
  cluster.stop_all();
  if (auto left = cluster.leftovers(); !left.empty()) f.error = "left in /dev/shm: " + left.front();
  return f;
}

// One JSON row of a run.
json row_of(const cluster_bench_options& o, const run_figures& f, int consumers, int processes,
            bool node_leader) {
  auto or_null = [](auto v) {
    return v < 0 ? json(nullptr) : json(v);
  };
  return {{"mode", "cluster"},
          {"status", f.error.empty() ? "pass" : "fail"},
          {"blocker", nullptr},
          {"smoke", o.smoke},
          {"layout", o.layout},
          {"consumers", consumers},
          {"processes", processes},
          {"node_leader", node_leader},
          {"repeat", o.repeat},
          {"weight_version", f.last_version},
          {"active_weight_version", f.active_version},
          {"timings_s",
           {{"publish", f.publish},
            {"commit", f.commit},
            {"data_max", f.data_max},
            {"data_sum", f.data_sum},
            {"overhead", f.overhead},
            {"overhead_over_cores", f.overhead_cores}}},
          {"messages_per_update",
           {{"updates_sent", or_null(f.updates_sent)},
            {"report_messages", or_null(f.report_messages)}}},
          {"coordinator_cpu_ms_per_update", or_null(f.coordinator_cpu_ms)},
          {"coordinator_rss_kib",
           {{"after_100_updates", or_null(f.rss_after_100)},
            {"at_end", or_null(f.rss_at_end)},
            {"growth", f.rss_after_100 > 0 && f.rss_at_end > 0
                           ? json(static_cast<double>(f.rss_at_end) / f.rss_after_100 - 1)
                           : json(nullptr)}}},
          {"consumer_process_fds", or_null(f.consumer_fds)},
          {"env",
           {{"host", host_name()},
            {"cores", std::thread::hardware_concurrency()},
            {"checksum_isa", std::string(checksum_isa())},
            {"transport_notes",
             "coordinator, publisher and " +
                 (processes == 1 ? std::string("one process holding every consumer rank")
                                 : std::to_string(processes) + " consumer processes") +
                 ", CAF over loopback; shared-memory data plane"}}}};
}

}  // namespace

int cluster_bench_run(const cluster_bench_options& o, std::ostream& out) {
  double baseline = -1;
  int code = 0;
  auto counts = o.consumers;
  if (std::find(counts.begin(), counts.end(), 1) == counts.end()) counts.insert(counts.begin(), 1);
  std::sort(counts.begin(), counts.end());
  for (int c : counts) {
    const int processes = std::min(o.processes, c);
    if (processes == 1) {
      auto f = run_one(o, c, 1, true);
      auto row = row_of(o, f, c, 1, true);
      if (!f.error.empty()) row["error"] = f.error, code = 1;
      if (c == 1 && f.error.empty()) baseline = f.overhead;
      // null, not a number, when the baseline run failed
      row["baseline"] = {{"name", "single-consumer-overhead"},
                         {"seconds", baseline >= 0 ? json(baseline) : json(nullptr)}};
      row["ratio_to_baseline"] = baseline > 0 ? json(f.overhead / baseline) : json(nullptr);
      out << row.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
      continue;
    }
    // The same ranks and processes without node leaders first: the baseline of this count.
    double direct = -1;
    for (bool leader : {false, true}) {
      auto f = run_one(o, c, processes, leader);
      auto row = row_of(o, f, c, processes, leader);
      if (!f.error.empty()) row["error"] = f.error, code = 1;
      if (!leader && f.error.empty()) direct = f.overhead;
      row["baseline"] = {{"name", "no-node-leader-overhead"},
                         {"seconds", direct >= 0 ? json(direct) : json(nullptr)}};
      row["ratio_to_baseline"] = direct > 0 ? json(f.overhead / direct) : json(nullptr);
      out << row.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
    }
  }
  return code;
}

}  // namespace wsync
