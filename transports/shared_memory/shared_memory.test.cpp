// Shared memory across real processes: zero-copy import in a forked consumer, read-only
// mappings, slot reuse only after release, the orphan sweep, and nothing left in /dev/shm.

#include "shared_memory/shared_memory.hpp"

#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "wsync/manifest/codec.hpp"
#include "wsync/transports/weight_consumer.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

std::vector<std::string> segments_of(int pid) {
  std::vector<std::string> found;
  std::string prefix = "wsync-" + std::to_string(pid) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) found.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return found;
}

// Runs `body` in a forked child and returns its wait status. The child never returns into the
// test framework: it leaves with _exit.
template <class F>
int in_child(F body) {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

bool exited_ok(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

class shared_memory_test : public ::testing::Test {
 protected:
  void SetUp() override {
    data_.resize(4 << 20);
    for (std::size_t i = 0; i < data_.size(); ++i) data_[i] = std::byte((i * 7 + 3) & 0xff);
    sources_ = {{"a", dtype::u8, {1 << 20}, {}, data_.data(), 1 << 20},
                {"b", dtype::f32, {3 << 18}, {}, data_.data() + (1 << 20), 3 << 20}};
  }
  void TearDown() override {
    publisher_.reset();
    transport_.reset();
    EXPECT_EQ(segments_of(::getpid()), std::vector<std::string>{}) << "left in /dev/shm";
  }

  void make_publisher(int slots, std::chrono::milliseconds wait = std::chrono::seconds(10)) {
    auto t = make_transport("shared-memory", {{"slots", std::to_string(slots)}});
    ASSERT_TRUE(t);
    transport_ = std::move(*t);
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p);
    publisher_config cfg;
    cfg.model_id = "shm";
    cfg.slot_wait = wait;
    publisher_ = std::make_unique<weight_publisher>(std::move(*p), "shared-memory", cfg);
  }

  // A consumer in a fresh process: its own transport instance, nothing shared but the manifest.
  static int consume_in_child(const std::string& manifest_json, bool write_through) {
    auto m = manifest_from_json(manifest_json);
    if (!m) return 10;
    auto t = make_transport("shared-memory");
    if (!t) return 11;
    auto c = (*t)->make_consumer();
    if (!c) return 12;
    weight_consumer consumer(std::move(*c), consumer_config{1, 1});
    auto u = consumer.import_update(*m);
    if (!u) return 13;
    if (write_through) {
      // The mapping is read-only: this store must kill the process. Sanitizers catch SEGV and
      // exit instead, so restore the default action first.
      ::signal(SIGSEGV, SIG_DFL);
      const_cast<std::byte*>((*u)->tensors[0].data)[0] = std::byte{1};
      return 14;
    }
    if (!consumer.verify(m->update_id)) return 15;
    if (!consumer.release(m->update_id)) return 16;
    return 0;
  }

  std::vector<std::byte> data_;
  std::vector<tensor_source> sources_;
  std::unique_ptr<transport> transport_;
  std::unique_ptr<weight_publisher> publisher_;
};

TEST_F(shared_memory_test, consumer_process_imports_and_verifies) {
  make_publisher(2);
  auto m = publisher_->publish(sources_, 1, {1});
  ASSERT_TRUE(m);
  std::string json = manifest_to_json(*m);
  EXPECT_TRUE(exited_ok(in_child([&] { return consume_in_child(json, false); })));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 1));
  EXPECT_TRUE(publisher_->held_updates().empty());
}

TEST_F(shared_memory_test, slots_are_private_and_mapped_read_only) {
  make_publisher(2);
  auto m = publisher_->publish(sources_, 1, {1});
  ASSERT_TRUE(m);
  auto segments = segments_of(::getpid());
  ASSERT_EQ(segments.size(), 1u);
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm/" + segments[0]).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_GE(segments[0].size(), std::string("wsync-1-").size() + 32);  // 128 random bits
  std::string json = manifest_to_json(*m);
  int status = in_child([&] { return consume_in_child(json, true); });
  ASSERT_TRUE(WIFSIGNALED(status)) << "write through a consumer mapping did not fault";
  EXPECT_EQ(WTERMSIG(status), SIGSEGV);
  ASSERT_TRUE(publisher_->on_failed(m->update_id, 1, "crashed"));
}

TEST_F(shared_memory_test, a_slot_is_reused_only_after_release) {
  make_publisher(1, std::chrono::milliseconds(200));
  auto m1 = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m1);
  auto m2 = publisher_->publish(sources_, 2, {0});
  ASSERT_FALSE(m2);
  EXPECT_EQ(m2.error().code, errc::timeout);
  EXPECT_NE(m2.error().message.find("no free slot"), std::string::npos);
  ASSERT_TRUE(publisher_->on_released(m1->update_id, 0));
  auto m3 = publisher_->publish(sources_, 3, {0});
  ASSERT_TRUE(m3) << m3.error().message;
  ASSERT_TRUE(publisher_->on_released(m3->update_id, 0));
}

TEST_F(shared_memory_test, two_slots_hold_two_versions) {
  make_publisher(2, std::chrono::milliseconds(200));
  auto m1 = publisher_->publish(sources_, 1, {0});
  auto m2 = publisher_->publish(sources_, 2, {0});
  ASSERT_TRUE(m1 && m2);
  EXPECT_EQ(segments_of(::getpid()).size(), 2u);
  EXPECT_FALSE(publisher_->publish(sources_, 3, {0}));
  ASSERT_TRUE(publisher_->on_released(m1->update_id, 0));
  ASSERT_TRUE(publisher_->on_released(m2->update_id, 0));
}

TEST_F(shared_memory_test, a_stale_handle_is_refused_after_the_slot_is_rewritten) {
  make_publisher(1);
  auto m1 = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m1);
  ASSERT_TRUE(publisher_->on_released(m1->update_id, 0));
  auto m2 = publisher_->publish(sources_, 2, {0});
  ASSERT_TRUE(m2);
  auto c = transport_->make_consumer();
  ASSERT_TRUE(c);
  weight_consumer consumer(std::move(*c), consumer_config{});
  auto stale = consumer.import_update(*m1);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().code, errc::unknown_update);
  EXPECT_NE(stale.error().message.find("no longer in shared memory"), std::string::npos);
  ASSERT_TRUE(consumer.import_update(*m2));
  ASSERT_TRUE(consumer.release(m2->update_id));
  ASSERT_TRUE(publisher_->on_released(m2->update_id, 0));
}

TEST_F(shared_memory_test, a_bigger_update_replaces_a_free_slot) {
  make_publisher(1);
  auto small = std::vector<tensor_source>{sources_[0]};
  auto m1 = publisher_->publish(small, 1, {0});
  ASSERT_TRUE(m1);
  auto c = transport_->make_consumer();
  ASSERT_TRUE(c);
  weight_consumer consumer(std::move(*c), consumer_config{});
  ASSERT_TRUE(consumer.import_update(*m1));
  ASSERT_TRUE(consumer.release(m1->update_id));
  ASSERT_TRUE(publisher_->on_released(m1->update_id, 0));
  std::vector<std::byte> big(8 << 20, std::byte{9});
  auto m2 = publisher_->publish(
      std::vector<tensor_source>{{"a", dtype::u8, {8 << 20}, {}, big.data(), big.size()}}, 2, {0});
  ASSERT_TRUE(m2);
  EXPECT_EQ(segments_of(::getpid()).size(), 1u);  // the small slot was unlinked
  ASSERT_TRUE(consumer.import_update(*m2));
  ASSERT_TRUE(consumer.verify(m2->update_id));
  ASSERT_TRUE(consumer.release(m2->update_id));
  ASSERT_TRUE(publisher_->on_released(m2->update_id, 0));
}

TEST_F(shared_memory_test, killed_consumer_leaks_nothing) {
  make_publisher(2);
  auto m = publisher_->publish(sources_, 1, {1});
  ASSERT_TRUE(m);
  std::string json = manifest_to_json(*m);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    auto parsed = manifest_from_json(json);
    auto t = make_transport("shared-memory");
    auto c = (*t)->make_consumer();
    weight_consumer consumer(std::move(*c), consumer_config{1, 1});
    char ok = consumer.import_update(*parsed) ? 'y' : 'n';
    (void)::write(ready[1], &ok, 1);
    ::pause();  // holds the import until killed
    ::_exit(0);
  }
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  EXPECT_EQ(ok, 'y');
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  ASSERT_TRUE(publisher_->on_failed(m->update_id, 1, "killed"));
  EXPECT_TRUE(publisher_->held_updates().empty());
  EXPECT_EQ(segments_of(pid), std::vector<std::string>{});  // consumers never create segments
  // TearDown checks the publisher's own segments are gone once it is destroyed.
}

TEST_F(shared_memory_test, orphans_of_a_dead_publisher_are_swept_and_live_ones_kept) {
  make_publisher(2);  // a live publisher of ours, with a segment
  auto m = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m);
  int ready[2], go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    auto t = make_transport("shared-memory");
    auto p = (*t)->make_publisher();
    publisher_config cfg;
    cfg.model_id = "orphan";
    auto* publisher = new weight_publisher(std::move(*p), "shared-memory", cfg);
    std::vector<std::byte> b(4096);
    std::vector<tensor_source> s{{"x", dtype::u8, {4096}, {}, b.data(), b.size()}};
    char ok = publisher->publish(s, 1, {0}) ? 'y' : 'n';
    (void)::write(ready[1], &ok, 1);
    (void)::read(go[0], &ok, 1);
    ::_exit(0);  // dies without destructors, like a crash
  }
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 'y');
  auto orphans = segments_of(pid);
  ASSERT_EQ(orphans.size(), 1u);
  EXPECT_TRUE(shm_sweep_orphans().empty());  // its owner is alive: kept
  ASSERT_EQ(segments_of(pid).size(), 1u);
  ASSERT_EQ(::write(go[1], &ok, 1), 1);
  int status = 0;
  ::waitpid(pid, &status, 0);
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);

  auto removed = shm_sweep_orphans();
  EXPECT_EQ(removed, orphans);
  EXPECT_EQ(segments_of(pid), std::vector<std::string>{});
  EXPECT_EQ(segments_of(::getpid()).size(), 1u);  // ours stays
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
}

}  // namespace
}  // namespace wsync
