#include "wsync/bench/bench.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "wsync/bench/rank_process.hpp"
#include "wsync/bench/timing.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/sources/layouts.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/shared_memory.hpp"
#include "wsync/transports/ucx.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using clock_type = std::chrono::steady_clock;

constexpr std::int32_t consumer_rank = 0;

// Set by SIGINT/SIGTERM: the run stops between updates and still cleans up (consumer released,
// slots unlinked), instead of leaving segments for the next publisher's sweep.
volatile sig_atomic_t interrupted = 0;
extern "C" void on_interrupt(int) {
  interrupted = 1;
}

void install_interrupt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a blocked poll returns EINTR and sees the flag
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

std::uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

std::string host_name() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? host : "unknown";
}

// Anonymous memory for the source tensors, faulted in up front (huge pages where allowed).
class host_buffer {
 public:
  explicit host_buffer(std::uint64_t n) : size_(std::max<std::uint64_t>(n, 1)) {
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    ::madvise(p, size_, MADV_HUGEPAGE);
    data_ = static_cast<std::byte*>(p);
    std::memset(data_, 0, size_);
  }
  ~host_buffer() { ::munmap(data_, size_); }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return size_; }

 private:
  std::uint64_t size_;
  std::byte* data_;
};

void fill_random(std::byte* p, std::uint64_t n, std::uint64_t seed) {
  std::uint64_t state = seed | 1;
  pattern_fill(p, n, state);
}

// --- the publisher side and the run -----------------------------------------------------------

struct samples {
  std::vector<double> publish, import, verify, install, ack, release, total, decode;
};

struct run_result {
  std::string status = "pass";
  std::optional<std::string> blocker;
  std::string error;
  std::uint64_t last_version = 0;
  std::uint64_t active_version = 0;
};

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

// --- the ucx baseline: ucx_perftest between two processes on loopback -------------------------

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

// The bandwidth ucx_perftest reports for `test` ("tag_bw", "ucp_get") between two processes on
// loopback, in GB/s; nullopt with the reason in *why when it could not be measured.
std::optional<double> perftest_gbps(const std::string& tls, const std::string& test,
                                    std::uint64_t message_bytes, std::string* why) {
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
    int fd = -1;
    auto client_args = args;
    client_args.insert(client_args.begin(), "127.0.0.1");
    pid_t client = perftest_spawn(tls, client_args, &fd);
    if (client < 0) break;
    text.clear();
    char buf[4096];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) text.append(buf, n);
    ::close(fd);
    int status = 0;
    ::waitpid(client, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
      ::kill(server, SIGKILL);
      ::waitpid(server, nullptr, 0);
      return *why = "ucx_perftest is not installed (Debian package ucx-utils)", std::nullopt;
    }
  }
  ::kill(server, SIGKILL);
  ::waitpid(server, nullptr, 0);
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

int bench_one(const bench_options& opt, std::ostream& out);

}  // namespace

int bench_run(const bench_options& opt, std::ostream& out) {
  if (opt.mode != "ucx" || !opt.ucx_tls.empty()) return bench_one(opt, out);
  // One row over TCP, one over shared memory; the worst outcome is the run's.
  int worst = 0;
  for (const char* tls : {"tcp", "sm"}) {
    auto o = opt;
    o.ucx_tls = tls;
    int rc = bench_one(o, out);
    if (rc == 1 || (rc == 2 && worst == 0)) worst = rc;
  }
  return worst;
}

namespace {

int bench_one(const bench_options& opt, std::ostream& out) {
  json row = {{"mode", opt.mode}, {"status", "pass"}, {"blocker", nullptr}};
  auto finish = [&](const std::string& status, const std::string& why) {
    row["status"] = status;
    if (status == "blocked") row["blocker"] = why;
    if (status == "fail") row["error"] = why;
    out << row.dump() << std::endl;
    return status == "pass" ? 0 : status == "fail" ? 1 : 2;
  };
  if (opt.mode != "local" && opt.mode != "shared-memory" && opt.mode != "ucx") {
    return finish("fail", "unknown mode \"" + opt.mode + "\" (known: local, shared-memory, ucx)");
  }
  const bool ucx = opt.mode == "ucx";
  const bool two_processes = opt.mode != "local";
  if (ucx && !transport_known("ucx")) {
    return finish("blocked",
                  "blocked: this build has no ucx transport (libucx-dev was not found "
                  "when it was configured)");
  }
  const std::string transport_name = ucx                   ? "ucx"
                                     : opt.mode == "local" ? "local-clone"
                                                           : "shared-memory";

  install_interrupt_handlers();

  // Layout: a named model, a synthetic size, or the smoke default.
  model_layout layout;
  if (!opt.layout.empty()) {
    auto l = layout_find(opt.layout);
    if (!l) {
      std::string known;
      for (const auto& n : layout_names()) known += (known.empty() ? "" : ", ") + n;
      return finish("fail", "unknown layout \"" + opt.layout + "\" (known: " + known + ")");
    }
    layout = *l;
  } else if (opt.bytes > 0 || opt.smoke) {
    layout = layout_synthetic(opt.bytes ? opt.bytes : 8u << 20, opt.tensors ? opt.tensors : 16);
  } else {
    layout = *layout_find("qwen2.5-0.5b");
  }
  const unsigned repeat = opt.smoke ? std::min(opt.repeat, 3u) : std::max(opt.repeat, 1u);
  const unsigned slots = std::max(opt.slots, 2u);
  const std::uint64_t bytes = layout.bytes();
  row["layout"] = layout.name;
  row["tensors"] = layout.tensors.size();
  row["bytes"] = bytes;
  row["repeat"] = repeat;
  row["verify"] = opt.verify;

  transport_options topts;
  if (two_processes) topts["slots"] = std::to_string(slots);
  if (ucx) {
    topts["tls"] = opt.ucx_tls;
    if (opt.ucx_chunk_bytes) topts["chunk_bytes"] = std::to_string(opt.ucx_chunk_bytes);
    row["ucx_tls"] = opt.ucx_tls;
    row["op"] = ucx_auto_op(opt.ucx_tls);
  }

  // Source tensors + a memcpy destination + every slot of the ring (ucx: on both sides) must fit.
  std::uint64_t need = bytes * (2 + slots * (ucx ? 2 : 1));
  std::uint64_t avail = mem_available();
  if (avail && need > avail / 10 * 9) {
    return finish("blocked", "blocked: layout " + layout.name + " needs about " +
                                 std::to_string(need >> 20) + " MiB (source, baseline and " +
                                 std::to_string(slots) + " slots of " +
                                 std::to_string(bytes >> 20) + " MiB) but only " +
                                 std::to_string(avail >> 20) + " MiB are available");
  }

  // Fork the consumer before anything else exists in this process: no threads, no mappings.
  int fds[2] = {-1, -1};
  pid_t child = -1;
  if (two_processes) {
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      return finish("fail", std::string("socketpair: ") + std::strerror(errno));
    }
    out.flush();
    child = ::fork();
    if (child < 0) return finish("fail", std::string("fork: ") + std::strerror(errno));
    if (child == 0) {
      // A terminal's Ctrl-C reaches the whole group: the parent stops the consumer itself.
      ::signal(SIGINT, SIG_IGN);
      ::close(fds[0]);
      bench_consumer_process(fds[1], opt.verify, transport_name, topts, consumer_rank);
    }
    ::close(fds[1]);
    auto ready = channel_receive(fds[0], std::chrono::seconds(60), &interrupted);
    if (!ready || (*ready)["type"] != "ready") {
      ::close(fds[0]);
      ::waitpid(child, nullptr, 0);
      return finish("fail", "the consumer process did not start: " +
                                (ready ? ready->value("reason", ready->dump()) : "no answer"));
    }
  }

  // Source tensors, packed back to back with the publisher's alignment.
  std::vector<std::uint64_t> offsets;
  std::uint64_t src_bytes = 0;
  for (const auto& t : layout.tensors) {
    offsets.push_back(src_bytes);
    src_bytes =
        (src_bytes + t.nbytes() + tensor_alignment - 1) / tensor_alignment * tensor_alignment;
  }
  host_buffer source(src_bytes);
  fill_random(source.data(), src_bytes, 0x9e3779b97f4a7c15ull);
  std::vector<tensor_source> tensors;
  for (std::size_t i = 0; i < layout.tensors.size(); ++i) {
    const auto& t = layout.tensors[i];
    tensors.push_back({t.name, t.dtype, t.shape, {}, source.data() + offsets[i], t.nbytes()});
  }

  // Baselines in the same run: single-thread memcpy into pre-faulted memory, single-thread xxh3.
  std::vector<double> memcpy_s, hash_s;
  {
    host_buffer dst(src_bytes);
    for (unsigned i = 0; i < repeat + 1; ++i) {
      double t0 = now_s();
      std::memcpy(dst.data(), source.data(), src_bytes);
      double t1 = now_s();
      volatile std::uint64_t h = checksum_compute(source.data(), src_bytes);
      (void)h;
      double t2 = now_s();
      if (i > 0) memcpy_s.push_back(t1 - t0), hash_s.push_back(t2 - t1);
    }
  }
  const double memcpy_gbps = gbps(src_bytes, median(memcpy_s));
  const double hash_gbps = gbps(src_bytes, median(hash_s));

  auto t = make_transport(transport_name, topts);
  if (!t) return finish("fail", t.error().message);
  auto pt = (*t)->make_publisher();
  if (!pt) return finish("fail", pt.error().message);
  publisher_config pcfg;
  pcfg.model_id = layout.name;
  pcfg.copy_threads = std::max(opt.copy_threads, 1u);
  pcfg.slot_wait = std::chrono::seconds(60);
  auto publisher =
      std::make_unique<weight_publisher>(std::move(*pt), std::string((*t)->name()), pcfg);

  std::unique_ptr<bench_consumer> local;
  if (opt.mode == "local") {
    auto ct = (*t)->make_consumer();
    if (!ct) return finish("fail", ct.error().message);
    local = std::make_unique<bench_consumer>(std::move(*ct), opt.verify, consumer_rank);
  }

  samples s;
  run_result rr;
  std::uint64_t largest_segment = 0;
  // One update end to end; `timed` updates are recorded after the warm-up ones (one per slot,
  // so every slot and every consumer mapping is faulted in before timing starts).
  auto one_update = [&](std::uint64_t version, bool timed) -> bool {
    if (interrupted) return rr.error = "interrupted", false;
    double t0 = now_s();
    auto m = publisher->publish(tensors, version, {consumer_rank}, {{"bench", "true"}});
    double t1 = now_s();
    if (!m) return rr.error = m.error().message, false;
    for (const auto& seg : m->segments) largest_segment = std::max(largest_segment, seg.nbytes);
    json report;
    if (local) {
      report = local->handle(*m, 0);
    } else {
      if (!channel_send(fds[0], {{"type", "update"}, {"manifest", manifest_to_json(*m)}})) {
        return rr.error = "consumer process went away", false;
      }
      auto r = channel_receive(fds[0], std::chrono::seconds(120), &interrupted);
      if (!r) return rr.error = "no report from the consumer process within 120 s", false;
      report = *r;
    }
    double t_recv = now_s();
    if (!report.value("acknowledged", false)) {
      (void)publisher->on_rejected(m->update_id, consumer_rank, report.value("reason", ""));
      return rr.error = "update rejected: " + report.value("reason", std::string("?")), false;
    }
    double a0 = now_s();
    if (auto ok = publisher->on_acknowledged(m->update_id, consumer_rank); !ok) {
      return rr.error = ok.error().message, false;
    }
    double ack_pub = now_s() - a0;
    double r0 = now_s();
    for (const auto& id : report["released"]) {
      if (auto ok = publisher->on_released(id.get<std::string>(), consumer_rank); !ok) {
        return rr.error = ok.error().message, false;
      }
    }
    double t_end = now_s();
    double release_pub = t_end - r0;
    rr.last_version = version;
    rr.active_version = report.value("active_weight_version", std::uint64_t{0});
    if (rr.active_version != version) {
      return rr.error = "consumer reports active_weight_version " +
                        std::to_string(rr.active_version) + " after installing " +
                        std::to_string(version),
             false;
    }
    if (!timed) return true;
    const auto& ct = report["timings"];
    double ack = ct["ack"].get<double>() + ack_pub +
                 (local ? 0.0 : std::max(0.0, t_recv - report["ack_sent_s"].get<double>()));
    s.publish.push_back(t1 - t0);
    s.import.push_back(ct["import"].get<double>());
    s.verify.push_back(ct["verify"].get<double>());
    s.install.push_back(ct["install"].get<double>());
    s.ack.push_back(ack);
    s.release.push_back(ct["release"].get<double>() + release_pub);
    s.decode.push_back(ct["decode"].get<double>());
    s.total.push_back(t_end - t0);
    out << json{{"event", "sample"},          {"mode", opt.mode},
                {"weight_version", version},  {"publish_s", t1 - t0},
                {"import_s", ct["import"]},   {"verify_s", ct["verify"]},
                {"install_s", ct["install"]}, {"total_s", t_end - t0}}
               .dump()
        << std::endl;
    return true;
  };

  bool ok = true;
  std::uint64_t version = 0;
  for (unsigned w = 0; ok && w < slots; ++w) ok = one_update(++version, false);
  for (unsigned i = 0; ok && i < repeat; ++i) ok = one_update(++version, true);

  // Shutdown: the consumer releases what it still holds, then every segment must be gone.
  std::vector<std::string> last_held;
  if (local) {
    last_held = local->shutdown();
    local.reset();
  } else {
    channel_send(fds[0], {{"type", "stop"}});
    if (auto r = channel_receive(fds[0], std::chrono::seconds(120), &interrupted);
        r && (*r)["update_ids"].is_array()) {
      last_held = (*r)["update_ids"].get<std::vector<std::string>>();
    }
    ::close(fds[0]);
    int wstatus = 0;
    ::waitpid(child, &wstatus, 0);
    if (ok && !(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0)) {
      ok = false, rr.error = "consumer process exited abnormally";
    }
  }
  for (const auto& id : last_held) (void)publisher->on_released(id, consumer_rank);
  if (ok && !publisher->held_updates().empty()) {
    ok = false, rr.error = "publisher still holds memory after every consumer released";
  }
  publisher.reset();
  t->reset();
  if (auto left = shm_segments_of({::getpid(), child}); !left.empty()) {
    ok = false, rr.error = "left in /dev/shm: " + left.front();
  }

  row["weight_version"] = rr.last_version;
  row["active_weight_version"] = rr.active_version;
  double publish = median(s.publish), verify = median(s.verify);
  row["timings_s"] = {{"publish", publish},       {"import", median(s.import)},
                      {"verify", verify},         {"install", median(s.install)},
                      {"ack", median(s.ack)},     {"release", median(s.release)},
                      {"total", median(s.total)}, {"decode", median(s.decode)}};
  row["baseline"] = {{"name", "memcpy"}, {"gbps", memcpy_gbps}};
  row["ratio_to_baseline"] = memcpy_gbps > 0 ? gbps(bytes, publish) / memcpy_gbps : 0;
  if (ucx && ok) {
    // Point to point: our import against ucx_perftest moving messages of our largest segment with
    // the same transports and the operation our consumer used, measured now.
    std::string test = row["op"] == "get" ? "ucp_get" : "tag_bw";
    std::string why;
    auto base = perftest_gbps(opt.ucx_tls, test, largest_segment, &why);
    if (!base) {
      ok = false, rr.error = why;
    } else {
      double ours = gbps(bytes, median(s.import));
      row["import_gbps"] = ours;
      row["memcpy_baseline"] = row["baseline"];
      row["baseline"] = {{"name", "ucx_perftest"},
                         {"gbps", *base},
                         {"test", test},
                         {"message_bytes", largest_segment}};
      row["ratio_to_baseline"] = *base > 0 ? ours / *base : 0;
    }
  }
  row["publish_gbps"] = gbps(bytes, publish);
  row["verify_gbps"] = opt.verify ? gbps(bytes, verify) : 0;
  row["hash_baseline"] = {{"name", "xxh3-1thread"}, {"gbps", hash_gbps}};
  row["verify_ratio"] = opt.verify && hash_gbps > 0 ? gbps(bytes, verify) / hash_gbps : 0;
  row["copy_threads"] = pcfg.copy_threads;
  std::string transport_notes =
      opt.mode == "local"
          ? "local-clone: publisher and consumer in one process; import copies"
          : opt.mode + ": " + std::to_string(slots) +
                "-slot pooled ring; consumer is a separate process (pid " + std::to_string(child) +
                ")" +
                (ucx ? ", pulls chunks over UCX_TLS=" + opt.ucx_tls + " with " +
                           row["op"].get<std::string>() + " into its own registered slots"
                     : ", maps each slot once, zero-copy import");
  row["env"] = {{"host", host_name()},
                {"cores", std::thread::hardware_concurrency()},
                {"transport_notes", transport_notes}};
  return ok ? finish("pass", "") : finish("fail", rr.error);
}

}  // namespace
}  // namespace wsync
