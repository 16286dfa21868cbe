// One suite, run on every transport: what WeightPublisher + WeightConsumer promise holds
// whichever data plane carries the bytes.

#include <gtest/gtest.h>

#include <cstring>

#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_consumer.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

bool starts_with(const std::string& s, std::string_view prefix) {
  return s.rfind(prefix, 0) == 0;
}

class transport_suite : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto t = make_transport(GetParam());
    ASSERT_TRUE(t) << t.error().message;
    transport_ = std::move(*t);
    publisher_config cfg;
    cfg.model_id = "suite";
    cfg.max_segment_bytes = 1 << 20;  // several segments
    cfg.slot_wait = std::chrono::milliseconds(200);
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p);
    publisher_ = std::make_unique<weight_publisher>(std::move(*p), GetParam(), cfg);
    // Sizes: odd, small, larger than a segment.
    for (std::size_t n : {1001u, 64u, 3u << 20, 4096u}) {
      std::vector<std::byte> b(n);
      for (std::size_t i = 0; i < n; ++i) b[i] = std::byte((i * 31 + n) & 0xff);
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
    EXPECT_TRUE(c);
    return std::make_unique<weight_consumer>(std::move(*c), consumer_config{rank, 1});
  }

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
  auto consumer = make_consumer();
  auto u = consumer->import_update(*m);
  ASSERT_TRUE(u) << u.error().message;
  ASSERT_EQ((*u)->tensors.size(), bytes_.size());
  for (std::size_t i = 0; i < bytes_.size(); ++i) {
    EXPECT_EQ(std::memcmp((*u)->tensors[i].data, bytes_[i].data(), bytes_[i].size()), 0) << i;
  }
  ASSERT_TRUE(consumer->verify(m->update_id));
  ASSERT_TRUE(consumer->mark_installed(m->update_id));
  ASSERT_TRUE(consumer->acknowledge(m->update_id));
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
  ASSERT_TRUE(consumer->release(m->update_id));
  EXPECT_EQ(*consumer->state(m->update_id), update_state::released);
  EXPECT_FALSE(publisher_->held_updates().empty());  // the publisher has not heard yet
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_TRUE(publisher_->held_updates().empty());
  auto status = publisher_->status(m->update_id);
  ASSERT_TRUE(status);
  EXPECT_TRUE(status->consumers.at(0).acknowledged);
}

TEST_P(transport_suite, versions_must_grow_on_both_sides) {
  auto m = publisher_->publish(sources_, 5, {0});
  ASSERT_TRUE(m);
  auto again = publisher_->publish(sources_, 5, {0});
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, errc::version_not_monotonic);
  EXPECT_TRUE(starts_with(again.error().message, "weight_version must increase monotonically"));
  auto consumer = make_consumer();
  ASSERT_TRUE(consumer->import_update(*m));
  auto older = *m;
  older.update_id = update_id_generate();
  older.weight_version = 4;
  auto r = consumer->import_update(older);
  ASSERT_FALSE(r);
  EXPECT_TRUE(starts_with(r.error().message, "weight_version must increase monotonically"));
  EXPECT_NE(r.error().message.find("rank=0"), std::string::npos);
  ASSERT_TRUE(consumer->release(m->update_id));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
}

TEST_P(transport_suite, wrong_checksum_is_a_mismatch_naming_the_tensor) {
  auto m = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m);
  auto bad = *m;
  bad.tensors[2].checksum ^= 1;
  auto consumer = make_consumer(7);
  ASSERT_TRUE(consumer->import_update(bad));
  auto v = consumer->verify(bad.update_id);
  ASSERT_FALSE(v);
  EXPECT_EQ(v.error().code, errc::checksum_mismatch);
  EXPECT_TRUE(starts_with(v.error().message, "tensor checksum mismatch"));
  EXPECT_NE(v.error().message.find("\"t2\""), std::string::npos);
  EXPECT_NE(v.error().message.find("rank=7"), std::string::npos);
  auto ack = consumer->acknowledge(bad.update_id);
  EXPECT_FALSE(ack);
  ASSERT_TRUE(consumer->reject(bad.update_id, v.error().message));
  ASSERT_TRUE(consumer->release(bad.update_id));
  ASSERT_TRUE(publisher_->on_rejected(m->update_id, 0, v.error().message));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_TRUE(publisher_->held_updates().empty());
}

TEST_P(transport_suite, out_of_order_calls_are_refused) {
  auto consumer = make_consumer();
  auto ack = consumer->acknowledge("u-never-imported");
  ASSERT_FALSE(ack);
  EXPECT_TRUE(
      starts_with(ack.error().message, "cannot acknowledge update before import_update succeeds"));
  auto rel = consumer->release("u-never-imported");
  ASSERT_FALSE(rel);
  EXPECT_EQ(rel.error().code, errc::unknown_update);
  EXPECT_TRUE(starts_with(rel.error().message, "unknown update_id"));
  auto m = publisher_->publish(sources_, 1, {0});
  ASSERT_TRUE(m);
  ASSERT_TRUE(consumer->import_update(*m));
  auto early = consumer->acknowledge(m->update_id);
  ASSERT_FALSE(early);
  EXPECT_TRUE(starts_with(early.error().message, "cannot acknowledge update before install"));
  auto twice = consumer->import_update(*m);
  EXPECT_FALSE(twice);
  ASSERT_TRUE(consumer->release(m->update_id));
  auto after = consumer->acknowledge(m->update_id);
  ASSERT_FALSE(after);
  EXPECT_TRUE(starts_with(after.error().message, "cannot acknowledge update after release"));
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_FALSE(publisher_->on_released(m->update_id, 0));  // twice
}

TEST_P(transport_suite, memory_is_released_when_every_consumer_is_done) {
  auto m = publisher_->publish(sources_, 1, {0, 1, 2});
  ASSERT_TRUE(m);
  ASSERT_TRUE(publisher_->on_acknowledged(m->update_id, 0));
  auto twice = publisher_->on_acknowledged(m->update_id, 0);
  ASSERT_FALSE(twice);
  EXPECT_EQ(twice.error().code, errc::illegal_transition);
  EXPECT_FALSE(publisher_->on_acknowledged(m->update_id, 9));  // not expected
  ASSERT_TRUE(publisher_->on_released(m->update_id, 0));
  EXPECT_EQ(publisher_->held_updates().size(), 1u);
  ASSERT_TRUE(publisher_->on_failed(m->update_id, 1, "killed"));  // a dead consumer counts
  EXPECT_EQ(publisher_->held_updates().size(), 1u);
  ASSERT_TRUE(publisher_->on_rejected(m->update_id, 2, "bad"));
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
  EXPECT_TRUE(starts_with(m.error().message, "invalid manifest: tensors[1].nbytes:"))
      << m.error().message;
  EXPECT_TRUE(publisher_->held_updates().empty());
  auto dup = sources_;
  dup[3].name = dup[0].name;
  auto d = publisher_->publish(dup, 1, {0});
  ASSERT_FALSE(d);
  EXPECT_TRUE(starts_with(d.error().message, "invalid manifest: tensors[3].name:"));
  auto null_data = sources_;
  null_data[0].data = nullptr;
  EXPECT_FALSE(publisher_->publish(null_data, 1, {0}));
  EXPECT_FALSE(publisher_->publish(sources_, 1, {0, 0}));  // duplicate rank
  // A refused publish does not consume the version.
  EXPECT_TRUE(publisher_->publish(sources_, 1, {}));
  EXPECT_TRUE(publisher_->held_updates().empty());  // no consumer expected: released at once
}

INSTANTIATE_TEST_SUITE_P(all, transport_suite, ::testing::Values("local-clone", "shared-memory"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (auto& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace wsync
