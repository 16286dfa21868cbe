// cuda-ipc and cuda-vmm between two processes on one GPU (the colocated case): the parent
// publishes device tensors, a child process (this binary again, running only
// device_child.serve) imports, verifies on the GPU and compares every byte; then the parent's
// publisher goes away while the child still holds the last update, and the child must still read
// it. Without a CUDA device these skip with the reason; the handle codec is tested everywhere.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda/device_pool.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_consumer.hpp"
#include "wsync/transports/weight_publisher.hpp"

extern char** environ;

namespace wsync {
namespace {

// Byte i of tensor t in version v.
std::byte pattern(std::size_t i, std::size_t t, std::uint64_t v) {
  return std::byte((i * 131 + t * 7 + v * 29 + (i >> 12)) & 0xff);
}

const std::vector<std::size_t> sizes = {1001, 3u << 20, 4096, (1u << 20) + 17, 64};

bool line_send(int fd, const std::string& text) {
  std::string line = text + "\n";
  return ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
}

// One line, or "" at the end or after `timeout_s` without one (a stuck peer fails the test
// instead of hanging it).
std::string line_receive(int fd, int timeout_s = 24 * 3600) {
  std::string line;
  char c = 0;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_s * 1000) != 1) return "";
    if (::read(fd, &c, 1) != 1 || c == '\n') return line;
    line += c;
  }
}

// --- the child: runs only when the parent started it ------------------------------------------

// Imports, verifies and compares an update; "ok <import seconds>" or why not.
std::string child_import(weight_consumer& consumer, const weight_update_manifest& m,
                         const imported_update** out) {
  auto t0 = std::chrono::steady_clock::now();
  auto u = consumer.import_update(m);
  double import_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!u) return u.error().message;
  *out = *u;
  if ((*u)->memory.host()) return "the import is in host memory";
  if (auto v = consumer.verify(m.update_id); !v) return v.error().message;
  for (std::size_t t = 0; t < (*u)->tensors.size(); ++t) {
    std::vector<std::byte> host(sizes[t]);
    if (auto ok = gpu::copy_to_host(host.data(), (*u)->tensors[t].data, host.size()); !ok) {
      return ok.error().message;
    }
    for (std::size_t i = 0; i < host.size(); ++i) {
      if (host[i] != pattern(i, t, m.weight_version)) {
        return "tensor " + std::to_string(t) + " byte " + std::to_string(i) + " differs";
      }
    }
  }
  return "ok " + std::to_string(import_s);
}

// The held update's bytes against its manifest's checksums, on the GPU, once more.
std::string child_recheck(const imported_update& u) {
  std::vector<gpu::device_range> ranges;
  for (const auto& t : u.tensors) ranges.push_back({t.data, t.descriptor->nbytes});
  auto sums = gpu::checksums(ranges, u.manifest.checksum_method);
  if (!sums) return sums.error().message;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    if ((*sums)[i] != u.tensors[i].descriptor->checksum)
      return "tensor " + std::to_string(i) + " changed";
  }
  return "ok";
}

TEST(device_child, serve) {
  const char* fd_text = std::getenv("WSYNC_DEVICE_CHILD_FD");
  const char* name = std::getenv("WSYNC_DEVICE_CHILD_TRANSPORT");
  if (!fd_text || !name) GTEST_SKIP() << "runs only as the child of device_transports tests";
  const int fd = std::atoi(fd_text);
  auto t = make_transport(name);
  if (!t) {
    line_send(fd, t.error().message);
    return;
  }
  weight_consumer consumer(*(*t)->make_consumer(), consumer_config{1, 2});
  std::map<std::string, const imported_update*> held;
  // Requests: "import <manifest json>", "recheck <update_id>", "release <update_id>".
  for (std::string line; !(line = line_receive(fd)).empty();) {
    auto space = line.find(' ');
    auto verb = line.substr(0, space), arg = line.substr(space + 1);
    std::fprintf(stderr, "device_child: %s\n", verb.c_str());
    if (verb == "import") {
      auto m = manifest_from_json(arg);
      line_send(fd, m ? child_import(consumer, *m, &held[m->update_id]) : m.error().message);
    } else if (verb == "recheck") {  // the publisher is gone: the bytes must still be there
      line_send(fd, held[arg] ? child_recheck(*held[arg]) : "not imported");
    } else if (verb == "release") {
      auto r = consumer.release(arg);
      line_send(fd, r ? "ok" : r.error().message);
    }
    std::fprintf(stderr, "device_child: %s answered\n", verb.c_str());
  }
}

// --- the parent ----------------------------------------------------------------------------------

class device_transports : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (auto r = gpu::ready(); !r) GTEST_SKIP() << r.error().message;
    auto t = make_transport(GetParam());
    ASSERT_TRUE(t) << t.error().message;
    transport_ = std::move(*t);
  }

  // Starts this test binary again as the consumer process; `fd_` talks to it.
  void child_start() {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    // The child inherits its end only: holding ours too, it would never see the end.
    ASSERT_EQ(::fcntl(fds[0], F_SETFD, FD_CLOEXEC), 0);
    std::string filter = "--gtest_filter=device_child.serve";
    std::string exe = "/proc/self/exe";
    std::vector<std::string> env_text = {"WSYNC_DEVICE_CHILD_FD=" + std::to_string(fds[1]),
                                         "WSYNC_DEVICE_CHILD_TRANSPORT=" + std::string(GetParam())};
    std::vector<char*> env;
    for (char** e = environ; *e; ++e) env.push_back(*e);
    for (auto& e : env_text) env.push_back(e.data());
    env.push_back(nullptr);
    char* argv[] = {exe.data(), filter.data(), nullptr};
    ASSERT_EQ(::posix_spawn(&child_, exe.c_str(), nullptr, nullptr, argv, env.data()), 0);
    ::close(fds[1]);
    fd_ = fds[0];
  }

  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);  // the child's loop ends
    if (child_ > 0) {  // it ends once its socket closes; a child stuck for a minute is killed
      int status = 0;
      for (int i = 0; i < 600 && ::waitpid(child_, &status, WNOHANG) == 0; ++i) ::usleep(100000);
      if (::waitpid(child_, &status, WNOHANG) == 0) {
        ::kill(child_, SIGKILL);
        ::waitpid(child_, &status, 0);
        ADD_FAILURE() << "the child did not exit within a minute of its socket closing";
      }
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
    }
  }

  // The child's answer; "" when it gave none within two minutes (it is then killed).
  std::string ask(const std::string& request) {
    if (!line_send(fd_, request)) return "the child is gone";
    auto answer = line_receive(fd_, 120);
    if (answer.empty()) ::kill(child_, SIGKILL);
    return answer;
  }

  // Version v's tensors on the device, as a trainer's parameters are (buffers_ holds them).
  std::vector<tensor_source> device_sources(std::uint64_t v) {
    buffers_.clear();
    std::vector<tensor_source> sources;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<std::byte> host(sizes[t]);
      for (std::size_t i = 0; i < host.size(); ++i) host[i] = pattern(i, t, v);
      auto b = gpu::device_buffer::make(host.size());
      EXPECT_TRUE(b && b->upload(host.data(), host.size()));
      if (!b) break;
      sources.push_back({"t" + std::to_string(t),
                         dtype::u8,
                         {static_cast<std::int64_t>(host.size())},
                         {},
                         static_cast<const std::byte*>(b->data()),
                         host.size(),
                         0,
                         nullptr});
      buffers_.push_back(std::move(*b));
    }
    return sources;
  }

  std::unique_ptr<transport> transport_;
  std::vector<gpu::device_buffer> buffers_;
  pid_t child_ = -1;
  int fd_ = -1;
};

TEST_P(device_transports, a_second_process_imports_verifies_and_outlives_the_publisher) {
  child_start();
  auto pt = transport_->make_publisher();
  ASSERT_TRUE(pt) << pt.error().message;
  publisher_config cfg;
  cfg.model_id = "two-processes";
  cfg.max_segment_bytes = 2 << 20;  // several segments
  auto publisher = std::make_unique<weight_publisher>(std::move(*pt), GetParam(), cfg);
  std::vector<double> imports;
  std::string last;
  for (std::uint64_t v = 1; v <= 4; ++v) {
    auto m = publisher->publish(device_sources(v), v, {1});
    ASSERT_TRUE(m) << m.error().message;
    EXPECT_EQ(m->tensors[0].device, "cuda:0");
    EXPECT_EQ(m->checksum_method.algorithm, checksum_algorithm::xxh3_64_chunked);
    auto answer = ask("import " + manifest_to_json(*m));
    ASSERT_EQ(answer.rfind("ok ", 0), 0u) << "version " << v << ": " << answer;
    imports.push_back(std::stod(answer.substr(3)));
    ASSERT_TRUE(publisher->on_acknowledged(m->update_id, 1));
    if (v < 4) {
      ASSERT_EQ(ask("release " + m->update_id), "ok");
      ASSERT_TRUE(publisher->on_released(m->update_id, 1));
    }
    last = m->update_id;
  }
  // The first import of each slot opens it; later ones find it cached.
  std::printf("%s imports (s): first %.6f, then %.6f %.6f %.6f\n", GetParam(), imports[0],
              imports[1], imports[2], imports[3]);
  EXPECT_LT(imports[3], 0.01) << "an import of a cached slot should take no time to speak of";
  // The publisher exits while the child holds version 4: the child still reads it whole.
  publisher.reset();
  buffers_.clear();
  EXPECT_EQ(ask("recheck " + last), "ok");
  EXPECT_EQ(ask("release " + last), "ok");
}

// Publishing, importing and releasing put the calling thread's CUDA context back as it was: a
// thread that had none (a fresh one, as a trainer's or an HTTP pool's may be) has none after,
// where setting "device 0" back would have made a context on GPU 0.
TEST_P(device_transports, a_thread_without_a_context_has_none_after_publish_and_import) {
  std::thread([&] {
    auto before = gpu::context_current();
    ASSERT_TRUE(before) << before.error().message;
    ASSERT_FALSE(*before) << "a fresh thread already has a context";
    auto pt = transport_->make_publisher();
    ASSERT_TRUE(pt) << pt.error().message;
    publisher_config cfg;
    cfg.model_id = "context";
    weight_publisher publisher(std::move(*pt), GetParam(), cfg);
    std::vector<std::vector<std::byte>> host(sizes.size());
    std::vector<tensor_source> sources;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      host[t].assign(sizes[t], std::byte{7});
      sources.push_back({"t" + std::to_string(t),
                         dtype::u8,
                         {static_cast<std::int64_t>(sizes[t])},
                         {},
                         host[t].data(),
                         sizes[t],
                         -1,
                         nullptr});
    }
    auto m = publisher.publish(sources, 1, {0});
    ASSERT_TRUE(m) << m.error().message;
    auto after = gpu::context_current();
    ASSERT_TRUE(after);
    EXPECT_FALSE(*after) << "publish left a context current";
    auto ct = transport_->make_consumer();
    ASSERT_TRUE(ct) << ct.error().message;
    weight_consumer consumer(std::move(*ct), consumer_config{0, 2});
    auto u = consumer.import_update(*m);
    ASSERT_TRUE(u) << u.error().message;
    EXPECT_TRUE(consumer.verify(m->update_id));
    EXPECT_TRUE(consumer.release(m->update_id));
    after = gpu::context_current();
    ASSERT_TRUE(after);
    EXPECT_FALSE(*after) << "import, verify or release left a context current";
  }).join();
}

// A consumer killed while it holds an update: once the publisher hears it failed (what the
// coordinator reports for a dead rank), the slot comes back and is reused, never leaked: every
// later version lands in one of the ring's two allocations, and a new consumer reads them.
TEST_P(device_transports, a_killed_consumer_gives_its_slot_back) {
  child_start();
  auto pt = transport_->make_publisher();
  ASSERT_TRUE(pt) << pt.error().message;
  publisher_config cfg;
  cfg.model_id = "killed";
  cfg.slot_wait = std::chrono::milliseconds(2000);
  auto publisher = std::make_unique<weight_publisher>(std::move(*pt), GetParam(), cfg);
  auto slot_id = [](const weight_update_manifest& m) {
    auto at = m.transport_handle.find("\"id\":\"");
    return at == std::string::npos ? std::string() : m.transport_handle.substr(at + 6, 32);
  };
  std::set<std::string> slots;
  auto first = publisher->publish(device_sources(1), 1, {1});
  ASSERT_TRUE(first) << first.error().message;
  slots.insert(slot_id(*first));
  ASSERT_EQ(ask("import " + manifest_to_json(*first)).rfind("ok ", 0), 0u);
  ::kill(child_, SIGKILL);  // holding version 1
  int status = 0;
  ::waitpid(child_, &status, 0);
  child_ = -1;
  ::close(fd_);
  fd_ = -1;
  ASSERT_TRUE(publisher->on_failed(first->update_id, 1, "killed"));
  EXPECT_TRUE(publisher->held_updates().empty());
  // Six more versions, each held by nobody: two slots serve them all.
  std::optional<weight_update_manifest> last;
  for (std::uint64_t v = 2; v <= 7; ++v) {
    auto m = publisher->publish(device_sources(v), v, {2});
    ASSERT_TRUE(m) << "version " << v << ": " << m.error().message;
    slots.insert(slot_id(*m));
    if (last) {
      ASSERT_TRUE(publisher->on_failed(last->update_id, 2, "not asked"));
    }
    last = *m;
  }
  EXPECT_LE(slots.size(), 2u) << "a slot was allocated again instead of coming back";
  child_start();  // a new consumer reads the newest version whole
  auto answer = ask("import " + manifest_to_json(*last));
  EXPECT_EQ(answer.rfind("ok ", 0), 0u) << answer;
  EXPECT_EQ(ask("release " + last->update_id), "ok");
}

// Handles that do not name a live slot are refused with the precise reason, and the consumer
// still imports the real one afterwards: a stale generation, a memory handle CUDA cannot open
// (cuda-ipc: blocked, naming the CUDA error), a socket nobody listens on (cuda-vmm).
TEST_P(device_transports, a_handle_naming_no_live_slot_is_refused_with_the_reason) {
  child_start();
  auto pt = transport_->make_publisher();
  ASSERT_TRUE(pt) << pt.error().message;
  publisher_config cfg;
  cfg.model_id = "refused";
  auto publisher = std::make_unique<weight_publisher>(std::move(*pt), GetParam(), cfg);
  auto m = publisher->publish(device_sources(1), 1, {1});
  ASSERT_TRUE(m) << m.error().message;
  const auto kind =
      std::string(GetParam()) == "cuda-ipc" ? device_pool::sharing::ipc : device_pool::sharing::vmm;
  auto with = [&](auto change) {
    auto h = device_pool::handle_parse(*m, kind);
    EXPECT_TRUE(h);
    change(*h);
    auto copy = *m;
    copy.update_id += "-forged";
    copy.transport_handle = device_pool::handle_encode(*h);
    return ask("import " + manifest_to_json(copy));
  };
  auto stale = with([](device_pool::handle& h) { h.generation += 2; });
  EXPECT_NE(stale.find("is no longer in " + std::string(GetParam()) + " memory"), std::string::npos)
      << stale;
  if (kind == device_pool::sharing::ipc) {
    auto forged = with([](device_pool::handle& h) {
      h.id = std::string(32, 'e');  // not cached: opened
      h.memory = std::string(128, '7');
    });
    EXPECT_EQ(forged.rfind("blocked: CUDA IPC handle reconstruction failed: cuda-ipc: "
                           "cudaIpcOpenMemHandle (cuda",
                           0),
              0u)
        << forged;
  } else {
    auto nobody = with([](device_pool::handle& h) {
      h.id = std::string(32, 'e');
      h.socket = "wsync-vmm-0-1-nobody";
    });
    EXPECT_NE(nobody.find("does not answer"), std::string::npos) << nobody;
  }
  auto real = ask("import " + manifest_to_json(*m));
  EXPECT_EQ(real.rfind("ok ", 0), 0u) << real;
  EXPECT_EQ(ask("release " + m->update_id), "ok");
}

INSTANTIATE_TEST_SUITE_P(gpu, device_transports, ::testing::Values("cuda-ipc", "cuda-vmm"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// --- the handle codec, everywhere ---------------------------------------------------------------

weight_update_manifest manifest_with(std::string handle, std::size_t segments) {
  weight_update_manifest m;
  m.update_id = "u-1";
  m.model_id = "m";
  m.source_rank = 0;
  m.transport_handle = std::move(handle);
  m.segments.assign(segments, segment_descriptor{1024});
  return m;
}

device_pool::handle good_handle(device_pool::sharing kind) {
  device_pool::handle h;
  h.pool = std::string(16, 'a');
  h.slot = 1;
  h.id = std::string(32, 'b');
  h.control = "wsync-42-gpu-0123";
  h.generation = 3;
  h.capacity = 4096;
  h.pid = 42;
  h.device = 0;
  h.event = std::string(128, 'c');
  if (kind == device_pool::sharing::ipc) h.memory = std::string(128, 'd');
  if (kind == device_pool::sharing::vmm) h.socket = "wsync-vmm-0-42-aaaa";
  h.offsets = {0, 2048};
  return h;
}

TEST(device_pool_handle, round_trips_and_refuses_what_is_not_one) {
  using device_pool::sharing;
  for (auto kind : {sharing::ipc, sharing::vmm}) {
    auto h = good_handle(kind);
    auto back = device_pool::handle_parse(manifest_with(device_pool::handle_encode(h), 2), kind);
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(back->id, h.id);
    EXPECT_EQ(back->offsets, h.offsets);
    EXPECT_EQ(back->memory, h.memory);
    EXPECT_EQ(back->socket, h.socket);

    auto refused = [&](device_pool::handle bad, std::size_t segments, const char* why) {
      auto r =
          device_pool::handle_parse(manifest_with(device_pool::handle_encode(bad), segments), kind);
      ASSERT_FALSE(r) << why;
      EXPECT_EQ(r.error().code, errc::invalid_manifest);
      EXPECT_NE(r.error().message.find(why), std::string::npos) << r.error().message;
      EXPECT_NE(r.error().message.find("update_id=u-1"), std::string::npos) << r.error().message;
    };
    auto bad = h;
    bad.offsets = {0, 3584};
    refused(bad, 2, "segment 1 lies outside the slot");
    refused(h, 3, "2 offsets for 3 segments");
    bad = h;
    bad.control = "../etc/passwd";
    refused(bad, 2, "is not a wsync shared-memory name");
    bad = h;
    bad.id = "xyz";
    refused(bad, 2, "id is not 32 hex digits");
    bad = h;
    bad.slot = 64;
    refused(bad, 2, "slot 64 is not below 64");
    bad = h;
    bad.event = "00";
    refused(bad, 2, "event is not a 64-byte handle in hex");
  }
  auto ipc_as_vmm = device_pool::handle_parse(
      manifest_with(device_pool::handle_encode(good_handle(device_pool::sharing::ipc)), 2),
      device_pool::sharing::vmm);
  ASSERT_FALSE(ipc_as_vmm);
  EXPECT_NE(ipc_as_vmm.error().message.find("socket"), std::string::npos);
  auto junk = device_pool::handle_parse(manifest_with("{", 1), device_pool::sharing::ipc);
  ASSERT_FALSE(junk);
  EXPECT_NE(junk.error().message.find("not a cuda-ipc handle"), std::string::npos);
}

}  // namespace
}  // namespace wsync
