// file-mmap on a tmpfs directory and on a disk directory: buffers reused in place, a held buffer
// refused naming its holder, leases of dead or silent readers expiring, the state file outliving
// its publisher, stale handles refused. Children are forked before they make any transport and
// leave with _exit; an alarm bounds their life.

#include "file_mmap/file_mmap.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <thread>

#include "file_mmap/file_mmap_common.hpp"
#include "wsync/transports/weight_consumer.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

namespace fs = std::filesystem;

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

ino_t inode_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_ino : 0;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> leases_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir + "/leases")) {
    if (e.path().extension() == ".lease") out.push_back(e.path().filename().string());
  }
  return out;
}

// The directory kinds the transport must work on. tmpfs: /dev/shm (names not starting with
// "wsync-", which the shared-memory leak checks own). disk: /var/tmp, else the working folder.
std::string base_for(const std::string& kind, std::string& why_not) {
  auto is_tmpfs = [](const std::string& p) {
    struct statfs sf {};
    return ::statfs(p.c_str(), &sf) == 0 && sf.f_type == TMPFS_MAGIC;
  };
  if (kind == "tmpfs") {
    if (is_tmpfs("/dev/shm") && ::access("/dev/shm", W_OK) == 0) return "/dev/shm";
    why_not = "/dev/shm is not a writable tmpfs here";
    return {};
  }
  for (std::string p : {std::string("/var/tmp"), fs::current_path().string()}) {
    if (::access(p.c_str(), W_OK) == 0 && !is_tmpfs(p)) return p;
  }
  why_not = "neither /var/tmp nor the working folder is a writable non-tmpfs directory";
  return {};
}

class file_mmap_test : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::string why;
    auto base = base_for(GetParam(), why);
    if (base.empty()) GTEST_SKIP() << GetParam() << ": " << why;
    std::string tmpl = base + "/fmm-unit-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
    dir_ = tmpl;
    for (std::size_t i = 0; i < 3; ++i) {  // three segments of 1 MiB at most
      std::vector<std::byte> b((i + 1) * 300000);
      bytes_.push_back(std::move(b));
    }
  }

  void TearDown() override {
    publisher_.reset();
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  std::unique_ptr<transport> make(transport_options extra = {}) {
    extra["dir"] = dir_;
    auto t = make_transport("file-mmap", extra);
    EXPECT_TRUE(t) << t.error().message;
    return t ? std::move(*t) : nullptr;
  }

  void start_publisher(std::chrono::milliseconds wait = std::chrono::milliseconds(150),
                       transport_options extra = {}) {
    publisher_.reset();
    transport_ = make(std::move(extra));
    ASSERT_TRUE(transport_);
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p) << p.error().message;
    publisher_config cfg;
    cfg.model_id = "fmm";
    cfg.max_segment_bytes = 1 << 20;
    cfg.slot_wait = wait;
    publisher_ = std::make_unique<weight_publisher>(std::move(*p), "file-mmap", cfg);
  }

  // Publishes version v with bytes derived from v; no expected consumer, as standalone does:
  // only CURRENT and the leases protect a buffer once publish() returns.
  result<weight_update_manifest> publish(std::uint64_t v) {
    sources_.clear();
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      for (std::size_t k = 0; k < bytes_[i].size(); ++k) {
        bytes_[i][k] = std::byte((k * 7 + i + v * 13) & 0xff);
      }
      sources_.push_back({"t" + std::to_string(i),
                          dtype::u8,
                          {static_cast<std::int64_t>(bytes_[i].size())},
                          {},
                          bytes_[i].data(),
                          bytes_[i].size()});
    }
    return publisher_->publish(sources_, v, {});
  }

  std::unique_ptr<weight_consumer> consumer(std::int32_t rank, transport_options extra = {}) {
    auto t = make(std::move(extra));
    auto c = t->make_consumer();
    EXPECT_TRUE(c) << c.error().message;
    return std::make_unique<weight_consumer>(std::move(*c), consumer_config{rank, 1});
  }

  // The lease of a reader frozen on this host: this process, by its pid, rank 7, its heartbeat
  // stopped 10 s ago. Its path, or empty (errno says why).
  std::string frozen_lease(int b) {
    const std::string lease = dir_ + "/leases/buffer-" + std::to_string(b) + "." +
                              std::to_string(::getpid()) + ".frozen.lease";
    std::ofstream(lease) << nlohmann::json{
        {"host", file_mmap_detail::host_name()},
        {"pid", ::getpid()},
        {"pidns", file_mmap_detail::pid_namespace()},
        {"start", file_mmap_detail::process_start_time(::getpid())},
        {"rank", 7}}.dump();
    struct timespec old[2] = {{std::time(nullptr) - 10, 0}, {std::time(nullptr) - 10, 0}};
    return ::utimensat(AT_FDCWD, lease.c_str(), old, 0) == 0 ? lease : std::string();
  }

  int buffer_of(const weight_update_manifest& m) {
    return nlohmann::json::parse(m.transport_handle).at("buffer").get<int>();
  }

  std::string dir_;
  std::unique_ptr<transport> transport_;
  std::unique_ptr<weight_publisher> publisher_;
  std::vector<std::vector<std::byte>> bytes_;
  std::vector<tensor_source> sources_;
};

TEST_P(file_mmap_test, buffers_alternate_and_are_reused_in_place) {
  start_publisher();
  std::map<std::string, ino_t> first;
  std::size_t segments = 0;
  for (std::uint64_t v = 1; v <= 6; ++v) {
    auto m = publish(v);
    ASSERT_TRUE(m) << "version " << v << ": " << m.error().message;
    EXPECT_EQ(buffer_of(*m), static_cast<int>((v - 1) % 2)) << "version " << v;
    segments = m->segments.size();
    auto cur = file_mmap_current(dir_);
    ASSERT_TRUE(cur && *cur);
    EXPECT_EQ(**cur, *m);
    for (std::size_t s = 0; s < m->segments.size(); ++s) {
      char name[64];
      std::snprintf(name, sizeof name, "/buffer-%d/segment-%04zu", buffer_of(*m), s);
      auto ino = inode_of(dir_ + name);
      ASSERT_NE(ino, 0u) << name;
      auto [it, fresh] = first.emplace(name, ino);
      EXPECT_EQ(it->second, ino) << name << ": a new file for version " << v;
      (void)fresh;
    }
    // Every version reads back through the consumer, zero-copy from the same files.
    auto c = consumer(0);
    auto u = c->import_update(**cur);
    ASSERT_TRUE(u) << u.error().message;
    ASSERT_TRUE(c->verify(m->update_id)) << "version " << v;
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      EXPECT_EQ(std::memcmp((*u)->tensors[i].data, bytes_[i].data(), bytes_[i].size()), 0);
    }
    ASSERT_TRUE(c->release(m->update_id));
    EXPECT_TRUE(leases_in(dir_).empty()) << "release gives the lease back";
  }
  EXPECT_GT(segments, 1u);
  EXPECT_EQ(first.size(), 2 * segments);  // two buffers of the same files, nothing else
}

TEST_P(file_mmap_test, a_held_buffer_is_refused_naming_its_holder) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(3);
  ASSERT_TRUE(c->import_update(*m1));  // rank 3 holds buffer-0
  ASSERT_EQ(leases_in(dir_).size(), 1u);
  auto lease = nlohmann::json::parse(read_text(dir_ + "/leases/" + leases_in(dir_)[0]));
  EXPECT_EQ(lease.at("rank"), 3);
  EXPECT_EQ(lease.at("pid"), ::getpid());
  auto m2 = publish(2);  // buffer-1 is free
  ASSERT_TRUE(m2) << m2.error().message;
  auto m3 = publish(3);  // buffer-0 held by rank 3, buffer-1 is CURRENT
  ASSERT_FALSE(m3);
  EXPECT_EQ(m3.error().code, errc::timeout);
  const auto& msg = m3.error().message;
  EXPECT_TRUE(contains(msg, "no free buffer: held by ")) << msg;
  EXPECT_TRUE(contains(msg, "rank 3 (pid " + std::to_string(::getpid()))) << msg;
  EXPECT_TRUE(contains(msg, "update_id=")) << msg;
  EXPECT_TRUE(contains(msg, "rank=0")) << msg;
  EXPECT_TRUE(contains(msg, "field buffers")) << msg;
  // The bytes rank 3 holds were not touched, and once it lets go the writer goes on.
  ASSERT_TRUE(c->verify(m1->update_id));
  ASSERT_TRUE(c->release(m1->update_id));
  auto m3b = publish(3);
  ASSERT_TRUE(m3b) << m3b.error().message;
  EXPECT_EQ(buffer_of(*m3b), 0);
}

TEST_P(file_mmap_test, the_lease_of_a_dead_reader_expires) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(30);
    auto c = consumer(5);
    auto u = c->import_update(*m1);
    ::_exit(u && c->verify(m1->update_id) ? 0 : 1);  // dies holding: no release
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child could not import";
  ASSERT_EQ(leases_in(dir_).size(), 1u) << "the dead reader's lease stays behind";
  ASSERT_TRUE(publish(2));
  auto m3 = publish(3);  // needs buffer-0: its holder's pid is gone from this host
  ASSERT_TRUE(m3) << m3.error().message;
  EXPECT_EQ(buffer_of(*m3), 0);
  EXPECT_TRUE(leases_in(dir_).empty());
}

TEST_P(file_mmap_test, files_are_the_owners_and_dead_lease_temporaries_are_swept) {
  // A timeout far above what the publishes take (TSan on 2 cores), so the fresh one stays fresh.
  start_publisher(std::chrono::milliseconds(6000), {{"lease_timeout_ms", "60000"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(0);
  ASSERT_TRUE(c->import_update(*m1));
  auto mode = [](const std::string& path) {
    struct stat st {};
    EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
    return st.st_mode & 0777;
  };
  // Weights, manifests and leases are the owner's alone, as shared memory's are.
  EXPECT_EQ(mode(dir_ + "/buffer-0"), 0700u);
  EXPECT_EQ(mode(dir_ + "/buffer-0/segment-0000"), 0600u);
  EXPECT_EQ(mode(dir_ + "/CURRENT"), 0600u);
  EXPECT_EQ(mode(dir_ + "/leases"), 0700u);
  ASSERT_EQ(leases_in(dir_).size(), 1u);
  EXPECT_EQ(mode(dir_ + "/leases/" + leases_in(dir_)[0]), 0600u);
  ASSERT_TRUE(c->release(m1->update_id));

  // What a consumer that died between writing its lease and renaming it left: swept once older
  // than a lease's timeout; one being written now stays.
  const std::string stale = dir_ + "/leases/.0badc0ffee00.tmp";
  const std::string fresh = dir_ + "/leases/.0000cafe0000.tmp";
  std::ofstream(stale) << "{";
  std::ofstream(fresh) << "{";
  fs::last_write_time(stale, fs::file_time_type::clock::now() - std::chrono::hours(1));
  ASSERT_TRUE(publish(2));
  ASSERT_TRUE(publish(3));  // looks at buffer-0's leases
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(fresh));
}

TEST_P(file_mmap_test, a_silent_lease_expires_after_the_lease_timeout) {
  // A reader on another host: no pid to check, only its heartbeat.
  // The timeout leaves a loaded machine (TSan, -j2) time to see the lease fresh first.
  start_publisher(std::chrono::milliseconds(6000), {{"lease_timeout_ms", "1500"}});
  ASSERT_TRUE(publish(1));
  ASSERT_TRUE(publish(2));
  std::string lease = dir_ + "/leases/buffer-0.1.remote.lease";
  std::ofstream(lease) << R"({"host":"another-host","pid":1,"start":0,"rank":9})";
  // Fresh heartbeat and a short wait: refused, naming the remote reader.
  start_publisher(std::chrono::milliseconds(50), {{"lease_timeout_ms", "1500"}});
  auto refused = publish(3);
  ASSERT_FALSE(refused);
  EXPECT_TRUE(contains(refused.error().message, "no free buffer: held by "))
      << refused.error().message;
  EXPECT_TRUE(contains(refused.error().message, "rank 9 (pid 1 on another-host"))
      << refused.error().message;
  // Nobody refreshes it: within the writer's wait it goes stale and the buffer comes free.
  start_publisher(std::chrono::milliseconds(6000), {{"lease_timeout_ms", "1500"}});
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  EXPECT_EQ(buffer_of(*m3), 0);
  EXPECT_FALSE(fs::exists(lease));
}

// An expired lease the writer cannot remove (EIO on a soft NFS mount, EACCES, EROFS; here a
// folder in its place, which unlink refuses): its reader would go on finding it and trusting the
// bytes, so the buffer stays held, naming why.
TEST_P(file_mmap_test, an_expired_lease_that_cannot_be_removed_keeps_the_buffer_held) {
  start_publisher(std::chrono::milliseconds(50), {{"lease_timeout_ms", "1500"}});
  ASSERT_TRUE(publish(1));
  ASSERT_TRUE(publish(2));
  const std::string lease = dir_ + "/leases/buffer-0.1.stuck.lease";
  fs::create_directories(lease);
  { std::ofstream(lease + "/x") << "x"; }
  fs::last_write_time(lease, fs::file_time_type::clock::now() - std::chrono::hours(1));
  auto refused = publish(3);
  ASSERT_FALSE(refused) << "buffer-0 was rewritten while a lease of it stayed";
  EXPECT_TRUE(contains(refused.error().message, "its expired lease cannot be removed"))
      << refused.error().message;
  fs::remove_all(lease);
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  EXPECT_EQ(buffer_of(*m3), 0);
}

TEST_P(file_mmap_test, a_reader_in_another_pid_namespace_is_judged_by_its_heartbeat) {
  // A reader in another container on this host: same hostname, a pid that names no process
  // here. Its fresh lease holds the buffer; the pid check would have freed it at once.
  start_publisher(std::chrono::milliseconds(6000), {{"lease_timeout_ms", "1500"}});
  ASSERT_TRUE(publish(1));
  ASSERT_TRUE(publish(2));
  struct stat ns {};
  ASSERT_EQ(::stat("/proc/self/ns/pid", &ns), 0) << std::strerror(errno);
  int dead = 4000000;
  while (::kill(dead, 0) == 0 || errno != ESRCH) --dead;
  std::string lease = dir_ + "/leases/buffer-0." + std::to_string(dead) + ".container.lease";
  std::ofstream(lease) << nlohmann::json{
      {"host", file_mmap_detail::host_name()},
      {"pid", dead},
      {"pidns", static_cast<std::uint64_t>(ns.st_ino) + 1},
      {"start", 1},
      {"rank", 6}}.dump();
  start_publisher(std::chrono::milliseconds(50), {{"lease_timeout_ms", "1500"}});
  auto refused = publish(3);
  ASSERT_FALSE(refused);
  EXPECT_TRUE(contains(refused.error().message, "held by rank 6")) << refused.error().message;
  EXPECT_TRUE(fs::exists(lease));
  fs::remove(lease);
}

TEST_P(file_mmap_test, a_live_reader_keeps_its_lease_fresh) {
  // The heartbeat thread refreshes the lease: a reader that holds longer than the lease timeout
  // keeps its buffer.
  start_publisher(std::chrono::milliseconds(500), {{"lease_timeout_ms", "100"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(1, {{"lease_timeout_ms", "100"}});
  ASSERT_TRUE(c->import_update(*m1));
  ASSERT_TRUE(publish(2));
  auto m3 = publish(3);  // waits 500 ms, five lease timeouts: the lease must stay live
  ASSERT_FALSE(m3);
  EXPECT_TRUE(contains(m3.error().message, "no free buffer: held by rank 1")) << m3.error().message;
  ASSERT_TRUE(c->release(m1->update_id));
}

TEST_P(file_mmap_test, a_reader_keeps_to_the_writers_lease_timeout_not_its_own) {
  // The writer judges leases by its lease_timeout_ms, which the handle carries: a reader left
  // at the default (10 s, a heartbeat every 2.5 s) must still refresh within the writer's 100.
  start_publisher(std::chrono::milliseconds(500), {{"lease_timeout_ms", "100"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  EXPECT_EQ(nlohmann::json::parse(m1->transport_handle).at("lease_timeout_ms"), 100);
  auto c = consumer(1);
  ASSERT_TRUE(c->import_update(*m1));
  ASSERT_TRUE(publish(2));
  auto m3 = publish(3);
  ASSERT_FALSE(m3) << "a live reader's buffer was rewritten";
  EXPECT_TRUE(contains(m3.error().message, "no free buffer: held by rank 1")) << m3.error().message;
  ASSERT_TRUE(c->intact(m1->update_id));
  ASSERT_TRUE(c->release(m1->update_id));
}

// CURRENT names the buffer a crash falls back to, which the publisher never rewrites: one that
// is not the buffer its manifest's readers map (or none) would leave that one unprotected.
TEST_P(file_mmap_test, a_state_file_whose_buffer_is_not_its_manifests_is_refused) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto j = nlohmann::json::parse(read_text(dir_ + "/CURRENT"));
  ASSERT_TRUE(file_mmap_detail::current_parse(j.dump(), "CURRENT"));
  j["buffer"] = 1 - j["buffer"].get<int>();
  auto wrong = file_mmap_detail::current_parse(j.dump(), "CURRENT");
  ASSERT_FALSE(wrong);
  EXPECT_TRUE(contains(wrong.error().message, "which its manifest's handle names"))
      << wrong.error().message;
  j.erase("buffer");
  auto none = file_mmap_detail::current_parse(j.dump(), "CURRENT");
  ASSERT_FALSE(none);
  EXPECT_TRUE(contains(none.error().message, "no buffer field")) << none.error().message;
}

// A descriptor per segment and buffer, held for good, passed the common limit of 1,024 with a
// large model in 256 MiB segments (two buffers of 522 for 140 GB): files are open only while
// sized and while their bytes are made durable.
TEST_P(file_mmap_test, many_segments_fit_a_small_descriptor_limit) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(60);
    rlimit few{64, 64};  // what the process has open, plus a few dozen
    if (::setrlimit(RLIMIT_NOFILE, &few) != 0) ::_exit(2);
    auto t = make_transport("file-mmap", {{"dir", dir_}});
    if (!t) ::_exit(3);
    auto p = (*t)->make_publisher();
    if (!p) ::_exit(4);
    publisher_config cfg;
    cfg.model_id = "fmm";
    cfg.max_segment_bytes = 4096;  // one tensor per segment: 100 segment files a buffer
    cfg.slot_wait = std::chrono::milliseconds(100);
    weight_publisher pub(std::move(*p), "file-mmap", cfg);
    std::vector<std::vector<std::byte>> bytes(100, std::vector<std::byte>(4096));
    for (std::uint64_t v = 1; v <= 3; ++v) {  // both buffers, then the first again
      std::vector<tensor_source> sources;
      for (std::size_t i = 0; i < bytes.size(); ++i) {
        std::fill(bytes[i].begin(), bytes[i].end(), std::byte(v + i));
        sources.push_back({"t" + std::to_string(i), dtype::u8, {4096}, {}, bytes[i].data(), 4096});
      }
      auto m = pub.publish(sources, v, {});
      if (!m) {
        std::fprintf(stderr, "version %llu: %s\n", static_cast<unsigned long long>(v),
                     m.error().message.c_str());
        ::_exit(5);
      }
      if (m->segments.size() != 100) ::_exit(6);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: setrlimit, 3-4: transport, 5: publish, 6: segments";
}

TEST_P(file_mmap_test, the_state_file_outlives_its_publisher) {
  start_publisher();
  ASSERT_TRUE(publish(1));
  auto m2 = publish(2);
  ASSERT_TRUE(m2) << m2.error().message;
  // One writer per directory.
  auto second = make()->make_publisher();
  ASSERT_FALSE(second);
  EXPECT_EQ(second.error().code, errc::blocked);
  EXPECT_TRUE(contains(second.error().message, "already has a publisher"))
      << second.error().message;
  publisher_.reset();
  transport_.reset();
  EXPECT_FALSE(fs::exists(dir_ + "/CURRENT.tmp"));
  auto cur = file_mmap_current(dir_);
  ASSERT_TRUE(cur && *cur);
  EXPECT_EQ(**cur, *m2);
  // A new publisher leaves the CURRENT version alone and writes the other buffer.
  start_publisher();
  auto c = consumer(0);
  auto u = c->import_update(**cur);
  ASSERT_TRUE(u) << u.error().message;
  ASSERT_TRUE(c->verify(m2->update_id));
  ASSERT_TRUE(c->release(m2->update_id));
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  EXPECT_NE(buffer_of(*m3), buffer_of(*m2));
}

TEST_P(file_mmap_test, a_handle_to_a_rewritten_buffer_is_refused) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1);
  ASSERT_TRUE(publish(2));
  ASSERT_TRUE(publish(3));  // rewrote buffer-0, which m1 names
  auto c = consumer(2);
  auto u = c->import_update(*m1);
  ASSERT_FALSE(u);
  EXPECT_EQ(u.error().code, errc::unknown_update);
  EXPECT_TRUE(contains(u.error().message, "unknown update_id: " + m1->update_id))
      << u.error().message;
  EXPECT_TRUE(contains(u.error().message, "is no longer in")) << u.error().message;
  EXPECT_TRUE(contains(u.error().message, "rank=2")) << u.error().message;
  EXPECT_TRUE(leases_in(dir_).empty()) << "a refused import leaves no lease";
}

// A segment that shrinks under a reader that lost its lease: the reader's mapping stays whole
// (it would fault with SIGBUS past the new end of a file truncated in place), and intact()
// still says the bytes are not to be trusted.
TEST_P(file_mmap_test, a_segment_shrinking_under_a_reader_that_lost_its_lease_does_not_fault_it) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(4);
  auto u = c->import_update(*m1);
  ASSERT_TRUE(u) << u.error().message;
  const auto before = bytes_;
  ASSERT_TRUE(publish(2));
  auto leases = leases_in(dir_);
  ASSERT_EQ(leases.size(), 1u);
  fs::remove(dir_ + "/leases/" + leases.front());
  for (auto& b : bytes_) b.resize(b.size() / 4);  // a smaller model: every segment shrinks
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  ASSERT_EQ(buffer_of(*m3), buffer_of(*m1));
  for (std::size_t i = 0; i < before.size(); ++i) {
    const auto& t = (*u)->tensors[i];
    ASSERT_EQ(t.descriptor->nbytes, before[i].size());
    EXPECT_EQ(std::memcmp(t.data, before[i].data(), before[i].size()), 0) << "tensor " << i;
  }
  EXPECT_FALSE(c->intact(m1->update_id));
  ASSERT_TRUE(c->release(m1->update_id));
}

// On NFS a stat may be answered from the attribute cache after the writer removed a lease:
// what the heartbeat found stands for intact(). Here the lease comes back after the heartbeat
// saw it gone, as such a cache would still show it.
TEST_P(file_mmap_test, a_lease_the_heartbeat_found_gone_stays_gone) {
  start_publisher(std::chrono::milliseconds(150), {{"lease_timeout_ms", "200"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(4);
  ASSERT_TRUE(c->import_update(*m1));
  EXPECT_TRUE(c->intact(m1->update_id));
  auto leases = leases_in(dir_);
  ASSERT_EQ(leases.size(), 1u);
  const std::string lease = dir_ + "/leases/" + leases.front();
  std::string text;
  {
    std::ifstream in(lease);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  fs::remove(lease);
  std::this_thread::sleep_for(std::chrono::milliseconds(400));  // the heartbeat: every 50 ms
  std::ofstream(lease) << text;
  auto whole = c->intact(m1->update_id);
  ASSERT_FALSE(whole) << "a lease the heartbeat found gone was trusted again";
  EXPECT_TRUE(contains(whole.error().message, "the writer removed this reader's lease"))
      << whole.error().message;
  ASSERT_TRUE(c->release(m1->update_id));
}

// A reader frozen past the lease timeout loses its lease, and the writer may then rewrite its
// buffer: bytes copied out of it after that are not trusted (the executor asks intact()).
TEST_P(file_mmap_test, bytes_read_after_the_writer_removed_the_lease_are_not_intact) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(4);
  ASSERT_TRUE(c->import_update(*m1));
  ASSERT_TRUE(c->verify(m1->update_id));
  EXPECT_TRUE(c->intact(m1->update_id));
  ASSERT_TRUE(publish(2));
  auto leases = leases_in(dir_);
  ASSERT_EQ(leases.size(), 1u);
  fs::remove(dir_ + "/leases/" + leases.front());  // what the writer does to a stale lease
  auto m3 = publish(3);                            // lands in buffer-0, under the reader's mapping
  ASSERT_TRUE(m3) << m3.error().message;
  EXPECT_EQ(buffer_of(*m3), buffer_of(*m1));
  auto whole = c->intact(m1->update_id);
  ASSERT_FALSE(whole);
  EXPECT_EQ(whole.error().code, errc::unknown_update);
  EXPECT_TRUE(contains(whole.error().message, "the writer removed this reader's lease"))
      << whole.error().message;
  EXPECT_TRUE(contains(whole.error().message, "rank=4")) << whole.error().message;
  ASSERT_TRUE(c->release(m1->update_id));
}

// A reader frozen past lease_timeout_ms (SIGSTOP) loses its lease, but while its process still
// runs on this host it may serve views of the files it mapped: the writer leaves those files to
// it and writes the next update into new ones.
TEST_P(file_mmap_test, a_reader_frozen_past_its_lease_keeps_the_files_it_maps) {
  start_publisher(std::chrono::milliseconds(6000), {{"lease_timeout_ms", "1500"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  ASSERT_TRUE(publish(2));
  const int b = buffer_of(*m1);
  // The frozen reader: this process, by its pid, mapping the files as a consumer does, with a
  // lease whose heartbeat stopped 10 s ago.
  std::vector<std::pair<void*, std::size_t>> maps;
  std::shared_ptr<void> unmap_all(nullptr, [&](void*) {
    for (auto [p, n] : maps) ::munmap(p, n);
  });
  std::vector<std::vector<std::byte>> v1;  // what the reader saw
  std::vector<ino_t> inodes;
  auto segment = [&](std::size_t i) {
    return file_mmap_detail::segment_path(dir_, static_cast<std::uint64_t>(b), i);
  };
  for (std::size_t i = 0; i < m1->segments.size(); ++i) {
    const auto path = segment(i);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
    struct stat st {};
    ASSERT_EQ(::fstat(fd, &st), 0);
    inodes.push_back(st.st_ino);
    const std::size_t n = m1->segments[i].nbytes;
    void* p = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    ASSERT_NE(p, MAP_FAILED) << std::strerror(errno);
    maps.emplace_back(p, n);
    const auto* at = static_cast<const std::byte*>(p);
    v1.emplace_back(at, at + n);
  }
  const std::string lease = frozen_lease(b);
  ASSERT_FALSE(lease.empty()) << std::strerror(errno);
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  EXPECT_EQ(buffer_of(*m3), b);
  EXPECT_FALSE(fs::exists(lease));
  for (std::size_t i = 0; i < maps.size(); ++i) {
    EXPECT_EQ(std::memcmp(maps[i].first, v1[i].data(), v1[i].size()), 0)
        << "segment " << i << " was rewritten under the frozen reader";
    EXPECT_NE(inode_of(segment(i)), inodes[i]) << "segment " << i << " is the file it maps";
  }
  EXPECT_FALSE(fs::exists(file_mmap_detail::fresh_files_path(dir_, static_cast<std::uint64_t>(b))));
  auto c = consumer(1);
  ASSERT_TRUE(c->import_update(*m3));
  ASSERT_TRUE(c->verify(m3->update_id));
  ASSERT_TRUE(c->release(m3->update_id));
  // Nobody maps the new files: the next update into this buffer writes them in place.
  const ino_t written = inode_of(segment(0));
  ASSERT_NE(written, 0u);
  ASSERT_TRUE(publish(4));
  auto m5 = publish(5);
  ASSERT_TRUE(m5) << m5.error().message;
  ASSERT_EQ(buffer_of(*m5), b);
  EXPECT_EQ(inode_of(segment(0)), written);
}

// The lease goes before the buffer is written: a publisher that restarts in between learns from
// the buffer's FRESH mark that a reader may still map its files.
// The frozen reader maps a segment the next update of its buffer does not have (fewer
// segments): that file goes too, so an update that has it again makes a new one rather than
// writing into the reader's once the buffer's mark is gone.
TEST_P(file_mmap_test, a_frozen_readers_files_past_the_next_updates_last_segment_are_left_to_it) {
  start_publisher(std::chrono::milliseconds(6000), {{"lease_timeout_ms", "1500"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  ASSERT_GE(m1->segments.size(), 2u);
  ASSERT_TRUE(publish(2));
  const int b = buffer_of(*m1);
  const auto last =
      file_mmap_detail::segment_path(dir_, static_cast<std::uint64_t>(b), m1->segments.size() - 1);
  const std::size_t n = m1->segments.back().nbytes;
  int fd = ::open(last.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << last << ": " << std::strerror(errno);
  void* p = ::mmap(nullptr, n, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(p, MAP_FAILED) << std::strerror(errno);
  std::shared_ptr<void> unmap(p, [n](void* q) { ::munmap(q, n); });
  const std::vector<std::byte> seen(static_cast<std::byte*>(p), static_cast<std::byte*>(p) + n);
  const std::string lease = frozen_lease(b);
  ASSERT_FALSE(lease.empty()) << std::strerror(errno);
  auto all = bytes_;
  bytes_.resize(1);  // one segment: the reader's last one is not part of version 3
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  ASSERT_EQ(buffer_of(*m3), b);
  ASSERT_EQ(m3->segments.size(), 1u);
  EXPECT_FALSE(fs::exists(last)) << "left in the buffer, where a later update writes in place";
  bytes_ = all;
  ASSERT_TRUE(publish(4));
  auto m5 = publish(5);  // the buffer again, with every segment
  ASSERT_TRUE(m5) << m5.error().message;
  ASSERT_EQ(buffer_of(*m5), b);
  EXPECT_EQ(std::memcmp(p, seen.data(), n), 0) << "the reader's segment was rewritten under it";
}

TEST_P(file_mmap_test, a_restarted_publisher_still_leaves_a_frozen_readers_files_to_it) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  ASSERT_TRUE(publish(2));
  const auto b = static_cast<std::uint64_t>(buffer_of(*m1));
  const auto segment0 = file_mmap_detail::segment_path(dir_, b, 0);
  const ino_t mapped = inode_of(segment0);
  ASSERT_NE(mapped, 0u);
  ASSERT_TRUE(file_mmap_detail::fresh_files_mark(dir_, b, "rank 7 (a frozen reader)"));
  start_publisher();  // a new publisher process, as after a crash
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  ASSERT_EQ(static_cast<std::uint64_t>(buffer_of(*m3)), b);
  EXPECT_NE(inode_of(segment0), mapped);
  EXPECT_FALSE(fs::exists(file_mmap_detail::fresh_files_path(dir_, b)));
}

// A leases folder the writer cannot read (EACCES for another uid, ESTALE or EIO on NFS; here a
// file in its place, which no uid gets past) must not read as a folder with no lease in it.
TEST_P(file_mmap_test, leases_the_writer_cannot_list_keep_the_buffer_held) {
  start_publisher();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto c = consumer(3);
  ASSERT_TRUE(c->import_update(*m1));  // rank 3 reads buffer-0
  ASSERT_TRUE(publish(2));             // buffer-1 is CURRENT: the next one needs buffer-0
  fs::rename(dir_ + "/leases", dir_ + "/leases.away");
  { std::ofstream(dir_ + "/leases") << "not a folder"; }
  auto m3 = publish(3);
  ASSERT_FALSE(m3) << "buffer-0 was rewritten under a reader the writer could not see";
  EXPECT_EQ(m3.error().code, errc::timeout);
  EXPECT_TRUE(contains(m3.error().message, "readers the writer cannot list")) << m3.error().message;
  // The reader cannot tell whether its lease stands either: it does not vouch for the bytes.
  auto whole = c->intact(m1->update_id);
  ASSERT_FALSE(whole);
  EXPECT_EQ(whole.error().code, errc::io_error);
  EXPECT_TRUE(contains(whole.error().message, "cannot check this reader's lease"))
      << whole.error().message;
  EXPECT_TRUE(contains(whole.error().message, "rank=3")) << whole.error().message;
  fs::remove(dir_ + "/leases");
  fs::rename(dir_ + "/leases.away", dir_ + "/leases");
  ASSERT_TRUE(c->intact(m1->update_id));
  ASSERT_TRUE(c->release(m1->update_id));
  auto m3b = publish(3);
  ASSERT_TRUE(m3b) << m3b.error().message;
  EXPECT_EQ(buffer_of(*m3b), 0);
}

INSTANTIATE_TEST_SUITE_P(on, file_mmap_test, ::testing::Values("tmpfs", "disk"));

TEST(file_mmap_options, dir_is_required_and_buffers_checked) {
  auto none = make_transport("file-mmap");
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().code, errc::invalid_argument);
  EXPECT_TRUE(contains(none.error().message, "file-mmap option dir: required"))
      << none.error().message;
  for (const char* bad : {"1", "0", "65", "x"}) {
    auto t = make_transport("file-mmap", {{"dir", "/nowhere"}, {"buffers", bad}});
    ASSERT_FALSE(t) << "buffers=" << bad;
    EXPECT_TRUE(contains(t.error().message, "buffers")) << t.error().message;
  }
  auto unknown = make_transport("file-mmap", {{"dir", "/nowhere"}, {"slots", "2"}});
  ASSERT_FALSE(unknown);
  EXPECT_TRUE(contains(unknown.error().message, "slots")) << unknown.error().message;
  EXPECT_TRUE(make_transport("file-mmap", {{"dir", "/nowhere"}, {"buffers", "3"}}));
  auto write = make_transport("file-mmap", {{"dir", "/nowhere"}, {"write", "fast"}});
  ASSERT_FALSE(write);
  EXPECT_TRUE(contains(write.error().message, "option write")) << write.error().message;
  EXPECT_TRUE(make_transport("file-mmap", {{"dir", "/nowhere"}, {"write", "mmap"}}));
}

// CURRENT names the active buffer; the publisher adds to it to choose the next, so a value
// out of range (INT64_MAX would overflow) is refused like any other damage to the file.
TEST(file_mmap_options, a_state_file_naming_no_possible_buffer_is_refused) {
  for (const char* bad : {"9223372036854775807", "18446744073709551615", "64", "-2"}) {
    auto state = file_mmap_detail::current_parse(std::string(R"({"format":")") +
                                                     file_mmap_detail::state_format +
                                                     R"(","buffer":)" + bad + R"(,"manifest":{}})",
                                                 "CURRENT");
    ASSERT_FALSE(state) << bad;
    EXPECT_NE(state.error().message.find("is out of range"), std::string::npos)
        << state.error().message;
  }
}

// A segment file sized by a publisher that never reserved its blocks (killed after its
// ftruncate, or its fallocate failed on a full disk): the next publisher reserves them again, so
// a full filesystem is an error from publish, not a SIGBUS while it copies. On a 1 MiB tmpfs of
// its own, in a child with a private mount namespace (root).
TEST(file_mmap_full, a_sized_file_without_blocks_is_reserved_again) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root: mounts a small tmpfs";
  char tmpl[] = "/tmp/wsync-fm-full-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr) << std::strerror(errno);
  const std::string dir = tmpl;
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(30);
    if (::unshare(CLONE_NEWNS) != 0) ::_exit(77);
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(77);
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) ::_exit(77);
    const std::string w = dir + "/w";
    // Both buffers' first segment: 4 MiB long, no block behind it.
    for (const char* b : {"/buffer-0", "/buffer-1"}) {
      if (::mkdir(w.c_str(), 0700) != 0 && errno != EEXIST) ::_exit(2);
      if (::mkdir((w + b).c_str(), 0700) != 0) ::_exit(2);
      int fd = ::open((w + b + "/segment-0000").c_str(), O_RDWR | O_CREAT, 0600);
      if (fd < 0 || ::ftruncate(fd, 4 << 20) != 0) ::_exit(2);
      ::close(fd);
    }
    auto t = make_transport("file-mmap", {{"dir", w}, {"write", "mmap"}});
    if (!t) ::_exit(3);
    auto p = (*t)->make_publisher();
    if (!p) ::_exit(4);
    std::vector<std::uint64_t> sizes{4 << 20};
    auto spans = (*p)->acquire("u-full", sizes, std::chrono::milliseconds(100));
    if (spans) {
      std::memset((*spans)[0].data(), 1, (*spans)[0].size());  // SIGBUS without the fix
      ::_exit(5);
    }
    ::_exit(contains(spans.error().message, "fallocate") ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  fs::remove_all(dir);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "no private mount namespace here";
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "5: the full tmpfs was not noticed; 6: another error than fallocate's";
}

// Another user able to write into the dir could replace CURRENT or a segment (readers trust
// their manifest), or plant links that send the writes elsewhere: refused, naming the fix.
TEST(file_mmap_options, a_dir_others_may_write_or_a_planted_link_is_refused) {
  char tmpl[] = "/tmp/wsync-fm-perm-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr) << std::strerror(errno);
  const std::string dir = tmpl;
  auto publisher_of = [&](const std::string& d) {
    auto t = make_transport("file-mmap", {{"dir", d}});
    EXPECT_TRUE(t) << t.error().message;
    return (*t)->make_publisher();
  };
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);  // like /tmp or /dev/shm themselves
  auto shared = publisher_of(dir);
  ASSERT_FALSE(shared);
  EXPECT_TRUE(contains(shared.error().message, "with mode 1777: another user could replace"))
      << shared.error().message;
  ASSERT_EQ(::chmod(dir.c_str(), 0775), 0);  // what a umask of 002 makes: the group's to write
  EXPECT_TRUE(publisher_of(dir));
  fs::remove_all(dir + "/leases");  // what that publisher made, for the links planted below
  fs::remove(dir + "/publisher.lock");
  ASSERT_EQ(::chmod(dir.c_str(), 0700), 0);
  const std::string victim = dir + "/victim";
  fs::create_directories(victim);
  fs::create_directory_symlink(victim, dir + "/leases");
  auto linked = publisher_of(dir);
  ASSERT_FALSE(linked);
  EXPECT_TRUE(contains(linked.error().message, "leases exists and is not a directory (a link"))
      << linked.error().message;
  fs::remove(dir + "/leases");
  { std::ofstream(victim + "/file") << "keep"; }
  fs::create_symlink(victim + "/file", dir + "/publisher.lock");
  auto locked = publisher_of(dir);
  ASSERT_FALSE(locked);
  EXPECT_EQ(std::ifstream(victim + "/file").rdbuf()->sgetc(), 'k');  // untouched
  fs::remove(dir + "/publisher.lock");
  EXPECT_TRUE(publisher_of(dir));  // the folder as it should be
  fs::remove_all(dir);
}

TEST(file_mmap_options, no_state_file_means_no_version_yet) {
  auto none = file_mmap_current("/wsync-surely-missing");
  ASSERT_TRUE(none) << none.error().message;
  EXPECT_FALSE(*none);
}

}  // namespace
}  // namespace wsync
