// The ucx transport beyond the shared suite: relays, chunk checksums, both pull operations,
// failures and options. Publisher, relay and child are three UCX workers in this process.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>
#include <utility>
#include <vector>

#include "wsync/manifest/codec.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/ucx.hpp"

namespace wsync {
namespace {

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

class ucx_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!transport_known("ucx")) GTEST_SKIP() << "built without UCX (libucx-dev not found)";
  }

  std::unique_ptr<transport> make(transport_options o = {}) {
    o.try_emplace("chunk_bytes", "65536");  // many chunks from small updates
    o.try_emplace("window", "2");
    o.try_emplace("timeout_ms", "10000");
    auto t = make_transport("ucx", o);
    EXPECT_TRUE(t) << t.error().message;
    return t ? std::move(*t) : nullptr;
  }

  // Publishes segments of the given sizes filled with a pattern; returns the manifest.
  weight_update_manifest publish(publisher_transport& p, const update_id& id,
                                 std::vector<std::uint64_t> sizes, std::uint8_t seed) {
    auto spans = p.acquire(id, sizes, std::chrono::milliseconds(1000));
    EXPECT_TRUE(spans) << spans.error().message;
    weight_update_manifest m;
    m.update_id = id;
    m.model_id = "ucx-test";
    m.weight_version = 1;
    m.transport = "ucx";
    for (std::size_t s = 0; s < sizes.size(); ++s) {
      for (std::size_t i = 0; i < sizes[s]; ++i) {
        (*spans)[s][i] = std::byte((i * 7 + s * 13 + seed) & 0xff);
      }
      m.segments.push_back({sizes[s]});
      m.total_bytes += sizes[s];
    }
    spans_ = *spans;
    auto h = p.expose(id);
    EXPECT_TRUE(h) << h.error().message;
    m.transport_handle = *h;
    return m;
  }

  // `m` pointed at the relay `address` (its publisher kept as the fallback).
  static weight_update_manifest via_relay(const transport& t, weight_update_manifest m,
                                          const std::string& address) {
    auto handle = t.handle_via_relay(m.transport_handle, address);
    EXPECT_TRUE(handle) << handle.error().message;
    if (handle) m.transport_handle = *handle;
    return m;
  }

  static void expect_pattern(const std::vector<std::span<const std::byte>>& got,
                             const weight_update_manifest& m, std::uint8_t seed) {
    ASSERT_EQ(got.size(), m.segments.size());
    for (std::size_t s = 0; s < got.size(); ++s) {
      ASSERT_EQ(got[s].size(), m.segments[s].nbytes);
      for (std::size_t i = 0; i < got[s].size(); ++i) {
        ASSERT_EQ(got[s][i], std::byte((i * 7 + s * 13 + seed) & 0xff))
            << "segment " << s << " byte " << i;
      }
    }
  }

  std::vector<std::span<std::byte>> spans_;
};

TEST_F(ucx_test, auto_op_picks_get_only_for_shared_memory_transports) {
  EXPECT_EQ(ucx_auto_op("tcp"), "tag");
  EXPECT_EQ(ucx_auto_op(""), "tag");
  EXPECT_EQ(ucx_auto_op("sm,tcp"), "tag");
  EXPECT_EQ(ucx_auto_op("posix,sysv,cma"), "get");
  EXPECT_EQ(ucx_auto_op("sm"), "get");
}

TEST(ucx_tls, tcp_may_be_used_unless_the_list_leaves_it_out) {
  EXPECT_TRUE(ucx_tls_may_use_tcp(""));
  EXPECT_TRUE(ucx_tls_may_use_tcp("tcp"));
  EXPECT_TRUE(ucx_tls_may_use_tcp("sm,tcp"));
  EXPECT_TRUE(ucx_tls_may_use_tcp("all"));
  EXPECT_TRUE(ucx_tls_may_use_tcp("^sm"));
  EXPECT_FALSE(ucx_tls_may_use_tcp("posix,sysv,cma"));
  EXPECT_FALSE(ucx_tls_may_use_tcp("rc,ud"));
  EXPECT_FALSE(ucx_tls_may_use_tcp("^tcp"));
  EXPECT_FALSE(ucx_tls_may_use_tcp("^sm,tcp"));
}

// A handle that names the publisher's process without its host's boot id (a build before it)
// is imported all the same; the process is then not watched.
TEST_F(ucx_test, a_handle_without_a_boot_id_is_imported) {
  auto t = make({{"op", "get"}});
  auto p = t->make_publisher();
  auto c = t->make_consumer();
  ASSERT_TRUE(p && c);
  auto m = publish(**p, "u-no-boot", {100000}, 2);
  const auto at = m.transport_handle.find(",\"boot\":\"");
  ASSERT_NE(at, std::string::npos) << m.transport_handle;
  m.transport_handle.erase(at, m.transport_handle.find('"', at + 9) + 1 - at);
  ASSERT_FALSE(contains(m.transport_handle, "boot")) << m.transport_handle;
  auto got = (*c)->import_segments(m);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, m, 2);
  (*c)->release(m.update_id);
  (*p)->release(m.update_id);
}

TEST_F(ucx_test, tag_and_get_pulls_deliver_the_same_bytes) {
  for (const char* op : {"tag", "get"}) {
    SCOPED_TRACE(op);
    auto t = make({{"op", op}});
    auto p = t->make_publisher();
    auto c = t->make_consumer();
    ASSERT_TRUE(p && c);
    // Odd sizes: a last chunk shorter than the others, an empty segment, one of a single chunk.
    auto m = publish(**p, "u-" + std::string(op), {300001, 0, 4096, 131072}, 5);
    auto got = (*c)->import_segments(m);
    ASSERT_TRUE(got) << got.error().message;
    expect_pattern(*got, m, 5);
    (*c)->release(m.update_id);
    (*p)->release(m.update_id);
  }
}

TEST_F(ucx_test, a_relay_serves_a_child_that_asked_before_the_relay_started) {
  auto t = make();
  auto p = t->make_publisher();
  auto relay = t->make_consumer();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && relay && child);
  ASSERT_FALSE((*relay)->relay_address().empty());
  auto m = publish(**p, "u-relay", {1 << 20, 70000}, 9);
  auto via = t->handle_via_relay(m.transport_handle, (*relay)->relay_address());
  ASSERT_TRUE(via) << via.error().message;
  auto child_manifest = m;
  child_manifest.transport_handle = *via;
  EXPECT_FALSE(contains(*via, "rkey")) << "a relay serves by request, not by the publisher's keys";
  EXPECT_FALSE(contains(*via, "\"pid\"")) << "nor is the publisher's process watched through it";
  EXPECT_TRUE(contains(m.transport_handle, "\"pid\"")) << m.transport_handle;

  // The child asks first: its fetches wait at the relay until the relay's own import lands
  // each chunk, then the relay forwards chunk by chunk while still importing.
  auto child_done =
      std::async(std::launch::async, [&] { return (*child)->import_segments(child_manifest); });
  auto relay_got = (*relay)->import_segments(m);
  ASSERT_TRUE(relay_got) << relay_got.error().message;
  auto child_got = child_done.get();
  ASSERT_TRUE(child_got) << child_got.error().message;
  expect_pattern(*relay_got, m, 9);
  expect_pattern(*child_got, m, 9);

  (*child)->release(m.update_id);
  (*relay)->release(m.update_id);
  (*p)->release(m.update_id);
}

// A handle as it would be without fallbacks: only its first source.
std::string without_fallbacks(const std::string& handle) {
  auto at = handle.find(",\"fallbacks\":[");
  if (at == std::string::npos) return handle;
  return handle.substr(0, at) + handle.substr(handle.find(']', at) + 1);
}

TEST_F(ucx_test, a_corrupt_chunk_at_a_relay_is_not_forwarded_and_the_child_falls_back) {
  auto t = make();
  auto p = t->make_publisher();
  auto relay = t->make_consumer();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && relay && child);
  auto m = publish(**p, "u-corrupt", {200000}, 3);
  auto relay_got = (*relay)->import_segments(m);
  ASSERT_TRUE(relay_got) << relay_got.error().message;
  // The relay's copy of chunk 1 goes bad after landing (a flipped bit in its memory).
  const_cast<std::byte&>((*relay_got)[0][65536 + 10]) ^= std::byte{0xff};

  auto child_manifest = m;
  auto via = t->handle_via_relay(m.transport_handle, (*relay)->relay_address());
  ASSERT_TRUE(via) << via.error().message;
  child_manifest.transport_handle = without_fallbacks(*via);
  auto refused = (*child)->import_segments(child_manifest);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, errc::checksum_mismatch);
  EXPECT_TRUE(contains(refused.error().message, "tensor checksum mismatch: chunk 1 of segment 0"))
      << refused.error().message;
  EXPECT_TRUE(contains(refused.error().message, "update_id=u-corrupt")) << refused.error().message;

  // With the publisher as fallback the child takes the refused chunk (and the rest) from there.
  child_manifest.transport_handle = *via;
  auto got = (*child)->import_segments(child_manifest);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, m, 3);
  (*child)->release(m.update_id);
  (*relay)->release(m.update_id);
  (*p)->release(m.update_id);
}

TEST_F(ucx_test, a_relay_that_shuts_down_hands_its_children_to_its_source) {
  auto t = make();
  auto p = t->make_publisher();
  auto relay = t->make_consumer();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && relay && child);
  auto m = publish(**p, "u-orphan", {1 << 20}, 4);
  auto child_manifest = via_relay(*t, m, (*relay)->relay_address());
  // The relay never imports: the child's fetches wait there until it goes away.
  auto child_done =
      std::async(std::launch::async, [&] { return (*child)->import_segments(child_manifest); });
  relay->reset();
  auto got = child_done.get();
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, m, 4);
  (*child)->release(m.update_id);
  (*p)->release(m.update_id);
}

// A relay that never imports the update (it refused the version, or let go of it) and stays up:
// it answers the child's fetches within half the timeout, so the child still has time to pull
// everything from the publisher before its own import times out.
TEST_F(ucx_test, a_relay_that_never_imports_lets_its_child_fall_back_in_time) {
  auto t = make({{"timeout_ms", "2000"}});
  auto p = t->make_publisher();
  auto relay = t->make_consumer();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && relay && child);
  auto m = publish(**p, "u-skipped", {300000}, 6);
  auto child_manifest = via_relay(*t, m, (*relay)->relay_address());
  auto got = (*child)->import_segments(child_manifest);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, m, 6);
  (*child)->release(m.update_id);
  (*p)->release(m.update_id);
}

// The relay started importing but its own source stalled (here: a relay of its own that never
// imports holds its fetches for half of its 60 s timeout). Its child's fetches wait at the relay
// for half the relay's timeout (1.5 s), not until the relay gives up (3 s, after the child's own
// 2 s deadline): the child then pulls from the publisher in time.
TEST_F(ucx_test, a_child_waiting_at_a_relay_whose_source_stalled_falls_back_in_time) {
  auto t = make({{"timeout_ms", "2000"}});
  auto relaying = make({{"timeout_ms", "3000"}});
  auto slow = make({{"timeout_ms", "60000"}});
  auto p = t->make_publisher();
  auto relay = relaying->make_consumer();
  auto child = t->make_consumer();
  auto stalled = slow->make_consumer();  // never imports
  ASSERT_TRUE(p && relay && child && stalled);
  auto m = publish(**p, "u-stalled", {300000}, 8);
  auto relay_manifest = via_relay(*t, m, (*stalled)->relay_address());
  auto at_relay =
      std::async(std::launch::async, [&] { return (*relay)->import_segments(relay_manifest); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the relay has started
  auto child_manifest = via_relay(*t, m, (*relay)->relay_address());
  auto got = (*child)->import_segments(child_manifest);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, m, 8);
  (*child)->release(m.update_id);
  (void)at_relay.get();  // it fails at its deadline, or gets the bytes from the publisher
  (*relay)->release(m.update_id);
  (*p)->release(m.update_id);
}

// A child that gave up (its import timed out while its fetches waited at the relay) never takes
// the chunks the relay then sends it. Those sends must not keep the relay's slot busy forever.
TEST_F(ucx_test, chunks_sent_to_a_child_that_gave_up_do_not_hold_the_relay_slot) {
  // Rendezvous for every chunk: an eager send would complete without the child.
  auto t = make({{"slots", "1"}, {"timeout_ms", "1500"}, {"rndv_thresh", "4096"}, {"op", "tag"}});
  auto impatient = make({{"timeout_ms", "300"}, {"rndv_thresh", "4096"}, {"op", "tag"}});
  auto p = t->make_publisher();
  auto relay = t->make_consumer();
  auto child = impatient->make_consumer();
  ASSERT_TRUE(p && relay && child);
  auto a = publish(**p, "u-gave-up", {1 << 20}, 6);
  auto child_manifest = a;
  child_manifest.transport_handle =
      *t->handle_via_relay(without_fallbacks(a.transport_handle), (*relay)->relay_address());
  auto gave_up = (*child)->import_segments(child_manifest);
  ASSERT_FALSE(gave_up);
  EXPECT_EQ(gave_up.error().code, errc::timeout) << gave_up.error().message;

  // The relay starts now and answers the fetches the child left behind.
  auto relay_got = (*relay)->import_segments(a);
  ASSERT_TRUE(relay_got) << relay_got.error().message;
  expect_pattern(*relay_got, a, 6);
  (*relay)->release(a.update_id);
  (*p)->release(a.update_id);

  // One slot: the next import needs the one those sends read. They are given up once they are
  // older than the relay's timeout_ms, so within a few attempts it is free again.
  auto b = publish(**p, "u-next", {1 << 20}, 7);
  result<std::vector<std::span<const std::byte>>> got = make_error(errc::timeout, "not tried");
  for (int attempt = 0; attempt < 3 && !got; ++attempt) got = (*relay)->import_segments(b);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, b, 7);
  (*relay)->release(b.update_id);
  (*p)->release(b.update_id);
}

TEST_F(ucx_test, a_striped_handle_pulls_each_stripe_from_its_own_relay) {
  auto t = make();
  auto p = t->make_publisher();
  auto r1 = t->make_consumer();
  auto r2 = t->make_consumer();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && r1 && r2 && child);
  auto m = publish(**p, "u-striped", {1 << 20, 300000}, 6);
  auto via1 = t->handle_via_relay(m.transport_handle, (*r1)->relay_address());
  auto via2 = t->handle_via_relay(m.transport_handle, (*r2)->relay_address());
  ASSERT_TRUE(via1 && via2);
  auto striped = t->handle_striped({*via1, *via2});
  ASSERT_TRUE(striped) << striped.error().message;
  auto child_manifest = m;
  child_manifest.transport_handle = *striped;
  // Both relays import while the child pulls even chunks through one, odd through the other;
  // then the second relay goes away before a second child asks, whose odd chunks fall back
  // to the publisher.
  auto child_done =
      std::async(std::launch::async, [&] { return (*child)->import_segments(child_manifest); });
  auto g1 = std::async(std::launch::async, [&] { return (*r1)->import_segments(m); });
  auto g2 = (*r2)->import_segments(m);
  ASSERT_TRUE(g2) << g2.error().message;
  ASSERT_TRUE(g1.get());
  auto got = child_done.get();
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, m, 6);

  r2->reset();
  auto second = t->make_consumer();
  ASSERT_TRUE(second);
  auto again = (*second)->import_segments(child_manifest);
  ASSERT_TRUE(again) << again.error().message;
  expect_pattern(*again, m, 6);

  auto refused = t->handle_striped({*striped, *via1});
  EXPECT_FALSE(refused) << "a striped handle is not striped again";
  (*second)->release(m.update_id);
  (*child)->release(m.update_id);
  (*r1)->release(m.update_id);
  (*p)->release(m.update_id);
}

// --- a relay in another process, killed mid-update ------------------------------------------

bool write_line(int fd, const std::string& text) {
  std::string line = text + "\n";
  return ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
}

std::string read_line(int fd) {
  std::string line;
  char c = 0;
  while (::read(fd, &c, 1) == 1 && c != '\n') line += c;
  return line;
}

// This test binary again, running only test `name` (one of the *_process tests below), which
// finds its end of two pipes in the environment variable `fds_var` as "<in>,<out>", and any
// further variables in `env`: what it writes comes through `from`, what it reads from `to`.
struct child_process {
  pid_t pid = -1;
  int to = -1, from = -1;

  static child_process spawn(const std::string& name, const char* fds_var,
                             const std::vector<std::pair<std::string, std::string>>& env = {}) {
    child_process c;
    int to_child[2], from_child[2];
    if (::pipe(to_child) != 0 || ::pipe(from_child) != 0) return c;
    std::string exe = std::filesystem::read_symlink("/proc/self/exe");
    c.pid = ::fork();
    if (c.pid == 0) {
      ::close(to_child[1]);
      ::close(from_child[0]);
      std::string fds = std::to_string(to_child[0]) + "," + std::to_string(from_child[1]);
      ::setenv(fds_var, fds.c_str(), 1);
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      const std::string filter = "--gtest_filter=ucx_test." + name;
      ::execl(exe.c_str(), exe.c_str(), filter.c_str(), nullptr);
      ::_exit(127);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    c.to = to_child[1];
    c.from = from_child[0];
    return c;
  }
  void close_pipes() {
    if (to >= 0) ::close(std::exchange(to, -1));
    if (from >= 0) ::close(std::exchange(from, -1));
  }
};

// Not a test of its own: the relay process of the test below, which runs this binary again
// with WSYNC_UCX_RELAY_FDS="<in>,<out>". It prints its relay address, imports each manifest it
// reads, says "ok", and runs until killed.
TEST_F(ucx_test, relay_process) {
  const char* fds = std::getenv("WSYNC_UCX_RELAY_FDS");
  if (!fds) GTEST_SKIP() << "runs only as the relay process of a_killed_relay_hands_...";
  int in = std::atoi(fds), out = std::atoi(std::strchr(fds, ',') + 1);
  auto t = make({{"tls", "tcp"}});
  auto c = t->make_consumer();
  ASSERT_TRUE(c);
  write_line(out, (*c)->relay_address());
  for (std::string line; !(line = read_line(in)).empty();) {
    auto m = manifest_from_json(line);
    ASSERT_TRUE(m);
    auto got = (*c)->import_segments(*m);
    write_line(out, got ? "ok" : got.error().message);
  }
}

TEST_F(ucx_test, a_killed_relay_hands_its_children_to_its_source) {
  // Over TCP, where UCX reports a dead peer: the child's endpoint to the relay fails and the
  // child goes on from the publisher, keeping the chunks it already has.
  auto relay = child_process::spawn("relay_process", "WSYNC_UCX_RELAY_FDS");
  ASSERT_GE(relay.pid, 0);
  std::string relay_address = read_line(relay.from);
  ASSERT_FALSE(relay_address.empty()) << "the relay process did not start";

  auto t = make({{"tls", "tcp"}});
  auto p = t->make_publisher();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && child);
  // Update a goes through the relay as planned, and leaves the child connected to it.
  auto a = publish(**p, "u-a", {1 << 20}, 1);
  auto child_a = std::async(std::launch::async, [&] {
    return (*child)->import_segments(via_relay(*t, a, relay_address));
  });
  ASSERT_TRUE(write_line(relay.to, manifest_to_json(a)));
  EXPECT_EQ(read_line(relay.from), "ok");
  auto got_a = child_a.get();
  ASSERT_TRUE(got_a) << got_a.error().message;
  expect_pattern(*got_a, a, 1);

  // Update b: the child asks the relay, which dies before it ever imports b.
  auto b = publish(**p, "u-b", {1 << 20}, 2);
  auto child_b = std::async(std::launch::async, [&] {
    return (*child)->import_segments(via_relay(*t, b, relay_address));
  });
  ::kill(relay.pid, SIGKILL);
  ::waitpid(relay.pid, nullptr, 0);
  auto got_b = child_b.get();
  ASSERT_TRUE(got_b) << got_b.error().message;
  expect_pattern(*got_b, b, 2);

  relay.close_pipes();
  (*child)->release(a.update_id);
  (*child)->release(b.update_id);
  (*p)->release(a.update_id);
  (*p)->release(b.update_id);
}

// The publisher of a_frozen_publisher_...: publishes one update, hands its manifest over, then
// waits until its input closes (it is frozen meanwhile).
TEST_F(ucx_test, publisher_process) {
  const char* fds = std::getenv("WSYNC_UCX_PUBLISHER_FDS");
  if (!fds) GTEST_SKIP() << "runs only as the publisher process of a_frozen_publisher_...";
  int in = std::atoi(fds), out = std::atoi(std::strchr(fds, ',') + 1);
  const char* tls = std::getenv("WSYNC_UCX_PUBLISHER_TLS");
  auto t = make({{"tls", tls ? tls : "tcp"}, {"op", "get"}});
  auto p = t->make_publisher();
  ASSERT_TRUE(p);
  write_line(out, manifest_to_json(publish(**p, "u-frozen", {64 << 20}, 3)));
  (void)read_line(in);
}

// RMA gets over TCP (emulated by UCX, so each waits for the publisher's answer) still in flight
// when the importer's deadline passes: its connection is closed with them, and the remote key
// they use outlives them. The node then imports the next update as usual.
TEST_F(ucx_test, a_frozen_publisher_fails_a_get_import_at_its_deadline_and_the_node_goes_on) {
  auto pub = child_process::spawn("publisher_process", "WSYNC_UCX_PUBLISHER_FDS");
  ASSERT_GE(pub.pid, 0);
  auto m = manifest_from_json(read_line(pub.from));
  ASSERT_TRUE(m) << "the publisher process did not start";
  ASSERT_TRUE(contains(m->transport_handle, "rkey")) << m->transport_handle;

  auto t = make({{"tls", "tcp"}, {"op", "get"}, {"timeout_ms", "1500"}});
  auto c = t->make_consumer();
  ASSERT_TRUE(c);
  auto importing = std::async(std::launch::async, [&] { return (*c)->import_segments(*m); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // 64 MiB take longer than that
  ::kill(pub.pid, SIGSTOP);
  auto got = importing.get();
  ::kill(pub.pid, SIGKILL);
  ::waitpid(pub.pid, nullptr, 0);
  pub.close_pipes();
  if (got) GTEST_SKIP() << "the import finished before the publisher froze";
  EXPECT_EQ(got.error().code, errc::timeout) << got.error().message;
  EXPECT_TRUE(contains(got.error().message, "u-frozen")) << got.error().message;
  (*c)->release(m->update_id);

  auto p = t->make_publisher();
  ASSERT_TRUE(p);
  auto next = publish(**p, "u-after-frozen", {1 << 20}, 4);
  auto again = (*c)->import_segments(next);
  ASSERT_TRUE(again) << again.error().message;
  expect_pattern(*again, next, 4);
  (*c)->release(next.update_id);
  (*p)->release(next.update_id);
}

// Shared mappings of this process of at least `bytes`: slots, ours and those we attached.
int shared_mappings_of_at_least(std::uint64_t bytes) {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    std::uint64_t from = 0, to = 0;
    char perms[5] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &from, &to, perms) == 3 && perms[3] == 's' &&
        to - from >= bytes) {
      ++n;
    }
  }
  return n;
}

// Over shared memory UCX never reports a dead peer, and a kept remote key keeps the exited
// publisher's slot mapped here: a trainer restart would leave the old ring in every consumer's
// memory. The consumer watches the publisher's process and lets the key go once it exited.
TEST_F(ucx_test, the_slot_of_an_exited_publisher_is_unmapped_over_shared_memory) {
  auto pub = child_process::spawn("publisher_process", "WSYNC_UCX_PUBLISHER_FDS",
                                  {{"WSYNC_UCX_PUBLISHER_TLS", "sm,self"}});
  ASSERT_GE(pub.pid, 0);
  auto m = manifest_from_json(read_line(pub.from));
  ASSERT_TRUE(m) << "the publisher process did not start";
  auto t = make({{"tls", "sm,self"}, {"op", "get"}});
  auto c = t->make_consumer();
  ASSERT_TRUE(c);
  auto got = (*c)->import_segments(*m);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, *m, 3);
  (*c)->release(m->update_id);
  const std::uint64_t slot_bytes = 64 << 20;
  ASSERT_EQ(shared_mappings_of_at_least(slot_bytes), 2) << "our landing slot and the publisher's";

  pub.close_pipes();  // the publisher exits
  ::waitpid(pub.pid, nullptr, 0);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (shared_mappings_of_at_least(slot_bytes) > 1 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(shared_mappings_of_at_least(slot_bytes), 1)
      << "the exited publisher's slot is still mapped";
}

TEST_F(ucx_test, a_released_update_is_unknown_to_its_publisher) {
  auto t = make({{"op", "tag"}});
  auto p = t->make_publisher();
  auto c = t->make_consumer();
  ASSERT_TRUE(p && c);
  auto m = publish(**p, "u-gone", {100000}, 1);
  (*p)->release(m.update_id);
  auto got = (*c)->import_segments(m);
  ASSERT_FALSE(got);
  EXPECT_EQ(got.error().code, errc::unknown_update);
  EXPECT_TRUE(contains(got.error().message, "unknown update_id: u-gone")) << got.error().message;
}

TEST_F(ucx_test, landing_memory_is_reused_after_release_and_bounded_by_slots) {
  auto t = make({{"slots", "1"}, {"timeout_ms", "300"}});
  auto p = t->make_publisher();
  auto c = t->make_consumer();
  ASSERT_TRUE(p && c);
  auto a = publish(**p, "u-a", {100000}, 1);
  ASSERT_TRUE((*c)->import_segments(a));
  (*p)->release(a.update_id);  // the consumer still holds its landing copy
  auto b = publish(**p, "u-b", {100000}, 2);
  auto refused = (*c)->import_segments(b);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, errc::timeout);
  EXPECT_TRUE(contains(refused.error().message, "no free consumer slot for update_id=u-b"))
      << refused.error().message;
  (*c)->release(a.update_id);
  auto got = (*c)->import_segments(b);
  ASSERT_TRUE(got) << got.error().message;
  expect_pattern(*got, b, 2);
  (*c)->release(b.update_id);
  (*p)->release(b.update_id);
}

TEST_F(ucx_test, a_vanished_publisher_fails_the_import) {
  auto t = make({{"op", "tag"}, {"timeout_ms", "2000"}});
  auto c = t->make_consumer();
  ASSERT_TRUE(c);
  weight_update_manifest m;
  {
    auto p = t->make_publisher();
    ASSERT_TRUE(p);
    m = publish(**p, "u-vanished", {100000}, 1);
  }  // the publisher's worker is gone with its memory
  auto got = (*c)->import_segments(m);
  ASSERT_FALSE(got);
  EXPECT_TRUE(got.error().code == errc::io_error || got.error().code == errc::timeout)
      << errc_name(got.error().code) << ": " << got.error().message;
  EXPECT_TRUE(contains(got.error().message, "u-vanished")) << got.error().message;
}

TEST_F(ucx_test, a_malformed_handle_is_an_invalid_manifest) {
  auto t = make();
  auto c = t->make_consumer();
  ASSERT_TRUE(c);
  weight_update_manifest m;
  m.update_id = "u-bad";
  m.transport = "ucx";
  m.segments = {{100000}};
  for (const char* h : {"{}", "[1]", R"({"address":"zz","chunk":65536,"checksums":[[]]})",
                        R"({"address":"00","chunk":65536,"checksums":[]})",
                        R"({"address":"00","chunk":65536,"checksums":[["0000000000000000"]]})",
                        R"({"address":"00","chunk":65536,"checksums":[["0000000000000000",)"
                        R"("0000000000000000"]],"rkey":"00","bases":[4096],"pid":-1,)"
                        R"("pid_start":1,"pidns":0,"boot":"b"})"}) {
    m.transport_handle = h;
    auto got = (*c)->import_segments(m);
    ASSERT_FALSE(got) << h;
    EXPECT_EQ(got.error().code, errc::invalid_manifest) << h;
    EXPECT_TRUE(contains(got.error().message, "invalid manifest: transport_handle"))
        << got.error().message;
  }
}

TEST_F(ucx_test, options_are_checked_and_name_the_key) {
  auto unknown = make_transport("ucx", {{"tsl", "tcp"}});
  ASSERT_FALSE(unknown);
  EXPECT_TRUE(contains(unknown.error().message, "tsl")) << unknown.error().message;
  auto op = make_transport("ucx", {{"op", "put"}});
  ASSERT_FALSE(op);
  EXPECT_TRUE(contains(op.error().message, "ucx option op")) << op.error().message;
  auto chunk = make_transport("ucx", {{"chunk_bytes", "12"}});
  ASSERT_FALSE(chunk);
  EXPECT_TRUE(contains(chunk.error().message, "chunk_bytes")) << chunk.error().message;
  // A transport list UCX cannot satisfy here fails when the worker is made, in UCX's words.
  auto t = make_transport("ucx", {{"tls", "no_such_transport"}});
  ASSERT_TRUE(t);
  auto p = (*t)->make_publisher();
  ASSERT_FALSE(p);
  EXPECT_TRUE(contains(p.error().message, "ucx: ")) << p.error().message;
}

TEST_F(ucx_test, only_relaying_transports_rewrite_handles) {
  auto t = make();
  auto bad = t->handle_via_relay(R"({"address":"00","chunk":65536,"checksums":[]})", "not hex");
  ASSERT_FALSE(bad);
  EXPECT_TRUE(contains(bad.error().message, "relay_address")) << bad.error().message;
  auto shm = make_transport("shared-memory");
  ASSERT_TRUE(shm);
  auto refused = (*shm)->handle_via_relay("{}", "00");
  ASSERT_FALSE(refused);
  EXPECT_TRUE(contains(refused.error().message, "shared-memory cannot relay"))
      << refused.error().message;
}

}  // namespace
}  // namespace wsync
