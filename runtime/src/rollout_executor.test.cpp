#include "wsync/runtime/rollout_executor.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <new>
#include <utility>

#include "pattern_tensors.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

// A consumer transport that flips one byte of every import: a faulty link or bad memory.
class corrupting_transport final : public consumer_transport {
 public:
  corrupting_transport(std::unique_ptr<consumer_transport> inner, std::uint64_t byte)
      : inner_(std::move(inner)), byte_(byte) {}
  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    auto spans = inner_->import_segments(m);
    if (!spans) return spans;
    copies_.clear();
    std::vector<std::span<const std::byte>> out;
    for (auto s : *spans) {
      copies_.emplace_back(s.begin(), s.end());
      out.emplace_back(copies_.back().data(), copies_.back().size());
    }
    copies_.front()[byte_] ^= std::byte{1};
    return out;
  }
  void release(const update_id& id) override { inner_->release(id); }

 private:
  std::unique_ptr<consumer_transport> inner_;
  std::uint64_t byte_;
  std::vector<std::vector<std::byte>> copies_;
};

// A consumer transport whose first import throws (out of memory, say), then imports as usual.
class throwing_once_transport final : public consumer_transport {
 public:
  explicit throwing_once_transport(std::unique_ptr<consumer_transport> inner)
      : inner_(std::move(inner)) {}
  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    if (std::exchange(throw_, false)) throw std::bad_alloc();
    return inner_->import_segments(m);
  }
  void release(const update_id& id) override { inner_->release(id); }

 private:
  std::unique_ptr<consumer_transport> inner_;
  bool throw_ = true;
};

// An adapter whose stage() fails on demand, wrapping the reference runtime.
class flaky_adapter final : public install_adapter {
 public:
  explicit flaky_adapter(reference_runtime& rt) : rt_(rt) {}
  result<void> stage(std::span<const imported_update* const> shards) override {
    if (throw_) throw std::bad_alloc();
    if (fail_) return make_error(errc::install_failed, "install failed: injected");
    return rt_.stage(shards);
  }
  void activate(const update_id& id) noexcept override { rt_.activate(id); }
  void discard(const update_id& id) noexcept override { rt_.discard(id); }
  bool references_import() const override { return rt_.references_import(); }
  bool deactivate() noexcept override { return rt_.deactivate(); }
  bool fail_ = false;
  bool throw_ = false;

 private:
  reference_runtime& rt_;
};

class executor_test : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = make_transport("local-clone");
    ASSERT_TRUE(t);
    transport_ = std::move(*t);
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p);
    publisher_config cfg;
    cfg.model_id = "m";
    publisher_ = std::make_unique<weight_publisher>(std::move(*p), "local-clone", cfg);
  }

  weight_consumer make_consumer(std::unique_ptr<consumer_transport> wrap = nullptr) {
    auto c = transport_->make_consumer();
    EXPECT_TRUE(c);
    return weight_consumer(wrap ? std::move(wrap) : std::move(*c), consumer_config{0, 1});
  }

  weight_update_manifest publish(std::uint64_t version) {
    auto m = publisher_->publish(tensors_.fill(version), version, {0});
    EXPECT_TRUE(m) << m.error().message;
    return *m;
  }

  // Passes the consumer's answers back to the publisher, as the control plane would.
  void report(const rollout_report& r) {
    if (r.acknowledged) {
      EXPECT_TRUE(publisher_->on_acknowledged(r.id, 0));
    } else {
      ASSERT_TRUE(r.failure) << "a report neither acknowledged nor failed";
      EXPECT_TRUE(publisher_->on_rejected(r.id, 0, r.failure->message));
    }
    for (const auto& id : r.released) EXPECT_TRUE(publisher_->on_released(id, 0));
    if (r.released_self) {
      for (const auto& id : r.shard_ids) EXPECT_TRUE(publisher_->on_released(id, 0));
    }
  }

  static std::size_t torn(reference_runtime& rt) {
    return rt.generate([](const runtime_weights& w) {
      std::size_t bad = 0;
      for (std::size_t i = 0; i < w.tensors.size(); ++i) {
        bad +=
            test::pattern_mismatches(w.tensors[i].data, w.tensors[i].nbytes, w.weight_version, i);
      }
      return bad;
    });
  }

  std::unique_ptr<transport> transport_;
  std::unique_ptr<weight_publisher> publisher_;
  test::pattern_tensors tensors_{4, 512};
};

TEST_F(executor_test, installs_acknowledges_and_releases_the_previous_update) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto m1 = publish(1);
  auto r1 = ex.update_weights(m1);
  ASSERT_TRUE(r1.acknowledged) << r1.failure->message;
  report(r1);
  EXPECT_EQ(ex.active_weight_version(), 1u);
  EXPECT_EQ(rt.active_version(), 1u);
  EXPECT_EQ(torn(rt), 0u);
  EXPECT_EQ(*consumer.state(m1.update_id), update_state::acknowledged);  // held: view mode

  auto m2 = publish(2);
  auto r2 = ex.update_weights(m2);
  ASSERT_TRUE(r2.acknowledged);
  EXPECT_EQ(r2.released, std::vector<update_id>{m1.update_id});
  report(r2);
  EXPECT_EQ(*consumer.state(m1.update_id), update_state::released);
  EXPECT_EQ(rt.active_version(), 2u);
  EXPECT_EQ(torn(rt), 0u);
  EXPECT_EQ(publisher_->held_updates(), std::vector<update_id>{m2.update_id});
  EXPECT_EQ(ex.release_active(), std::vector<update_id>{m2.update_id});
  EXPECT_TRUE(publisher_->on_released(m2.update_id, 0));
  EXPECT_TRUE(publisher_->held_updates().empty());
}

// An import that throws gives its hold on the version back: the same update may come again.
TEST_F(executor_test, an_import_that_throws_can_be_retried) {
  auto inner = transport_->make_consumer();
  ASSERT_TRUE(inner);
  auto consumer = make_consumer(std::make_unique<throwing_once_transport>(std::move(*inner)));
  auto m1 = publish(1);
  EXPECT_THROW((void)consumer.import_update(m1), std::bad_alloc);
  auto again = consumer.import_update(m1);
  ASSERT_TRUE(again) << again.error().message;
  EXPECT_TRUE(consumer.release(m1.update_id));
}

// Through the executor: an import that throws is a rejection of nothing imported (no reject or
// release is sent for it), and the same update installs when it comes again.
TEST_F(executor_test, an_update_whose_import_throws_is_rejected_and_installs_when_retried) {
  auto inner = transport_->make_consumer();
  ASSERT_TRUE(inner);
  auto consumer = make_consumer(std::make_unique<throwing_once_transport>(std::move(*inner)));
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto m1 = publish(publisher_->last_version() + 1);
  auto r1 = ex.update_weights(m1);
  EXPECT_FALSE(r1.acknowledged);
  ASSERT_TRUE(r1.failure);
  EXPECT_FALSE(r1.released_self);  // it held nothing of it
  auto r2 = ex.update_weights(m1);
  ASSERT_TRUE(r2.acknowledged) << r2.failure->message;
  report(r2);
  (void)ex.release_active();
  EXPECT_TRUE(publisher_->on_released(m1.update_id, 0));
}

// Releasing the active imports at shutdown waits for the generation steps still reading them
// (in view mode they are the weights those steps read).
TEST_F(executor_test, release_active_waits_for_the_generations_in_flight) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto m1 = publish(1);
  ASSERT_TRUE(ex.update_weights(m1).acknowledged);
  rt.gate().lock_shared();  // a step in flight
  auto released = std::async(std::launch::async, [&] { return ex.release_active(); });
  EXPECT_EQ(released.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "released the weights a step still reads";
  EXPECT_EQ(*consumer.state(m1.update_id), update_state::acknowledged);
  rt.gate().unlock_shared();
  EXPECT_EQ(released.get(), std::vector<update_id>{m1.update_id});
  EXPECT_EQ(*consumer.state(m1.update_id), update_state::released);
}

// After the imports are released (shutdown), a reader in view mode finds no weights, not views
// of memory given back; in copy mode the runtime's own copy stays readable.
TEST_F(executor_test, release_active_leaves_no_view_of_released_memory) {
  for (auto mode : {reference_runtime::install_mode::view, reference_runtime::install_mode::copy}) {
    const bool view = mode == reference_runtime::install_mode::view;
    SCOPED_TRACE(view ? "view" : "copy");
    auto consumer = make_consumer();
    reference_runtime rt(mode);
    rollout_executor ex(consumer, rt, rt.gate());
    const std::uint64_t v = publisher_->last_version() + 1;
    auto r = ex.update_weights(publish(v));
    ASSERT_TRUE(r.acknowledged);
    report(r);
    (void)ex.release_active();
    if (view) {
      EXPECT_EQ(rt.active_version(), 0u);
      EXPECT_EQ(rt.generate([](const runtime_weights& w) { return w.tensors.size(); }), 0u);
      EXPECT_FALSE(ex.active_weight_version());
      EXPECT_TRUE(publisher_->on_released(r.id, 0));
      // The model's architecture stays: the next version is checked against it and installs.
      auto again = ex.update_weights(publish(v + 1));
      ASSERT_TRUE(again.acknowledged) << again.failure->message;
      report(again);
      EXPECT_EQ(rt.active_version(), v + 1);
      EXPECT_EQ(torn(rt), 0u);
      (void)ex.release_active();
      EXPECT_TRUE(publisher_->on_released(again.id, 0));
    } else {
      EXPECT_EQ(rt.active_version(), v);
      EXPECT_EQ(torn(rt), 0u);
      EXPECT_EQ(ex.active_weight_version(), v);
    }
  }
}

// An install that fails (an error, or an exception out of the adapter: out of memory, say) is a
// reject: the shards go back, the previous version stays, the next version installs.
TEST_F(executor_test, failed_install_keeps_the_previous_version) {
  for (bool throws : {false, true}) {
    SCOPED_TRACE(throws ? "the adapter throws" : "the adapter returns an error");
    auto consumer = make_consumer();
    reference_runtime rt;
    flaky_adapter adapter(rt);
    rollout_executor ex(consumer, adapter, rt.gate());
    const std::uint64_t v = publisher_->last_version() + 1;
    report(ex.update_weights(publish(v)));
    (throws ? adapter.throw_ : adapter.fail_) = true;
    auto m2 = publish(v + 1);
    auto r2 = ex.update_weights(m2);  // must not throw
    EXPECT_FALSE(r2.acknowledged);
    ASSERT_TRUE(r2.failure);
    EXPECT_EQ(r2.failure->code, errc::install_failed);
    // Either way the message names the update and the rank.
    EXPECT_NE(r2.failure->message.find(m2.update_id), std::string::npos) << r2.failure->message;
    if (!throws) {
      EXPECT_NE(r2.failure->message.find("at consumer rank 0"), std::string::npos)
          << r2.failure->message;
    }
    EXPECT_TRUE(r2.released_self);
    EXPECT_TRUE(r2.released.empty());  // the previous update is still held for the readers
    report(r2);
    EXPECT_EQ(*consumer.state(m2.update_id), update_state::released);
    EXPECT_EQ(ex.active_weight_version(), v);
    EXPECT_EQ(rt.active_version(), v);
    EXPECT_EQ(torn(rt), 0u);
    adapter.throw_ = adapter.fail_ = false;
    auto r3 = ex.update_weights(publish(v + 2));  // recovers with the next version
    EXPECT_TRUE(r3.acknowledged);
    EXPECT_EQ(rt.active_version(), v + 2);
    report(r3);
    EXPECT_EQ(ex.release_active(), std::vector<update_id>{r3.id});
    EXPECT_TRUE(publisher_->on_released(r3.id, 0));
  }
}

TEST_F(executor_test, corrupted_byte_is_a_checksum_mismatch_and_a_reject) {
  auto inner = transport_->make_consumer();
  ASSERT_TRUE(inner);
  weight_consumer consumer(std::make_unique<corrupting_transport>(std::move(*inner), 5000),
                           consumer_config{3, 1});
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto m = publish(1);
  auto r = ex.update_weights(m);
  EXPECT_FALSE(r.acknowledged);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->code, errc::checksum_mismatch);
  EXPECT_EQ(r.failure->message.rfind("tensor checksum mismatch", 0), 0u) << r.failure->message;
  EXPECT_NE(r.failure->message.find("model.layers.1.weight"), std::string::npos);  // byte 5000
  EXPECT_NE(r.failure->message.find("update_id=" + m.update_id), std::string::npos);
  EXPECT_NE(r.failure->message.find("rank=3"), std::string::npos);
  EXPECT_FALSE(ex.active_weight_version());
  EXPECT_EQ(rt.active_version(), 0u);
  EXPECT_EQ(*consumer.state(m.update_id), update_state::released);
}

TEST_F(executor_test, verify_off_installs_without_recomputing_checksums) {
  auto inner = transport_->make_consumer();
  ASSERT_TRUE(inner);
  weight_consumer consumer(std::make_unique<corrupting_transport>(std::move(*inner), 0),
                           consumer_config{});
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate(), executor_config{false});
  auto r = ex.update_weights(publish(1));
  EXPECT_TRUE(r.acknowledged);
  EXPECT_EQ(r.timings.verify, 0.0);
}

TEST_F(executor_test, older_version_is_rejected_and_previous_stays) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto m5 = publish(5);
  auto stale = m5;
  stale.update_id = update_id_generate();
  stale.weight_version = 4;
  report(ex.update_weights(m5));
  auto r = ex.update_weights(stale);
  EXPECT_FALSE(r.acknowledged);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("weight_version must increase monotonically", 0), 0u);
  EXPECT_EQ(rt.active_version(), 5u);
}

TEST_F(executor_test, changed_architecture_is_refused_by_the_runtime) {
  auto consumer = make_consumer();
  reference_runtime rt(reference_runtime::install_mode::copy);
  rollout_executor ex(consumer, rt, rt.gate());
  report(ex.update_weights(publish(1)));
  test::pattern_tensors other(5, 512);  // one tensor more than the model has
  auto m = publisher_->publish(other.fill(2), 2, {0});
  ASSERT_TRUE(m);
  auto r = ex.update_weights(*m);
  EXPECT_FALSE(r.acknowledged);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->code, errc::install_failed);
  EXPECT_NE(r.failure->message.find("tensors:"), std::string::npos) << r.failure->message;
  EXPECT_EQ(rt.active_version(), 1u);
  EXPECT_EQ(torn(rt), 0u);
}

TEST_F(executor_test, copy_mode_releases_the_import_at_once) {
  auto consumer = make_consumer();
  reference_runtime rt(reference_runtime::install_mode::copy);
  rollout_executor ex(consumer, rt, rt.gate());
  auto m = publish(1);
  auto r = ex.update_weights(m);
  ASSERT_TRUE(r.acknowledged);
  EXPECT_TRUE(r.released_self);
  report(r);
  EXPECT_TRUE(publisher_->held_updates().empty());
  EXPECT_EQ(torn(rt), 0u);  // the runtime's own copy stays readable
}

// Two trainer ranks each publish half of the model; the consumer installs both halves as one
// version, or neither.
class sharded_test : public executor_test {
 protected:
  void SetUp() override {
    executor_test::SetUp();
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p);
    publisher_config cfg;
    cfg.model_id = "m";
    cfg.source_rank = 1;
    second_ = std::make_unique<weight_publisher>(std::move(*p), "local-clone", cfg);
  }

  std::vector<weight_update_manifest> publish_shards(std::uint64_t version) {
    const auto& all = tensors_.fill(version);
    std::vector<tensor_source> low(all.begin(), all.begin() + 2), high(all.begin() + 2, all.end());
    auto a = publisher_->publish(low, version, {0});
    auto b = second_->publish(high, version, {0});
    EXPECT_TRUE(a && b);
    return {*a, *b};
  }

  std::unique_ptr<weight_publisher> second_;
};

TEST_F(sharded_test, shards_of_one_version_switch_together) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto v1 = publish_shards(1);
  auto r1 = ex.update_weights(v1);
  ASSERT_TRUE(r1.acknowledged) << r1.failure->message;
  EXPECT_EQ(r1.shard_ids.size(), 2u);
  EXPECT_EQ(rt.generate([](const runtime_weights& w) { return w.tensors.size(); }), 4u);
  EXPECT_EQ(torn(rt), 0u);
  auto v2 = publish_shards(2);
  auto r2 = ex.update_weights(v2);
  ASSERT_TRUE(r2.acknowledged);
  EXPECT_EQ(r2.released, (std::vector<update_id>{v1[0].update_id, v1[1].update_id}));
  EXPECT_EQ(torn(rt), 0u);
  EXPECT_EQ(rt.active_version(), 2u);
}

TEST_F(sharded_test, shards_in_any_order_install_the_same_model) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  ASSERT_TRUE(ex.update_weights(publish_shards(1)).acknowledged);
  auto v2 = publish_shards(2);
  std::swap(v2[0], v2[1]);  // rank 1's shard first, as an HTTP caller may send them
  auto r2 = ex.update_weights(v2);
  ASSERT_TRUE(r2.acknowledged) << r2.failure->message;
  EXPECT_EQ(rt.active_version(), 2u);
  EXPECT_EQ(torn(rt), 0u);
}

TEST_F(sharded_test, one_bad_shard_rejects_the_whole_update) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  ASSERT_TRUE(ex.update_weights(publish_shards(1)).acknowledged);
  auto v2 = publish_shards(2);
  v2[1].tensors[0].checksum ^= 1;
  auto r = ex.update_weights(v2);
  EXPECT_FALSE(r.acknowledged);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->code, errc::checksum_mismatch);
  EXPECT_TRUE(r.released_self);
  EXPECT_EQ(*consumer.state(v2[0].update_id), update_state::released);
  EXPECT_EQ(*consumer.state(v2[1].update_id), update_state::released);
  EXPECT_EQ(rt.active_version(), 1u);
  EXPECT_EQ(torn(rt), 0u);
}

TEST_F(sharded_test, inconsistent_shards_are_refused_before_import) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto v1 = publish_shards(1);
  auto mixed = v1;
  mixed[1].weight_version = 7;
  auto r = ex.update_weights(mixed);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: weight_version:", 0), 0u);
  auto twice = std::vector<weight_update_manifest>{v1[0], v1[0]};
  r = ex.update_weights(twice);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: source_rank:", 0), 0u);
  auto other_model = v1;
  other_model[1].model_id = "other";
  r = ex.update_weights(other_model);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: model_id:", 0), 0u) << r.failure->message;
  auto same_id = v1;
  same_id[1].update_id = same_id[0].update_id;
  r = ex.update_weights(same_id);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: update_id:", 0), 0u) << r.failure->message;
  auto overlap = v1;
  overlap[1].tensors[0].name = overlap[0].tensors[0].name;
  r = ex.update_weights(overlap);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: tensors:", 0), 0u);
  // A name twice within one of several shards is the validator's refusal, not "two shards".
  auto twice_in_one = v1;
  twice_in_one[1].tensors[1].name = twice_in_one[1].tensors[0].name;
  r = ex.update_weights(twice_in_one);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: tensors[1].name: duplicate name", 0), 0u)
      << r.failure->message;
  EXPECT_TRUE(ex.update_weights(v1).acknowledged);  // nothing was imported by the refusals
}

// Shards handed over shared are imported without a copy: the imported update reads the very
// manifest given, which stays alive while the update is held, whoever else lets go of it.
TEST_F(sharded_test, shared_shards_are_kept_not_copied) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto v1 = publish_shards(1);
  std::vector<manifest_ptr> shared;
  for (const auto& m : v1) shared.push_back(std::make_shared<const weight_update_manifest>(m));
  std::weak_ptr<const weight_update_manifest> watch = shared[0];
  auto r = ex.update_weights(std::span<const manifest_ptr>(shared));
  ASSERT_TRUE(r.acknowledged) << r.failure->message;
  shared.clear();
  EXPECT_FALSE(watch.expired());  // the consumer holds the active update's manifest itself
  ASSERT_TRUE(ex.update_weights(publish_shards(2)).acknowledged);
  EXPECT_TRUE(watch.expired());  // released with the update
  // A missing shard is refused by position before anything is imported.
  std::vector<manifest_ptr> holey = {std::make_shared<const weight_update_manifest>(v1[0]),
                                     nullptr};
  r = ex.update_weights(std::span<const manifest_ptr>(holey));
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message, "invalid update: shards[1]: no manifest (rank=0)");
  EXPECT_EQ(rt.active_version(), 2u);
}

// One shard naming a tensor twice is refused in the validator's words, not as two shards.
TEST_F(executor_test, a_name_twice_in_one_shard_is_the_validators_refusal) {
  auto consumer = make_consumer();
  reference_runtime rt;
  rollout_executor ex(consumer, rt, rt.gate());
  auto m = publish(1);
  m.tensors[1].name = m.tensors[0].name;
  auto r = ex.update_weights(m);
  ASSERT_TRUE(r.failure);
  EXPECT_EQ(r.failure->message.rfind("invalid manifest: tensors[1].name: duplicate name", 0), 0u)
      << r.failure->message;
}

TEST_F(sharded_test, consumer_accepts_sibling_shards_but_not_a_repeat) {
  auto consumer = make_consumer();
  auto v1 = publish_shards(1);
  ASSERT_TRUE(consumer.import_update(v1[0]));
  ASSERT_TRUE(consumer.import_update(v1[1]));  // same version, another source rank
  auto again = v1[0];
  again.update_id = update_id_generate();
  auto r = consumer.import_update(again);  // same version, same source rank
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::version_not_monotonic);
  ASSERT_TRUE(consumer.release(v1[0].update_id));
  ASSERT_TRUE(consumer.release(v1[1].update_id));
}

}  // namespace
}  // namespace wsync
