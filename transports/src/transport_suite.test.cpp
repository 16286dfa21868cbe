// One suite, run on every transport: what WeightPublisher + WeightConsumer promise holds
// whichever data plane carries the bytes.

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "wsync/manifest/checksum.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_consumer.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

bool starts_with(const std::string& s, std::string_view prefix) {
  return s.rfind(prefix, 0) == 0;
}

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

// Entries this process left in /dev/shm.
std::vector<std::string> own_shm_entries() {
  std::vector<std::string> found;
  std::string prefix = "wsync-" + std::to_string(::getpid()) + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      if (starts_with(e->d_name, prefix)) found.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return found;
}

// Byte i of a tensor of n bytes in version v: differs between tensors, sizes and versions.
std::byte pattern(std::size_t i, std::size_t n, std::uint64_t v) {
  return std::byte((i * 31 + n + v * 101) & 0xff);
}

class transport_suite : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    transport_options options;
    if (std::string(GetParam()) == "file-mmap") {
      // The one transport that needs a place: a fresh directory per test, removed in TearDown.
      std::string tmpl = (std::filesystem::temp_directory_path() / "wsync-suite-XXXXXX").string();
      ASSERT_NE(::mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
      dir_ = tmpl;
      options["dir"] = dir_;
    }
    auto t = make_transport(GetParam(), options);
    ASSERT_TRUE(t) << t.error().message;
    transport_ = std::move(*t);
    publisher_config cfg;
    cfg.model_id = "suite";
    cfg.max_segment_bytes = 1 << 20;  // several segments
    cfg.slot_wait = std::chrono::milliseconds(200);
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p) << p.error().message;
    publisher_ = std::make_unique<weight_publisher>(std::move(*p), GetParam(), cfg);
    // Sizes: odd, small, larger than a segment, one more page.
    set_tensors({1001, 64, 3 << 20, 4096}, 1);
  }

  void TearDown() override {
    publisher_.reset();
    transport_.reset();
    EXPECT_EQ(own_shm_entries(), std::vector<std::string>{}) << "left in /dev/shm";
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void set_tensors(std::vector<std::size_t> sizes, std::uint64_t version) {
    bytes_.clear();
    sources_.clear();
    for (auto n : sizes) {
      std::vector<std::byte> b(n);
      for (std::size_t i = 0; i < n; ++i) b[i] = pattern(i, n, version);
      bytes_.push_back(std::move(b));
    }
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      sources_.push_back({"t" + std::to_string(i),
                          dtype::u8,
                          {static_cast<std::int64_t>(bytes_[i].size())},
                          {},
                          bytes_[i].data(),
                          bytes_[i].size()});
    }
  }

  std::unique_ptr<weight_consumer> make_consumer(std::int32_t rank = 0) {
    auto c = transport_->make_consumer();
    EXPECT_TRUE(c) << c.error().message;
    return std::make_unique<weight_consumer>(std::move(*c), consumer_config{rank, 1});
  }

  // Every imported tensor holds exactly the bytes that were published.
  void expect_same_bytes(const imported_update& u) {
    ASSERT_EQ(u.tensors.size(), bytes_.size());
    for (std::size_t i = 0; i < bytes_.size(); ++i) {
      ASSERT_NE(u.tensors[i].descriptor, nullptr);
      EXPECT_EQ(u.tensors[i].descriptor->name, sources_[i].name);
      EXPECT_EQ(u.tensors[i].descriptor->nbytes, bytes_[i].size());
      if (bytes_[i].empty()) continue;
      ASSERT_NE(u.tensors[i].data, nullptr);
      std::vector<std::byte> host;
      const std::byte* got = u.tensors[i].data;
      if (!u.memory.host()) {  // device memory: compared through a copy
        host.resize(bytes_[i].size());
        auto copied = gpu::copy_to_host(host.data(), got, host.size());
        ASSERT_TRUE(copied) << copied.error().message;
        got = host.data();
      }
      EXPECT_EQ(std::memcmp(got, bytes_[i].data(), bytes_[i].size()), 0) << "tensor " << i;
    }
  }

  std::string dir_;
  std::unique_ptr<transport> transport_;
  std::unique_ptr<weight_publisher> publisher_;
  std::vector<std::vector<std::byte>> bytes_;
  std::vector<tensor_source> sources_;
};

TEST_P(transport_suite, full_lifecycle_delivers_every_byte) {
  auto m = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_GT(m->segments.size(), 1u);
  EXPECT_EQ(m->transport, GetParam());
  EXPECT_EQ(m->weight_version, 1u);
  EXPECT_EQ(m->model_id, "suite");
  EXPECT_EQ(publisher_->last_version(), 1u);
  EXPECT_EQ(publisher_->held_updates(), std::vector<update_id>{m->update_id});
  auto consumer = make_consumer();
  auto u = consumer->import_update(*m);
  ASSERT_TRUE(u) << u.error().message;
  EXPECT_EQ((*u)->manifest, *m);
  ASSERT_EQ((*u)->segments.size(), m->segments.size());
  for (std::size_t s = 0; s < m->segments.size(); ++s) {
    EXPECT_EQ((*u)->segments[s].size(), m->segments[s].nbytes);
  }
  expect_same_bytes(**u);
  EXPECT_EQ(*consumer->state(m->update_id), update_state::imported);
  ASSERT_TRUE(consumer->verify(m->update_id));
  ASSERT_TRUE(consumer->mark_installed(m->update_id));
  ASSERT_TRUE(consumer->acknowledge(m->update_id));
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
  EXPECT_FALSE(publisher_->held_updates().empty());  // acknowledged is not released
  ASSERT_TRUE(consumer->release(m->update_id));
  EXPECT_EQ(*consumer->state(m->update_id), update_state::released);
  EXPECT_FALSE(publisher_->held_updates().empty());  // the publisher has not heard yet
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_TRUE(publisher_->held_updates().empty());
  auto status = publisher_->status(m->update_id);
  ASSERT_TRUE(status);
  EXPECT_TRUE(status->memory_released);
  EXPECT_TRUE(status->consumers.at(0).acknowledged);
  EXPECT_EQ(status->consumers.at(0).outcome, consumer_outcome::released);
}

TEST_P(transport_suite, successive_versions_deliver_their_own_bytes) {
  // Memory is pooled and reused: a later version must never show an earlier one's bytes.
  auto consumer = make_consumer();
  for (std::uint64_t v = 1; v <= 5; ++v) {
    set_tensors({1001, 0, 3 << 20, 257}, v);
    auto m = publisher_->publish(sources_, v, {0});
    ASSERT_TRUE(m) << "version " << v << ": " << m.error().message;
    auto u = consumer->import_update(*m);
    ASSERT_TRUE(u) << "version " << v << ": " << u.error().message;
    expect_same_bytes(**u);
    ASSERT_TRUE(consumer->verify(m->update_id)) << "version " << v;
    ASSERT_TRUE(consumer->mark_installed(m->update_id));
    ASSERT_TRUE(consumer->acknowledge(m->update_id));
    ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
    ASSERT_TRUE(consumer->release(m->update_id));
    ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
    EXPECT_TRUE(publisher_->held_updates().empty()) << "version " << v;
  }
}

TEST_P(transport_suite, versions_must_grow_on_both_sides) {
  auto m = publisher_->publish(sources_, 5, {0});
  ASSERT_TRUE(m) << m.error().message;
  for (std::uint64_t v : {5u, 4u, 0u}) {
    auto again = publisher_->publish(sources_, v, {0});
    ASSERT_FALSE(again) << "version " << v;
    EXPECT_EQ(again.error().code, errc::version_not_monotonic);
    EXPECT_TRUE(starts_with(again.error().message, "weight_version must increase monotonically"))
        << again.error().message;
  }
  EXPECT_EQ(publisher_->held_updates().size(), 1u);  // refused publishes hold nothing
  EXPECT_EQ(publisher_->last_version(), 5u);
  auto consumer = make_consumer();
  // An import that fails holds nothing: the same version imports afterwards.
  auto broken = *m;
  broken.transport_handle = "not a handle";
  ASSERT_FALSE(consumer->import_update(broken));
  ASSERT_TRUE(consumer->import_update(*m));
  auto older = *m;
  older.update_id = update_id_generate();
  older.weight_version = 4;
  auto r = consumer->import_update(older);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::version_not_monotonic);
  EXPECT_TRUE(starts_with(r.error().message, "weight_version must increase monotonically"))
      << r.error().message;
  EXPECT_TRUE(contains(r.error().message, older.update_id)) << r.error().message;
  EXPECT_TRUE(contains(r.error().message, "rank=0")) << r.error().message;
  // The same version again from the same source rank is refused too.
  auto same = *m;
  same.update_id = update_id_generate();
  auto s = consumer->import_update(same);
  ASSERT_FALSE(s);
  EXPECT_TRUE(starts_with(s.error().message, "weight_version must increase monotonically"));
  ASSERT_TRUE(consumer->release(m->update_id));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
}

// "Monotonic" is strictly above the active version: a version that was rejected may come
// again with a new update id (the trainer retries its step); an old one may not.
TEST_P(transport_suite, a_rejected_version_is_retried_and_an_old_one_refused) {
  auto consumer = make_consumer();
  auto live = [&](const weight_update_manifest& m) {
    auto u = consumer->import_update(m);
    EXPECT_TRUE(u) << u.error().message;
    if (!u) return;
    expect_same_bytes(**u);
    EXPECT_TRUE(consumer->verify(m.update_id));
    EXPECT_TRUE(consumer->mark_installed(m.update_id));
    EXPECT_TRUE(consumer->acknowledge(m.update_id));
  };
  set_tensors({1001, 0, 3 << 20, 257}, 2);
  auto v2 = publisher_->publish(sources_, 2, {0});
  ASSERT_TRUE(v2) << v2.error().message;
  live(*v2);
  set_tensors({1001, 0, 3 << 20, 257}, 3);
  auto v3 = publisher_->publish(sources_, 3, {0});
  ASSERT_TRUE(v3) << v3.error().message;
  ASSERT_TRUE(consumer->import_update(*v3));
  ASSERT_TRUE(consumer->reject(v3->update_id, "install failed"));
  // While the failed publication is held, the publisher refuses the version again, saying why.
  auto early = publisher_->publish(sources_, 3, {0});
  ASSERT_FALSE(early);
  EXPECT_EQ(early.error().code, errc::version_not_monotonic);
  EXPECT_TRUE(contains(early.error().message, "is still held (release it to publish version 3"))
      << early.error().message;
  ASSERT_TRUE(consumer->release(v3->update_id));
  ASSERT_TRUE(publisher_->release(v3->update_id));
  std::vector<update_id> held = {v2->update_id};
  if (std::string(GetParam()) == "file-mmap") {
    // Two buffers: v2's (held by the reader) and the one CURRENT names, which the writer never
    // touches (a crash falls back to it). The retry needs v2's buffer back, or buffers=3.
    ASSERT_TRUE(consumer->release(v2->update_id));
    ASSERT_TRUE(publisher_->release(v2->update_id));
    held.clear();
  }
  auto retry = publisher_->publish(sources_, 3, {0});
  ASSERT_TRUE(retry) << retry.error().message;
  EXPECT_NE(retry->update_id, v3->update_id);
  live(*retry);
  // Now 3 is active: 3 again and 2 are old, whatever their update ids.
  for (std::uint64_t v : {3u, 2u}) {
    auto old = *retry;
    old.update_id = update_id_generate();
    old.weight_version = v;
    auto r = consumer->import_update(old);
    ASSERT_FALSE(r) << "version " << v;
    EXPECT_EQ(r.error().code, errc::version_not_monotonic);
    EXPECT_TRUE(contains(r.error().message,
                         "weight_version must increase monotonically: "
                         "weight_version " +
                             std::to_string(v) + " from source_rank 0 is not above the active 3"))
        << r.error().message;
  }
  held.push_back(retry->update_id);
  for (const auto& id : held) {
    ASSERT_TRUE(consumer->release(id));
    ASSERT_TRUE(publisher_->release(id));
  }
}

TEST_P(transport_suite, wrong_checksum_is_a_mismatch_naming_the_tensor) {
  auto m = publisher_->publish(sources_, 1, {7});
  ASSERT_TRUE(m) << m.error().message;
  auto bad = *m;  // the consumer's copy; the publisher's stays intact
  bad.tensors[2].checksum ^= 1;
  auto consumer = make_consumer(7);
  ASSERT_TRUE(consumer->import_update(bad));
  auto v = consumer->verify(bad.update_id);
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error().code, errc::checksum_mismatch);
  EXPECT_TRUE(starts_with(v.error().message, "tensor checksum mismatch")) << v.error().message;
  EXPECT_TRUE(contains(v.error().message, "\"t2\"")) << v.error().message;
  EXPECT_TRUE(contains(v.error().message, m->update_id)) << v.error().message;
  EXPECT_TRUE(contains(v.error().message, "rank=7")) << v.error().message;
  EXPECT_FALSE(contains(v.error().message, "\"t0\"")) << v.error().message;
  EXPECT_EQ(*consumer->state(bad.update_id), update_state::imported);  // not verified
  auto install = consumer->mark_installed(bad.update_id);  // a failed verify blocks install
  ASSERT_FALSE(install);
  EXPECT_TRUE(contains(install.error().message, "after tensor checksum mismatch"))
      << install.error().message;
  EXPECT_FALSE(consumer->acknowledge(bad.update_id));
  ASSERT_TRUE(consumer->reject(bad.update_id, v.error().message));
  ASSERT_TRUE(consumer->release(bad.update_id));
  ASSERT_TRUE(publisher_->on_rejected(m->update_id, 7, v.error().message));
  EXPECT_FALSE(publisher_->held_updates().empty());  // rejected still holds the memory
  ASSERT_TRUE(publisher_->on_released(m->update_id, 7));
  EXPECT_TRUE(publisher_->held_updates().empty());
  auto status = publisher_->status(m->update_id);
  ASSERT_TRUE(status);
  EXPECT_FALSE(status->consumers.at(7).acknowledged);
  EXPECT_TRUE(starts_with(status->consumers.at(7).reason, "tensor checksum mismatch"));
}

// The chunked checksum: one large tensor verified on several threads, chunk by chunk; a
// manifest whose digests were made another way is a mismatch naming the tensor.
TEST_P(transport_suite, chunked_checksums_verify_on_threads_and_catch_a_wrong_digest) {
  publisher_config cfg;
  cfg.model_id = "suite";
  cfg.slot_wait = std::chrono::milliseconds(200);
  cfg.checksum = {checksum_algorithm::xxh3_64_chunked, 64 << 10};
  publisher_.reset();  // one publisher per transport at a time (file-mmap's dir)
  auto p = transport_->make_publisher();
  ASSERT_TRUE(p) << p.error().message;
  publisher_ = std::make_unique<weight_publisher>(std::move(*p), GetParam(), cfg);
  set_tensors({1001, (20 << 20) + 5, 64}, 1);  // over the parallel-verify threshold
  auto m = publisher_->publish(sources_, 1, {7, 8});
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->checksum_method, cfg.checksum);
  for (std::size_t i = 0; i < sources_.size(); ++i) {
    EXPECT_EQ(m->tensors[i].checksum,
              checksum_compute(bytes_[i].data(), bytes_[i].size(), cfg.checksum));
  }
  weight_consumer good(*transport_->make_consumer(), consumer_config{7, 3});
  auto u = good.import_update(*m);
  ASSERT_TRUE(u) << u.error().message;
  expect_same_bytes(**u);
  auto v = good.verify(m->update_id);
  EXPECT_TRUE(v) << v.error().message;
  ASSERT_TRUE(good.release(m->update_id));

  auto whole = *m;  // the same bytes, digests of whole tensors: not what "chunked" means
  for (std::size_t i = 0; i < sources_.size(); ++i) {
    whole.tensors[i].checksum = checksum_compute(bytes_[i].data(), bytes_[i].size());
  }
  weight_consumer other(*transport_->make_consumer(), consumer_config{8, 3});
  ASSERT_TRUE(other.import_update(whole));
  auto mismatch = other.verify(whole.update_id);
  ASSERT_FALSE(mismatch);
  EXPECT_EQ(mismatch.error().code, errc::checksum_mismatch);
  EXPECT_TRUE(contains(mismatch.error().message, "\"t0\"")) << mismatch.error().message;
  ASSERT_TRUE(other.reject(whole.update_id, mismatch.error().message));
  ASSERT_TRUE(other.release(whole.update_id));
}

TEST_P(transport_suite, out_of_order_calls_are_refused) {
  auto consumer = make_consumer();
  auto ack = consumer->acknowledge("u-never-imported");
  ASSERT_FALSE(ack);
  EXPECT_EQ(ack.error().code, errc::illegal_transition);
  EXPECT_TRUE(
      starts_with(ack.error().message, "cannot acknowledge update before import_update succeeds"))
      << ack.error().message;
  auto rel = consumer->release("u-never-imported");
  ASSERT_FALSE(rel);
  EXPECT_EQ(rel.error().code, errc::unknown_update);
  EXPECT_TRUE(starts_with(rel.error().message, "unknown update_id")) << rel.error().message;
  EXPECT_TRUE(contains(rel.error().message, "u-never-imported")) << rel.error().message;
  auto m = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m) << m.error().message;
  // Acknowledging a published but not yet imported update is the same refusal.
  auto before = consumer->acknowledge(m->update_id);
  ASSERT_FALSE(before);
  EXPECT_TRUE(starts_with(before.error().message,
                          "cannot acknowledge update before import_update succeeds"))
      << before.error().message;
  ASSERT_TRUE(consumer->import_update(*m));
  auto early = consumer->acknowledge(m->update_id);
  ASSERT_FALSE(early);
  EXPECT_TRUE(starts_with(early.error().message, "cannot acknowledge update before install"))
      << early.error().message;
  auto twice = consumer->import_update(*m);
  EXPECT_FALSE(twice);
  ASSERT_TRUE(consumer->release(m->update_id));
  auto after = consumer->acknowledge(m->update_id);
  ASSERT_FALSE(after);
  EXPECT_TRUE(starts_with(after.error().message, "cannot acknowledge update after release"))
      << after.error().message;
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_FALSE(publisher_->on_released(m->update_id, 0));  // twice
}

TEST_P(transport_suite, the_publisher_refuses_unknown_ids_and_ranks) {
  for (auto r : {publisher_->on_acknowledged("u-nope", 0), publisher_->on_released("u-nope", 0),
                 publisher_->on_failed("u-nope", 0, "x"), publisher_->release("u-nope")}) {
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, errc::unknown_update);
    EXPECT_TRUE(starts_with(r.error().message, "unknown update_id")) << r.error().message;
    EXPECT_TRUE(contains(r.error().message, "u-nope")) << r.error().message;
  }
  EXPECT_FALSE(publisher_->status("u-nope"));
  auto m = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m) << m.error().message;
  auto stranger = publisher_->on_released(m->update_id, 3);
  ASSERT_FALSE(stranger);
  EXPECT_TRUE(contains(stranger.error().message, "rank 3")) << stranger.error().message;
  EXPECT_FALSE(publisher_->held_updates().empty());
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_TRUE(publisher_->held_updates().empty());
}

TEST_P(transport_suite, memory_waits_for_both_of_two_consumers) {
  auto m = publisher_->publish(sources_, 1, {0, 1});
  ASSERT_TRUE(m) << m.error().message;
  auto c0 = make_consumer(0);
  auto c1 = make_consumer(1);
  auto u0 = c0->import_update(*m);
  auto u1 = c1->import_update(*m);
  ASSERT_TRUE(u0 && u1);
  for (auto* c : {c0.get(), c1.get()}) {
    ASSERT_TRUE(c->verify(m->update_id));
    ASSERT_TRUE(c->mark_installed(m->update_id));
    ASSERT_TRUE(c->acknowledge(m->update_id));
  }
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
  auto again = publisher_->on_acknowledged(m->update_id, 0);  // same rank twice: refused
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, errc::illegal_transition);
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 1));
  ASSERT_TRUE(c0->release(m->update_id));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_EQ(publisher_->held_updates(), std::vector<update_id>{m->update_id});
  // The second consumer still sees every byte after the first let go.
  expect_same_bytes(**u1);
  ASSERT_TRUE(c1->release(m->update_id));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 1));
  EXPECT_TRUE(publisher_->held_updates().empty());
}

TEST_P(transport_suite, a_failed_consumer_counts_as_released) {
  auto m = publisher_->publish(sources_, 1, {0, 1});
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_TRUE(publisher_->on_failed(m->update_id, 1, "killed"));
  EXPECT_FALSE(publisher_->held_updates().empty());
  EXPECT_FALSE(publisher_->on_failed(m->update_id, 1, "again"));
  EXPECT_FALSE(publisher_->on_released(m->update_id, 1));  // failed is final
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_TRUE(publisher_->held_updates().empty());
  auto status = publisher_->status(m->update_id);
  ASSERT_TRUE(status);
  EXPECT_EQ(status->consumers.at(1).outcome, consumer_outcome::failed);
  EXPECT_EQ(status->consumers.at(1).reason, "killed");

  // Every consumer failing releases too.
  auto m2 = publisher_->publish(sources_, 2, {0, 1});
  ASSERT_TRUE(m2) << m2.error().message;
  ASSERT_TRUE(publisher_->on_failed(m2->update_id, 0, "gone"));
  EXPECT_FALSE(publisher_->held_updates().empty());
  ASSERT_TRUE(publisher_->on_failed(m2->update_id, 1, "gone"));
  EXPECT_TRUE(publisher_->held_updates().empty());
}

TEST_P(transport_suite, memory_is_released_when_every_consumer_is_done) {
  auto m = publisher_->publish(sources_, 1, {0, 1, 2});
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
  EXPECT_FALSE(publisher_->on_acknowledged(m->update_id, 9));  // not expected
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_EQ(publisher_->held_updates().size(), 1u);
  ASSERT_TRUE(publisher_->on_failed(m->update_id, 1, "killed"));  // a dead consumer counts
  EXPECT_EQ(publisher_->held_updates().size(), 1u);
  ASSERT_TRUE(publisher_->on_rejected(m->update_id, 2, "bad"));
  EXPECT_FALSE(publisher_->on_acknowledged(m->update_id, 2));  // one answer per rank
  ASSERT_TRUE(publisher_->on_released(m->update_id, 2));
  EXPECT_TRUE(publisher_->held_updates().empty());
  auto status = publisher_->status(m->update_id);
  ASSERT_TRUE(status);
  EXPECT_EQ(status->consumers.at(1).outcome, consumer_outcome::failed);
  EXPECT_EQ(status->consumers.at(1).reason, "killed");
  EXPECT_EQ(status->consumers.at(2).reason, "bad");
}

TEST_P(transport_suite, inconsistent_tensor_is_refused_before_any_memory_is_taken) {
  auto bad = sources_;
  bad[1].nbytes += 1;  // shape says 64 bytes
  auto m = publisher_->publish(bad, 1, {0});
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error().code, errc::invalid_manifest);
  EXPECT_TRUE(starts_with(m.error().message, "invalid manifest: tensors[1].nbytes:"))
      << m.error().message;
  EXPECT_TRUE(publisher_->held_updates().empty());
  EXPECT_EQ(own_shm_entries(), std::vector<std::string>{});  // not even a slot was made
  auto dup = sources_;
  dup[3].name = dup[0].name;
  auto d = publisher_->publish(dup, 1, {0});
  ASSERT_FALSE(d);
  EXPECT_TRUE(starts_with(d.error().message, "invalid manifest: tensors[3].name:"))
      << d.error().message;
  auto null_data = sources_;
  null_data[0].data = nullptr;
  auto n = publisher_->publish(null_data, 1, {0});
  ASSERT_FALSE(n);
  EXPECT_EQ(n.error().code, errc::invalid_argument);
  EXPECT_TRUE(contains(n.error().message, "tensors[0].data")) << n.error().message;
  EXPECT_FALSE(publisher_->publish(sources_, 1, {0, 0}));                   // duplicate rank
  EXPECT_FALSE(publisher_->publish(std::vector<tensor_source>{}, 1, {0}));  // nothing to publish
  EXPECT_TRUE(publisher_->held_updates().empty());
  // A refused publish does not consume the version.
  EXPECT_EQ(publisher_->last_version(), 0u);
  EXPECT_TRUE(publisher_->publish(sources_, 1, {}));
  EXPECT_TRUE(publisher_->held_updates().empty());  // no consumer expected: released at once
}

// Every transport compiled in that this machine can run: ucx where built, the GPU transports
// where a device is (their own tests say why not where not).
std::vector<const char*> suite_transports() {
  std::vector<const char*> names = {"local-clone", "shared-memory", "file-mmap"};
  if (transport_known("ucx")) names.push_back("ucx");
  for (const char* gpu : {"cuda-ipc", "cuda-vmm"}) {
    if (make_transport(gpu)) names.push_back(gpu);
  }
  return names;
}

INSTANTIATE_TEST_SUITE_P(all, transport_suite, ::testing::ValuesIn(suite_transports()),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace wsync
