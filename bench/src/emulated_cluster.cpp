#include "emulated_cluster.hpp"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace wsync {
namespace {

constexpr char ns_prefix[] = "wsync-fan-";

// Runs a command (no shell), returns its exit status and, in *output, what it printed.
int run(const std::vector<std::string>& args, std::string* output = nullptr) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return -1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&fa, p[1], STDERR_FILENO);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(p[1]);
  std::string text;
  char buf[512];
  for (ssize_t n; rc == 0 && (n = ::read(p[0], buf, sizeof buf)) > 0;) text.append(buf, n);
  ::close(p[0]);
  if (rc != 0) return -1;
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (output) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string joined(const std::vector<std::string>& args) {
  std::string out;
  for (const auto& a : args) out += (out.empty() ? "" : " ") + a;
  return out;
}

}  // namespace

std::string emulated_cluster::ns(unsigned node) const {
  return prefix_ + "-n" + std::to_string(node);
}

std::string emulated_cluster::address(unsigned node) const {
  return "10.99.0." + std::to_string(node + 1);
}

result<std::unique_ptr<emulated_cluster>> emulated_cluster::create(unsigned nodes,
                                                                   std::uint64_t rate_mbit) {
  if (::geteuid() != 0) {
    return make_error(errc::blocked,
                      "blocked: the emulated cluster needs root (network "
                      "namespaces, veth pairs and tc qdiscs)");
  }
  if (nodes == 0 || nodes > 200) {
    return make_error(errc::invalid_argument, "emulated cluster: nodes must be 1-200");
  }
  if (run({"ip", "-V"}) != 0 || run({"tc", "-V"}) != 0) {
    return make_error(errc::blocked, "blocked: the emulated cluster needs iproute2 (ip, tc)");
  }
  sweep();
  if (auto usable = probe(); !usable) return usable.error();
  std::unique_ptr<emulated_cluster> c(
      new emulated_cluster(ns_prefix + std::to_string(::getpid()), nodes));
  c->built_ = true;  // from here on the destructor tears down whatever exists
  // The tbf burst must hold a few timer ticks of traffic at the rate, or the link runs slow.
  std::string rate = std::to_string(rate_mbit) + "mbit";
  std::string burst =
      std::to_string(std::max<std::uint64_t>(rate_mbit * 1000 / 8 / 100, 64)) + "kb";
  std::vector<std::vector<std::string>> steps = {
      {"ip", "netns", "add", c->router()},
      {"ip", "-n", c->router(), "link", "add", "br0", "type", "bridge"},
      {"ip", "-n", c->router(), "link", "set", "br0", "up"},
  };
  for (unsigned i = 0; i < nodes; ++i) {
    std::string n = c->ns(i), port = "p" + std::to_string(i);
    std::vector<std::vector<std::string>> node_steps = {
        {"ip", "netns", "add", n},
        {"ip", "link", "add", device, "netns", n, "type", "veth", "peer", "name", port, "netns",
         c->router()},
        {"ip", "-n", n, "addr", "add", c->address(i) + "/24", "dev", device},
        {"ip", "-n", n, "link", "set", "lo", "up"},
        {"ip", "-n", n, "link", "set", device, "up"},
        {"ip", "-n", c->router(), "link", "set", port, "master", "br0"},
        {"ip", "-n", c->router(), "link", "set", port, "up"},
        // Both directions of the node's link: its uplink in its namespace, its downlink on the
        // bridge port.
        {"tc", "-n", n, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", burst,
         "latency", "100ms"},
        {"tc", "-n", c->router(), "qdisc", "add", "dev", port, "root", "tbf", "rate", rate, "burst",
         burst, "latency", "100ms"},
    };
    steps.insert(steps.end(), node_steps.begin(), node_steps.end());
  }
  for (const auto& step : steps) {
    std::string out;
    if (run(step, &out) != 0) {
      return make_error(errc::io_error, "emulated cluster: `" + joined(step) + "` failed: " + out);
    }
  }
  return c;
}

result<void> emulated_cluster::probe() {
  // Root is not enough in a container or chroot: `ip -n` remounts / as a slave in a mount
  // namespace of its own, which such a root may not do ("mount --make-rslave /" failed:
  // Invalid argument). Try it on a scratch namespace, so the cause reads as blocked, not as a
  // failure of the cluster.
  const std::string scratch = ns_prefix + std::to_string(::getpid()) + "-probe";
  // The kinds of link the cluster is made of come too: a kernel or container without veth,
  // bridges or tbf is as blocked as one without namespaces.
  const std::vector<std::vector<std::string>> steps = {
      {"ip", "netns", "add", scratch},
      {"ip", "-n", scratch, "link", "set", "lo", "up"},
      {"ip", "-n", scratch, "link", "add", "v0", "type", "veth", "peer", "name", "v1"},
      {"ip", "-n", scratch, "link", "add", "br0", "type", "bridge"},
      {"tc", "-n", scratch, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst",
       "64kb", "latency", "100ms"},
  };
  std::string why;
  for (const auto& step : steps) {
    std::string out;
    if (run(step, &out) != 0) {
      why = "`" + joined(step) + "` failed: " + out;
      break;
    }
  }
  run({"ip", "netns", "del", scratch});
  if (why.empty()) return {};
  while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
  return make_error(
      errc::blocked,
      "blocked: emulated nodes (network namespaces, veth, bridge, tbf) cannot be made on "
      "this machine: " +
          why);
}

emulated_cluster::~emulated_cluster() {
  if (!built_) return;
  for (unsigned i = 0; i < nodes_; ++i) run({"ip", "netns", "del", ns(i)});
  run({"ip", "netns", "del", router()});
}

result<void> emulated_cluster::enter(unsigned node) const {
  std::string path = "/var/run/netns/" + ns(node);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return make_error(errc::io_error,
                      "emulated cluster: open " + path + ": " + std::strerror(errno));
  }
  int rc = ::setns(fd, CLONE_NEWNET);
  int err = errno;
  ::close(fd);
  if (rc != 0) {
    return make_error(errc::io_error,
                      "emulated cluster: setns into " + ns(node) + ": " + std::strerror(err));
  }
  // Programs (UCX among them) list interfaces from /sys/class/net, which shows the namespace
  // that mounted sysfs: remount it in a mount namespace of our own, as `ip netns exec` does.
  if (::unshare(CLONE_NEWNS) != 0 || ::mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0 ||
      ::umount2("/sys", MNT_DETACH) != 0 ||
      ::mount(ns(node).c_str(), "/sys", "sysfs", 0, nullptr) != 0) {
    return make_error(errc::io_error, "emulated cluster: remounting /sys for " + ns(node) + ": " +
                                          std::strerror(errno));
  }
  return {};
}

std::vector<std::string> emulated_cluster::sweep() {
  std::vector<std::string> removed;
  std::string list;
  if (run({"ip", "netns", "list"}, &list) != 0) return removed;
  std::size_t at = 0;
  while (at < list.size()) {
    auto end = list.find('\n', at);
    std::string line = list.substr(at, end == std::string::npos ? std::string::npos : end - at);
    at = end == std::string::npos ? list.size() : end + 1;
    std::string name = line.substr(0, line.find(' '));
    if (name.rfind(ns_prefix, 0) != 0) continue;
    int pid = std::atoi(name.c_str() + sizeof ns_prefix - 1);
    if (pid <= 0 || pid == ::getpid() || ::kill(pid, 0) == 0 || errno != ESRCH) continue;
    if (run({"ip", "netns", "del", name}) == 0) removed.push_back(name);
  }
  return removed;
}

}  // namespace wsync
