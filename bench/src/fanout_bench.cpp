#include "wsync/bench/fanout_bench.hpp"
#include "wsync/manifest/checksum.hpp"

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "emulated_cluster.hpp"
#include "wsync/bench/rank_process.hpp"
#include "wsync/bench/timing.hpp"
#include "wsync/cluster/fanout_plan.hpp"
#include "wsync/cluster/fanout_router.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

// The update every fan-out round publishes: 16 tensors of --bytes / 16, in whole 256-byte steps
// and at least 256 bytes each.
constexpr std::uint64_t fanout_tensors = 16;
std::uint64_t fanout_update_bytes(const fanout_bench_options& o) {
  return fanout_tensors * std::max<std::uint64_t>(o.bytes / fanout_tensors / 256 * 256, 256);
}

using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

constexpr auto answer_timeout = std::chrono::seconds(300);

// Set by SIGINT/SIGTERM: the run stops waiting and tears the emulated cluster down on its way out.
volatile sig_atomic_t interrupted = 0;
extern "C" void on_fanout_interrupt(int) {
  interrupted = 1;
}

// Every emulated node talks TCP on its own veth: left to itself UCX would find the peers on
// this host and use shared memory across "nodes", and the emulation would measure nothing.
transport_options ucx_options(const fanout_bench_options& o) {
  return {{"tls", "tcp"},
          {"devices", emulated_cluster::device},
          {"chunk_bytes", std::to_string(o.chunk_bytes)},
          {"timeout_ms", "120000"}};
}

struct child {
  pid_t pid = -1;
  int fd = -1;
  bool alive = true;
};

// Forks a process into `node`'s namespace that runs body(fd) and exits; the parent keeps the
// other end of the socket.
child spawn(const emulated_cluster& cluster, unsigned node, const std::function<void(int)>& body) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return {};
  pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGINT, SIG_DFL);
    ::signal(SIGTERM, SIG_DFL);
    ::close(fds[0]);
    if (auto ok = cluster.enter(node); !ok) {
      channel_send(fds[1], {{"type", "error"}, {"reason", ok.error().message}});
      ::_exit(1);
    }
    try {
      body(fds[1]);
    } catch (...) {
      ::_exit(1);  // never unwind into the parent's code in this forked copy
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    return {};
  }
  return {pid, fds[0], true};
}

// The publisher node's process: publishes synthetic updates on request and hears the answers.
[[noreturn]] void publisher_process(int fd, const fanout_bench_options& o) {
  auto t = make_transport("ucx", ucx_options(o));
  auto pt = t ? (*t)->make_publisher() : result<std::unique_ptr<publisher_transport>>(t.error());
  if (!pt) {
    channel_send(fd, {{"type", "error"}, {"reason", pt.error().message}});
    ::_exit(1);
  }
  publisher_config cfg;
  cfg.model_id = "fanout";
  cfg.slot_wait = std::chrono::seconds(30);
  weight_publisher publisher(std::move(*pt), "ucx", cfg);
  const std::uint64_t each = fanout_update_bytes(o) / fanout_tensors;
  constexpr std::uint64_t tensors = fanout_tensors;
  std::vector<std::byte> source(each * tensors);
  std::uint64_t state = 0x9e3779b97f4a7c15ull;
  pattern_fill(source.data(), source.size(), state);
  std::vector<tensor_source> sources;
  for (std::uint64_t i = 0; i < tensors; ++i) {
    sources.push_back({"layer." + std::to_string(i) + ".weight",
                       dtype::u8,
                       {static_cast<std::int64_t>(each)},
                       {},
                       source.data() + i * each,
                       each});
  }
  channel_send(fd, {{"type", "ready"}});
  while (auto msg = channel_receive(fd, std::chrono::hours(24))) {
    const std::string type = (*msg)["type"];
    if (type == "publish") {
      auto m = publisher.publish(sources, (*msg)["version"].get<std::uint64_t>(),
                                 (*msg)["ranks"].get<std::vector<std::int32_t>>());
      channel_send(fd, m ? json{{"type", "manifest"}, {"manifest", manifest_to_json(*m)}}
                         : json{{"type", "error"}, {"reason", m.error().message}});
    } else if (type == "answer") {
      const std::string id = (*msg)["update_id"];
      const std::int32_t rank = (*msg)["rank"];
      const std::string outcome = (*msg)["outcome"];
      if (outcome == "acknowledged") (void)publisher.on_acknowledged(id, rank);
      if (outcome == "rejected") (void)publisher.on_rejected(id, rank, (*msg)["reason"]);
      if (outcome == "failed") (void)publisher.on_failed(id, rank, (*msg)["reason"]);
      for (const auto& released : (*msg)["released"]) {
        (void)publisher.on_released(released.get<std::string>(), rank);
      }
    } else if (type == "stop") {
      for (const auto& id : publisher.held_updates()) (void)publisher.release(id);
      channel_send(fd, {{"type", "stopped"}});
      break;
    }
  }
  ::_exit(0);
}

struct update_outcome {
  double commit_s = 0;
  double publish_s = 0;
  std::uint64_t version = 0;
  fanout_plan plan;
  std::map<std::int32_t, json> reports;  // acknowledged or rejected ranks
  std::vector<std::int32_t> failed;      // ranks that died
};

class fanout_run {
 public:
  fanout_run(const fanout_bench_options& o, const emulated_cluster& cluster)
      : o_(o), cluster_(cluster), ranks_(o.nodes * o.ranks_per_node) {}

  ~fanout_run() {
    auto stop = [](child& c, const char* type) {
      if (c.pid <= 0) return;
      if (c.alive && channel_send(c.fd, {{"type", type}})) {
        (void)channel_receive(c.fd, std::chrono::seconds(30));
      }
      ::close(c.fd);
      ::kill(c.pid, SIGKILL);  // a no-op for the ones that exited
      ::waitpid(c.pid, nullptr, 0);
    };
    for (auto& r : ranks_) stop(r, "stop");
    stop(publisher_, "stop");
  }

  result<void> start() {
    publisher_ = spawn(cluster_, 0, [&](int fd) { publisher_process(fd, o_); });
    if (auto ok = ready(publisher_, "publisher"); !ok) return ok.error();
    auto topts = ucx_options(o_);
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      ranks_[r] = spawn(cluster_, node_of(r), [&](int fd) {
        bench_consumer_process(fd, true, "ucx", topts, static_cast<std::int32_t>(r));
      });
      auto address = ready(ranks_[r], "consumer rank " + std::to_string(r));
      if (!address) return address.error();
      relay_address_[static_cast<std::int32_t>(r)] = *address;
    }
    auto t = make_transport("ucx", topts);
    if (!t) return t.error();
    transport_ = std::move(*t);
    return {};
  }

  std::size_t ranks() const { return ranks_.size(); }
  unsigned node_of(std::size_t rank) const {
    return 1 + static_cast<unsigned>(rank) / o_.ranks_per_node;
  }
  std::string node_name(std::size_t rank) const { return "n" + std::to_string(node_of(rank)); }

  // One update to `participants` along a plan of `shape`; when `victim` is set, that rank is
  // SIGKILLed `kill_after` seconds after the update went out.
  result<update_outcome> update(const std::vector<std::int32_t>& participants, plan_shape shape,
                                std::optional<std::int32_t> victim = std::nullopt,
                                double kill_after = 0) {
    update_outcome u;
    u.version = ++version_;
    double t0 = now_s();
    if (!channel_send(publisher_.fd,
                      {{"type", "publish"}, {"version", u.version}, {"ranks", participants}})) {
      return make_error(errc::io_error, "fanout: the publisher process went away");
    }
    auto answer = channel_receive(publisher_.fd, answer_timeout, &interrupted);
    if (!answer || (*answer)["type"] != "manifest") {
      return make_error(errc::io_error, "fanout: publish failed: " +
                                            (answer ? answer->value("reason", "?") : "no answer"));
    }
    auto m = manifest_from_json((*answer)["manifest"].get<std::string>());
    if (!m) return m.error();
    u.publish_s = now_s() - t0;

    plan_request req;
    req.publishers = {{0, "n0"}};
    for (auto r : participants) req.consumers.push_back({r, node_name(r)});
    req.shape = shape;
    req.degree = o_.degree;
    auto plan = plan_fanout(req);
    if (!plan) return plan.error();
    u.plan = *plan;
    // A rank pulls from its source in the plan, with the path up to the publisher as fallbacks,
    // so a relay that dies hands its subtree to its own source.
    auto handles = plan_handles(u.plan, m->transport_handle, relay_address_, *transport_);
    if (!handles) return handles.error();
    for (auto r : participants) {
      auto mine = *m;
      mine.transport_handle = handles->at(r);
      if (!channel_send(ranks_[r].fd, {{"type", "update"}, {"manifest", manifest_to_json(mine)}})) {
        return make_error(errc::io_error,
                          "fanout: consumer rank " + std::to_string(r) + " went away");
      }
    }
    if (victim) {
      std::this_thread::sleep_for(std::chrono::duration<double>(kill_after));
      ::kill(ranks_[*victim].pid, SIGKILL);
    }
    for (auto r : participants) {
      auto report = channel_receive(ranks_[r].fd, answer_timeout, &interrupted);
      if (interrupted) return make_error(errc::io_error, "fanout: interrupted");
      if (!report) {
        ranks_[r].alive = false;
        u.failed.push_back(r);
        continue;
      }
      u.reports[r] = *report;
    }
    u.commit_s = now_s() - t0;
    for (auto r : participants) {
      json a = {{"type", "answer"}, {"update_id", m->update_id}, {"rank", r}};
      if (auto it = u.reports.find(r); it != u.reports.end()) {
        a["outcome"] = it->second.value("acknowledged", false) ? "acknowledged" : "rejected";
        a["reason"] = it->second.value("reason", "");
        a["released"] = it->second.value("released", json::array());
        // This update too, when the rank let go of it at once (it copied it), or holds none of
        // it (rejected, maybe before importing anything; a second release is refused, harmless).
        if (it->second.value("released_self", false) || !it->second.value("acknowledged", false)) {
          a["released"].push_back(m->update_id);
        }
      } else {
        a["outcome"] = "failed";
        a["reason"] = "process died";
        a["released"] = json::array();
      }
      channel_send(publisher_.fd, a);
    }
    return u;
  }

 private:
  // Waits for a child's "ready"; returns its relay address (empty for the publisher).
  result<std::string> ready(child& c, const std::string& who) {
    if (c.pid <= 0) return make_error(errc::io_error, "fanout: could not start the " + who);
    auto msg = channel_receive(c.fd, std::chrono::seconds(60), &interrupted);
    if (!msg || (*msg)["type"] != "ready") {
      return make_error(errc::io_error,
                        "fanout: the " + who + " did not start: " +
                            (msg ? msg->value("reason", msg->dump()) : "no answer"));
    }
    return msg->value("relay_address", std::string());
  }

  const fanout_bench_options& o_;
  const emulated_cluster& cluster_;
  child publisher_;
  std::vector<child> ranks_;
  std::map<std::int32_t, std::string> relay_address_;
  std::unique_ptr<transport> transport_;
  std::uint64_t version_ = 0;
};

// Per-rank and per-depth figures of the timed updates of one plan (its route is the same in
// each): a rank's state is the last update's, its import_s the median over the updates, and a
// depth's import_s the median over every import at that depth.
json route_of(const std::vector<update_outcome>& updates, const fanout_run& run) {
  json ranks = json::array();
  if (updates.empty()) return {{"ranks", ranks}, {"per_hop", json::array()}};
  const auto& last = updates.back();
  std::map<std::uint32_t, std::vector<double>> by_depth;
  for (const auto& [rank, hop] : last.plan.hops) {
    json row = {{"rank", rank},
                {"node", run.node_name(static_cast<std::size_t>(rank))},
                {"received_from", last.plan.received_from(rank)},
                {"depth", hop.depth}};
    std::vector<double> imports;
    for (const auto& u : updates) {
      if (auto it = u.reports.find(rank); it != u.reports.end()) {
        imports.push_back(it->second["timings"].value("import", 0.0));
      }
    }
    if (auto it = last.reports.find(rank); it != last.reports.end()) {
      row["state"] = it->second.value("acknowledged", false) ? "acknowledged" : "rejected";
    } else {
      row["state"] = "failed";
    }
    if (!imports.empty()) row["import_s"] = median(imports);
    by_depth[hop.depth].insert(by_depth[hop.depth].end(), imports.begin(), imports.end());
    ranks.push_back(row);
  }
  std::map<std::uint32_t, std::size_t> at_depth;
  for (const auto& [rank, hop] : last.plan.hops) ++at_depth[hop.depth];
  json hops = json::array();
  for (const auto& [depth, imports] : by_depth) {
    hops.push_back({{"depth", depth}, {"ranks", at_depth[depth]}, {"import_s", median(imports)}});
  }
  return {{"ranks", ranks}, {"per_hop", hops}};
}

json base_row(const fanout_bench_options& o) {
  return {{"mode", "fanout"},
          {"smoke", o.smoke},
          {"nodes", o.nodes},
          {"ranks_per_node", o.ranks_per_node},
          {"bytes", fanout_update_bytes(o)},  // what moves: --bytes rounded to whole tensors
          {"layout", "synthetic:" + std::to_string(fanout_update_bytes(o)) + ":" +
                         std::to_string(fanout_tensors)},
          {"tensors", fanout_tensors},
          {"repeat", o.repeat},
          {"rate_mbit", o.rate_mbit},
          {"chunk_bytes", o.chunk_bytes},
          {"degree", o.degree}};
}

// Prints a row with its status; returns the exit code it stands for.
int emit(std::ostream& out, json row, const std::string& status, const std::string& why) {
  row["status"] = status;
  row["blocker"] = status == "blocked" ? json(why) : json(nullptr);
  if (status == "fail") row["error"] = why;
  out << row.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
  return status == "pass" ? 0 : status == "fail" ? 1 : 2;
}

bool acked_current(const json& report, std::uint64_t version) {
  return report.value("acknowledged", false) &&
         report.value("active_weight_version", std::uint64_t{0}) == version;
}

bool all_acked(const update_outcome& u, std::size_t expected) {
  if (u.reports.size() != expected) return false;
  return std::all_of(u.reports.begin(), u.reports.end(),
                     [&](const auto& r) { return acked_current(r.second, u.version); });
}

std::string first_failure(const update_outcome& u) {
  for (const auto& [rank, r] : u.reports) {
    if (!r.value("acknowledged", false)) {
      return "rank " + std::to_string(rank) + " rejected: " + r.value("reason", "");
    }
  }
  return "a rank did not answer";
}

// One update to `ranks`; an error when it failed or not every rank acknowledged it.
result<update_outcome> update_all(fanout_run& run, const std::vector<std::int32_t>& ranks,
                                  plan_shape shape) {
  auto u = run.update(ranks, shape);
  if (!u) return u.error();
  if (!all_acked(*u, ranks.size())) return make_error(errc::io_error, first_failure(*u));
  return u;
}

// The baseline first: updates to one consumer rank, in this run (two warm-ups fault in its slots
// and the publisher's). Then two warm-ups to everyone. In this order no rank holds a version the
// publisher's two slots would need back. Returns the baseline's median commit time.
result<double> warm_up(fanout_run& run, const fanout_bench_options& o,
                       const std::vector<std::int32_t>& everyone, plan_shape first) {
  std::vector<double> single;
  for (unsigned i = 0; i < o.repeat + 2; ++i) {
    auto u = update_all(run, {0}, plan_shape::tree);
    if (!u) return u.error();
    if (i >= 2) single.push_back(u->commit_s);
  }
  for (int w = 0; w < 2; ++w) {
    if (auto u = update_all(run, everyone, first); !u) return u.error();
  }
  return median(single);
}

json with_baseline(json row, double commit_s, double baseline) {
  // null, not a number, where the baseline run gave none
  row["baseline"] = {{"name", "single-consumer"},
                     {"seconds", baseline > 0 ? json(baseline) : json(nullptr)}};
  row["ratio_to_baseline"] = baseline > 0 ? json(commit_s / baseline) : json(nullptr);
  return row;
}

// `repeat` updates along one plan: the row of their medians; `error` set when one failed.
json plan_row(fanout_run& run, const fanout_bench_options& o, json row, plan_shape shape,
              const std::vector<std::int32_t>& everyone, double baseline, bool warm,
              std::string& error) {
  std::vector<double> commit, publish;
  std::vector<update_outcome> timed;
  // A plan not warmed up yet opens its endpoints between other peers: not in the timings.
  if (!warm) {
    if (auto u = update_all(run, everyone, shape); !u) error = u.error().message;
  }
  for (unsigned i = 0; i < o.repeat && error.empty(); ++i) {
    auto u = update_all(run, everyone, shape);
    if (!u) {
      error = u.error().message;
      continue;
    }
    commit.push_back(u->commit_s);
    publish.push_back(u->publish_s);
    timed.push_back(std::move(*u));
  }
  row["plan"] = plan_shape_name(shape);
  row["weight_version"] = timed.empty() ? 0 : timed.back().version;
  row["timings_s"] = {{"commit", median(commit)}, {"publish", median(publish)}};
  row = with_baseline(std::move(row), median(commit), baseline);
  if (!timed.empty()) row.update(route_of(timed, run));
  row["env"] = {{"host", host_name()},
                {"cores", std::thread::hardware_concurrency()},
                {"checksum_isa", std::string(checksum_isa())},
                {"transport_notes",
                 "ucx over tcp on each node's veth (UCX_TLS=tcp, UCX_NET_DEVICES=wsync0); links "
                 "tbf-limited both ways; ranks of a node pull from their leader over TCP "
                 "inside the node's namespace"}};
  return row;
}

// The top leader with the largest subtree dies mid-update; its subtree falls back to its source
// and must still commit, and nobody else may notice.
json kill_leader_row(fanout_run& run, const fanout_bench_options& o, json row, plan_shape shape,
                     const std::vector<std::int32_t>& everyone, double baseline,
                     std::string& error) {
  plan_request req;
  req.publishers = {{0, "n0"}};
  for (auto r : everyone) req.consumers.push_back({r, run.node_name(r)});
  req.shape = shape;
  req.degree = o.degree;
  auto probe = plan_fanout(req);
  if (!probe) {
    error = probe.error().message;
    return row;
  }
  std::int32_t victim = 0;
  std::size_t largest = 0;
  for (const auto& [rank, hop] : probe->hops) {
    if (hop.leader && hop.depth == 1 && probe->subtree(rank).size() >= largest) {
      largest = probe->subtree(rank).size();
      victim = rank;
    }
  }
  auto u = run.update(everyone, shape, victim, 0.3 * baseline);
  row["plan"] = plan_shape_name(shape);
  row["event"] = "kill_leader";
  row["victim"] = victim;
  auto subtree = probe->subtree(victim);
  row["subtree"] = std::vector<std::int32_t>(subtree.begin(), subtree.end());
  if (!u) {
    error = u.error().message;
    return row;
  }
  row["timings_s"] = {{"commit", u->commit_s}, {"publish", u->publish_s}};
  row = with_baseline(std::move(row), u->commit_s, baseline);
  row["failed"] = u->failed;
  row["acknowledged"] = std::count_if(u->reports.begin(), u->reports.end(), [&](const auto& r) {
    return acked_current(r.second, u->version);
  });
  row.update(route_of({*u}, run));
  if (u->failed != std::vector<std::int32_t>{victim}) {
    error = "expected only rank " + std::to_string(victim) + " to fail";
  } else if (!all_acked(*u, everyone.size() - 1)) {
    error = first_failure(*u);
  }
  return row;
}

}  // namespace

int fanout_bench_run(const fanout_bench_options& o, std::ostream& out) {
  const json base = base_row(o);
  std::vector<plan_shape> shapes;
  for (const auto& p : o.plans) {
    auto s = plan_shape_parse(p);
    if (!s) return emit(out, base, "fail", s.error().message);
    shapes.push_back(*s);
  }
  if (shapes.empty()) return emit(out, base, "fail", "fanout: no plan given");
  // The naive plan is the others' baseline: measured first, so each of their rows has its ratio.
  std::stable_partition(shapes.begin(), shapes.end(),
                        [](plan_shape s) { return s == plan_shape::naive; });
  if (o.nodes == 0 || o.ranks_per_node == 0) {
    return emit(out, base, "fail", "fanout: nodes and ranks_per_node must be at least 1");
  }
  if (!transport_known("ucx")) {
    return emit(out, base, "blocked",
                "blocked: this build has no ucx transport (libucx-dev was not found)");
  }
  struct sigaction sa {};
  sa.sa_handler = on_fanout_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  auto cluster = emulated_cluster::create(o.nodes + 1, o.rate_mbit);
  if (!cluster) {
    return emit(out, base, cluster.error().code == errc::blocked ? "blocked" : "fail",
                cluster.error().message);
  }
  fanout_run run(o, **cluster);
  if (auto ok = run.start(); !ok) return emit(out, base, "fail", ok.error().message);

  std::vector<std::int32_t> everyone;
  for (std::size_t r = 0; r < run.ranks(); ++r) everyone.push_back(static_cast<std::int32_t>(r));
  auto baseline = warm_up(run, o, everyone, shapes[0]);
  if (!baseline) return emit(out, base, "fail", baseline.error().message);

  int worst = 0;
  std::optional<double> naive_s;  // the naive plan's commit, once measured (it goes first)
  for (auto shape : shapes) {
    std::string error;
    json row = plan_row(run, o, base, shape, everyone, *baseline, shape == shapes[0], error);
    const double commit = row["timings_s"]["commit"].get<double>();
    if (shape == plan_shape::naive) {
      if (error.empty()) naive_s = commit;
    } else if (naive_s && *naive_s > 0) {
      row["naive"] = {{"seconds", *naive_s}};
      row["ratio_to_naive"] = commit / *naive_s;
    }
    worst = std::max(worst, emit(out, std::move(row), error.empty() ? "pass" : "fail", error));
  }
  // A leader dies in the first plan that has leaders relaying (not the naive one).
  auto relaying = std::find_if(shapes.begin(), shapes.end(),
                               [](plan_shape s) { return s != plan_shape::naive; });
  if (o.kill_leader && relaying != shapes.end()) {
    std::string error;
    json row = kill_leader_row(run, o, base, *relaying, everyone, *baseline, error);
    worst = std::max(worst, emit(out, std::move(row), error.empty() ? "pass" : "fail", error));
  }
  return worst;
}

}  // namespace wsync
