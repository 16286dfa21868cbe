// The nccl transport over an in-process group (tests/support/host_group.hpp): the handle and
// header codecs, its options, and the protocol between a publisher thread and consumer threads
// through weight_publisher / weight_consumer: bytes in slices, skipped updates dropped on the
// way, a member that never comes aborting the group, and a new epoch after it. The same code
// drives NCCL on GPUs (nccl/fabric.cpp); the last test runs it there and needs two GPUs.

#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "host_group.hpp"
#include "nccl/handle.hpp"
#include "pattern_tensors.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl_transport.hpp"
#include "wsync/transports/weight_consumer.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync::nccl {
namespace {

using namespace std::chrono_literals;

bool contains(const std::string& s, std::string_view part) {
  return s.find(part) != std::string::npos;
}

weight_update_manifest manifest_with(std::vector<std::uint64_t> segments, std::string handle) {
  weight_update_manifest m;
  m.update_id = "u-1";
  m.transport = "nccl";
  for (auto n : segments) m.segments.push_back({n});
  m.transport_handle = std::move(handle);
  return m;
}

nccl_handle::handle good_handle() {
  nccl_handle::handle h;
  h.group = "0123456789abcdef";
  h.epoch = 3;
  h.id[0] = std::byte{7};
  h.members = {0, 4, 2};
  h.sequence = 9;
  h.bytes = 512 + 256;  // segments of 300 and 10 bytes, 256-byte aligned
  h.bucket_bytes = 1 << 20;
  h.buckets = 2;
  return h;
}

TEST(nccl_handle, round_trips_and_checks_every_field) {
  const auto h = good_handle();
  auto back = nccl_handle::parse(manifest_with({300, 10}, nccl_handle::encode(h)));
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(back->group, h.group);
  EXPECT_EQ(back->epoch, 3u);
  EXPECT_EQ(back->id, h.id);
  EXPECT_EQ(back->members, h.members);
  EXPECT_EQ(back->sequence, 9u);
  EXPECT_EQ(back->bytes, h.bytes);

  auto refused = [](nccl_handle::handle bad, std::vector<std::uint64_t> segments = {300, 10}) {
    auto r = nccl_handle::parse(manifest_with(std::move(segments), nccl_handle::encode(bad)));
    if (r) return std::string("accepted");
    EXPECT_EQ(r.error().code, errc::invalid_manifest);
    EXPECT_TRUE(contains(r.error().message, "update_id=u-1")) << r.error().message;
    return r.error().message;
  };
  auto h2 = h;
  h2.group = "xyz";
  EXPECT_TRUE(contains(refused(h2), "transport_handle: group is not 16 hex digits"));
  h2 = h;
  h2.members = {};
  EXPECT_TRUE(contains(refused(h2), "members is empty"));
  h2.members = {1, 1};
  EXPECT_TRUE(contains(refused(h2), "members: rank 1 twice"));
  h2.members = {-2};
  EXPECT_TRUE(contains(refused(h2), "members: rank -2 is negative"));
  h2 = h;
  h2.bucket_bytes = 1000;
  EXPECT_TRUE(contains(refused(h2), "bucket_bytes 1000 is outside"));
  h2 = h;
  h2.buckets = 0;
  EXPECT_TRUE(contains(refused(h2), "buckets 0 is outside"));
  EXPECT_TRUE(contains(refused(h, {300, 10, 1}), "bytes 768 is not the segments' 1024 bytes"));

  auto raw = [](const std::string& text) {
    auto r = nccl_handle::parse(manifest_with({10}, text));
    return r ? std::string("accepted") : r.error().message;
  };
  EXPECT_TRUE(contains(raw("[]"), "not an nccl handle"));
  EXPECT_TRUE(contains(raw(R"({"group":"0123456789abcdef"})"), "nccl handle field: "));
  auto j = nccl_handle::encode(h);
  auto at = j.find("\"id\":\"") + 6;
  j[at] = '-';  // not standard base64
  EXPECT_TRUE(contains(raw(j), "id: ")) << raw(j);
}

TEST(nccl_handle, header_round_trips_and_refuses_foreign_bytes) {
  const nccl_handle::header h{12, 4096, 0xfeedface};
  auto block = nccl_handle::header_encode(h);
  auto back = nccl_handle::header_decode(block);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, h);
  block[3] = std::byte{0};
  EXPECT_FALSE(nccl_handle::header_decode(block));
  // The digest names the update: two ids, two headers.
  auto a = good_handle();
  EXPECT_NE(nccl_handle::header_of(a, "u-a"), nccl_handle::header_of(a, "u-b"));
}

TEST(nccl_settings, defaults_ranges_and_unknown_keys) {
  auto d = settings_read({});
  ASSERT_TRUE(d) << d.error().message;
  EXPECT_EQ(d->consumers, std::vector<std::int32_t>{0});
  EXPECT_EQ(d->bucket_bytes, std::uint64_t{256} << 20);
  EXPECT_EQ(d->buckets, 2u);
  EXPECT_EQ(d->slots, 2u);
  EXPECT_EQ(d->timeout, 60000ms);
  auto s = settings_read({{"consumers", "3,1,7"}, {"buckets", "4"}});
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ(s->consumers, (std::vector<std::int32_t>{3, 1, 7}));
  auto refused = [](transport_options o) {
    auto r = settings_read(o);
    return r ? std::string("accepted") : r.error().message;
  };
  for (const char* bad : {"", "1,,2", "a", "-1", "1,", "2147483648"}) {
    EXPECT_TRUE(contains(refused({{"consumers", bad}}), "nccl option consumers: ")) << bad;
  }
  EXPECT_TRUE(contains(refused({{"consumers", "1,1"}}), "rank 1 twice"));
  EXPECT_TRUE(contains(refused({{"bucket_bytes", "1024"}}), "nccl option bucket_bytes: 1024"));
  EXPECT_TRUE(contains(refused({{"buckets", "17"}}), "nccl option buckets: 17"));
  EXPECT_TRUE(contains(refused({{"bucket", "2"}}), "nccl option bucket"));
}

// A publisher and consumer ranks 0 and 1 of one model, on one host fabric.
class nccl_transport_test : public ::testing::Test {
 protected:
  void start(transport_options options = {}, bool lend = false) {
    if (!options.count("consumers")) options["consumers"] = "0,1";
    if (!options.count("bucket_bytes")) options["bucket_bytes"] = "1048576";
    auto t = make_transport(options, [this](int) -> result<std::shared_ptr<group_fabric>> {
      return std::shared_ptr<group_fabric>(fabric_);
    });
    ASSERT_TRUE(t) << t.error().message;
    transport_ = std::move(*t);
    EXPECT_EQ(transport_->name(), "nccl");
    EXPECT_TRUE(transport_->caps().cross_node);
    EXPECT_TRUE(transport_->caps().collective);
    publisher_config cfg;
    cfg.model_id = "m";
    cfg.max_segment_bytes = 1 << 20;  // several segments
    cfg.slot_wait = 200ms;
    cfg.lend_sources = lend;
    auto p = transport_->make_publisher();
    ASSERT_TRUE(p) << p.error().message;
    publisher_ = std::make_unique<weight_publisher>(std::move(*p), "nccl", cfg);
    for (std::int32_t r : {0, 1}) {
      auto c = transport_->make_consumer();
      ASSERT_TRUE(c) << c.error().message;
      raw_.push_back(c->get());
      consumers_.push_back(std::make_unique<weight_consumer>(std::move(*c), consumer_config{r, 1}));
    }
  }

  void TearDown() override {
    consumers_.clear();
    publisher_.reset();
    transport_.reset();
  }

  result<weight_update_manifest> publish(std::uint64_t version) {
    return publisher_->publish(tensors_.fill(version), version, {0, 1});
  }

  // Rank `r` imports `m` and checks every word.
  std::string import_checked(std::int32_t r, const weight_update_manifest& m) {
    auto u = consumers_[r]->import_update(m);
    if (!u) return u.error().message;
    for (std::size_t i = 0; i < (*u)->tensors.size(); ++i) {
      const auto& t = (*u)->tensors[i];
      if (auto bad = test::pattern_mismatches(t.data, t.descriptor->nbytes, m.weight_version, i)) {
        return "tensor " + std::to_string(i) + ": " + std::to_string(bad) + " words differ";
      }
    }
    return "ok";
  }

  // Rank `r` verifies, installs, acknowledges and releases an imported `m`.
  std::string finish(std::int32_t r, const weight_update_manifest& m) {
    auto& c = *consumers_[r];
    for (auto step : {&weight_consumer::verify, &weight_consumer::mark_installed,
                      &weight_consumer::acknowledge, &weight_consumer::release}) {
      if (auto ok = (c.*step)(m.update_id); !ok) return ok.error().message;
    }
    return "ok";
  }

  // Rank `r` takes `m` through its whole lifecycle.
  std::string take(std::int32_t r, const weight_update_manifest& m) {
    auto got = import_checked(r, m);
    return got != "ok" ? got : finish(r, m);
  }

  std::future<std::string> take_async(std::int32_t r, const weight_update_manifest& m) {
    return std::async(std::launch::async, [this, r, m] { return take(r, m); });
  }

  void publisher_done(const weight_update_manifest& m) {
    for (std::int32_t r : {0, 1}) {
      (void)publisher_->on_acknowledged(m.update_id, r);
      (void)publisher_->on_released(m.update_id, r);
    }
  }

  std::shared_ptr<testing::host_fabric> fabric_ = std::make_shared<testing::host_fabric>();
  // 24 tensors of 96 KiB: 2.3 MB in three segments, three 1 MiB slices per update.
  test::pattern_tensors tensors_{24, 12 << 10};
  std::unique_ptr<transport> transport_;
  std::unique_ptr<weight_publisher> publisher_;
  std::vector<std::unique_ptr<weight_consumer>> consumers_;
  std::vector<consumer_transport*> raw_;  ///< each consumer's transport, below its version rule
};

TEST_F(nccl_transport_test, every_member_receives_every_version_and_memory_is_reused) {
  start();
  std::uint64_t slot = 0;
  for (std::uint64_t v = 1; v <= 4; ++v) {
    auto m = publish(v);
    ASSERT_TRUE(m) << m.error().message;
    EXPECT_EQ(m->transport, "nccl");
    auto h = nccl_handle::parse(*m);
    ASSERT_TRUE(h) << h.error().message;
    EXPECT_EQ(h->epoch, 1u);  // one communicator for the whole run
    EXPECT_EQ(h->sequence, v);
    EXPECT_EQ(h->members, (std::vector<std::int32_t>{0, 1}));
    EXPECT_GT(h->bytes, 2u << 20);  // more than two slices
    slot = h->bytes;
    auto a = take_async(0, *m);
    auto b = take_async(1, *m);
    EXPECT_EQ(a.get(), "ok") << "version " << v;
    EXPECT_EQ(b.get(), "ok") << "version " << v;
    publisher_done(*m);
  }
  EXPECT_EQ(fabric_->joins.load(), 3);  // each member joined once
  // Each release waited for the program's reads of the block before pooling it for reuse.
  EXPECT_EQ(fabric_->reads_waited.load(), 8);
  // Pooled on both sides: two publisher slots at most, one block per consumer, three headers
  // (without pooling the consumers alone would have taken eight blocks).
  EXPECT_LE(fabric_->allocated_bytes.load(), 2 * slot + 2 * slot + 3 * 64);
}

TEST_F(nccl_transport_test, shards_of_two_publisher_ranks_come_through_their_own_groups) {
  start({{"timeout_ms", "5000"}});
  publisher_config cfg;
  cfg.model_id = "m";
  cfg.source_rank = 1;
  cfg.max_segment_bytes = 1 << 20;
  auto p = transport_->make_publisher();
  ASSERT_TRUE(p) << p.error().message;
  weight_publisher second(std::move(*p), "nccl", cfg);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    auto a = publish(v);
    ASSERT_TRUE(a) << a.error().message;
    auto b = second.publish(tensors_.fill(v), v, {0, 1});
    ASSERT_TRUE(b) << b.error().message;
    EXPECT_NE(nccl_handle::parse(*a)->group, nccl_handle::parse(*b)->group);
    // Every consumer takes the shards in the same order (the coordinator's), as a rollout
    // executor does.
    auto both = [&](std::int32_t r) {
      return std::async(std::launch::async, [this, r, a = *a, b = *b] {
        for (const auto* m : {&a, &b}) {
          if (auto got = import_checked(r, *m); got != "ok") return got;
        }
        auto got = finish(r, a);
        return got != "ok" ? got : finish(r, b);
      });
    };
    auto r0 = both(0);
    auto r1 = both(1);
    EXPECT_EQ(r0.get(), "ok") << "version " << v;
    EXPECT_EQ(r1.get(), "ok") << "version " << v;
    publisher_done(*a);
    for (std::int32_t r : {0, 1}) {
      (void)second.on_acknowledged(b->update_id, r);
      (void)second.on_released(b->update_id, r);
    }
  }
  EXPECT_EQ(fabric_->joins.load(), 6);  // two groups of three, each joined once
}

TEST_F(nccl_transport_test, the_group_follows_the_consumers_each_update_names) {
  start();
  struct step {
    std::vector<std::int32_t> consumers;
    std::uint64_t epoch;
  };
  // A new set of consumers takes a new communicator; the same set keeps it.
  const std::vector<step> steps = {{{0}, 1}, {{0, 1}, 2}, {{0, 1}, 2}, {{1}, 3}};
  for (std::uint64_t v = 1; v <= steps.size(); ++v) {
    const auto& want = steps[v - 1];
    auto m = publisher_->publish(tensors_.fill(v), v, want.consumers);
    ASSERT_TRUE(m) << m.error().message;
    auto h = nccl_handle::parse(*m);
    ASSERT_TRUE(h);
    EXPECT_EQ(h->members, want.consumers) << "version " << v;
    EXPECT_EQ(h->epoch, want.epoch) << "version " << v;
    std::vector<std::future<std::string>> takers;
    for (auto r : want.consumers) takers.push_back(take_async(r, *m));
    for (auto& t : takers) EXPECT_EQ(t.get(), "ok") << "version " << v;
    for (auto r : want.consumers) {
      (void)publisher_->on_acknowledged(m->update_id, r);
      (void)publisher_->on_released(m->update_id, r);
    }
    if (v == steps.size()) {  // rank 0 is not in the last group, and lets go of the old one
      EXPECT_EQ(fabric_->members.load(), 3);  // the publisher and rank 1 in 3, rank 0 in 2
      auto out = consumers_[0]->import_update(*m);
      ASSERT_FALSE(out);
      EXPECT_TRUE(contains(out.error().message, "rank 0 is not a member")) << out.error().message;
      EXPECT_EQ(fabric_->members.load(), 2);
    }
  }
  EXPECT_EQ(fabric_->joins.load(), 2 + 3 + 2);  // three communicators
}

TEST_F(nccl_transport_test, lent_tensors_go_out_through_bucket_buffers_with_no_copy_of_the_update) {
  start({}, true);
  test::pattern_tensors big(48, 16 << 10);  // 6 MiB: six 1 MiB slices, two bucket buffers
  std::uint64_t bytes = 0;
  for (std::uint64_t v = 1; v <= 3; ++v) {
    auto m = publisher_->publish(big.fill(v), v, {0, 1});
    ASSERT_TRUE(m) << m.error().message;
    bytes = nccl_handle::parse(*m)->bytes;
    if (v == 1) {  // nobody receives yet: the tensors are still lent
      auto early = publisher_->lent_wait(m->update_id, 50ms);
      ASSERT_FALSE(early);
      EXPECT_EQ(early.error().code, errc::timeout);
      EXPECT_TRUE(contains(early.error().message, "still reads the lent tensors"));
    }
    auto a = take_async(0, *m);
    auto b = take_async(1, *m);
    EXPECT_EQ(a.get(), "ok") << "version " << v;  // every word, and verify's checksums
    EXPECT_EQ(b.get(), "ok") << "version " << v;
    ASSERT_TRUE(publisher_->lent_wait(m->update_id, 5s));
    publisher_done(*m);
  }
  // The publisher holds two 1 MiB bucket buffers and a header, not a copy of the update; the
  // consumers one block each (a slot-mode publisher would add at least one 6 MiB slot).
  const std::uint64_t bucket = 1 << 20;
  EXPECT_LE(fabric_->allocated_bytes.load(), 2 * bucket + 2 * bytes + 3 * 64);
}

TEST_F(nccl_transport_test, a_rank_that_skipped_an_update_drops_it_on_the_way_to_the_next) {
  start();
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto m2 = publish(2);
  ASSERT_TRUE(m2) << m2.error().message;
  // Rank 1 rejected version 1 before importing it (or a catch-up jumped past it).
  auto a1 = take_async(0, *m1);
  auto b2 = take_async(1, *m2);
  EXPECT_EQ(a1.get(), "ok");
  auto a2 = take_async(0, *m2);
  EXPECT_EQ(b2.get(), "ok");
  EXPECT_EQ(a2.get(), "ok");
  // Version 1's broadcast was passed: rank 1 cannot import it any more (below the version rule,
  // which would refuse it first).
  auto late = raw_[1]->import_segments(*m1);
  ASSERT_FALSE(late);
  EXPECT_TRUE(contains(late.error().message, "was broadcast already")) << late.error().message;
  EXPECT_TRUE(contains(late.error().message, "rank=1")) << late.error().message;
}

TEST_F(nccl_transport_test, a_member_that_never_comes_aborts_the_group_then_a_new_epoch_works) {
  start({{"timeout_ms", "300"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  // Rank 1 never imports version 1: the publisher and rank 0 give up at the deadline.
  auto a1 = take_async(0, *m1);
  const auto why = a1.get();
  EXPECT_TRUE(contains(why, "update_id=" + m1->update_id)) << why;
  EXPECT_TRUE(contains(why, "rank=0")) << why;
  EXPECT_TRUE(contains(why, "nccl: ")) << why;
  publisher_done(*m1);
  // The next update goes out on a new communicator with the same members. One exposed before
  // the publisher's own join gave up still names the old epoch, and fails at once everywhere.
  int delivered = 0;
  std::uint64_t last_epoch = 0;
  for (std::uint64_t v = 2; v <= 4; ++v) {
    auto m = publish(v);
    ASSERT_TRUE(m) << m.error().message;
    auto h = nccl_handle::parse(*m);
    ASSERT_TRUE(h);
    last_epoch = h->epoch;
    auto a = take_async(0, *m);
    auto b = take_async(1, *m);
    const auto got_a = a.get();
    const auto got_b = b.get();
    if (h->epoch == 1) {
      EXPECT_NE(got_a, "ok");
      EXPECT_NE(got_b, "ok");
      for (std::int32_t r : {0, 1}) (void)consumers_[r]->release(m->update_id);
    } else {
      EXPECT_EQ(h->epoch, 2u);
      EXPECT_EQ(got_a, "ok") << "version " << v;
      EXPECT_EQ(got_b, "ok") << "version " << v;
      ++delivered;
    }
    publisher_done(*m);
  }
  EXPECT_EQ(last_epoch, 2u);
  EXPECT_GE(delivered, 2);
  // Rank 1 comes back for version 1: its epoch is gone.
  auto late = raw_[1]->import_segments(*m1);
  ASSERT_FALSE(late);
  EXPECT_TRUE(contains(late.error().message, "was abandoned")) << late.error().message;
}

// Closing a publisher whose members never come: the sender waits in the join, for a slot's
// update or for a lent one (whose release waits for the sender), and closing ends that wait.
// Not a speed check: the bound is a hundredth of the deadline it would otherwise wait out.
TEST_F(nccl_transport_test, closing_the_publisher_ends_a_broadcast_its_members_never_join) {
  for (bool lend : {false, true}) {
    start({{"timeout_ms", "600000"}}, lend);
    const int joins = fabric_->joins.load();
    auto m = publish(1);
    ASSERT_TRUE(m) << m.error().message;
    while (fabric_->joins.load() == joins) std::this_thread::yield();
    const auto t0 = std::chrono::steady_clock::now();
    publisher_.reset();
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_LT(took, 6s) << (lend ? "lent" : "in a slot");
    consumers_.clear();
    raw_.clear();
  }
}

// A consumer shutting down while its import waits in the join for a member that never comes
// (rank 0 never imports): the import used to wait out its whole deadline, holding the process's
// shutdown (the actor system waits for the worker) for up to timeout_ms.
TEST_F(nccl_transport_test, closing_a_consumer_ends_an_import_waiting_for_its_group) {
  start({{"timeout_ms", "20000"}});
  const int joins = fabric_->joins.load();
  auto m = publish(1);
  ASSERT_TRUE(m) << m.error().message;
  auto waiting = std::async(std::launch::async, [&] { return import_checked(1, *m); });
  while (fabric_->joins.load() < joins + 2) std::this_thread::yield();  // the publisher and 1
  const auto t0 = std::chrono::steady_clock::now();
  consumers_[1]->closing();
  ASSERT_EQ(waiting.wait_for(5s), std::future_status::ready) << "the import waits on";
  const auto why = waiting.get();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_TRUE(contains(why, "joining the publisher's group (epoch 1) failed")) << why;
  EXPECT_TRUE(contains(why, "cancelled")) << why;
  EXPECT_TRUE(contains(why, "update_id=" + m->update_id)) << why;
  auto again = consumers_[1]->import_update(*m);  // refused at once, not joined again
  ASSERT_FALSE(again);
  EXPECT_TRUE(contains(again.error().message, "the transport is closing")) << again.error().message;
}

TEST_F(nccl_transport_test, a_group_broken_under_an_import_fails_it_with_the_reason) {
  start({{"timeout_ms", "5000"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto a1 = take_async(0, *m1);
  auto b1 = take_async(1, *m1);
  ASSERT_EQ(a1.get(), "ok");
  ASSERT_EQ(b1.get(), "ok");
  publisher_done(*m1);
  auto m2 = publish(2);
  ASSERT_TRUE(m2) << m2.error().message;
  auto a2 = take_async(0, *m2);  // rank 1 is slow: rank 0 and the publisher wait for it
  fabric_->abort_all("link down");
  const auto why = a2.get();  // long before the 5 s deadline
  EXPECT_TRUE(contains(why, "link down")) << why;
  EXPECT_TRUE(contains(why, "update_id=" + m2->update_id)) << why;
  // Rank 1 sees the same reason at once.
  auto b2 = consumers_[1]->import_update(*m2);
  ASSERT_FALSE(b2);
  EXPECT_TRUE(contains(b2.error().message, "was aborted: link down")) << b2.error().message;
}

TEST_F(nccl_transport_test, a_rank_outside_the_members_is_told_so) {
  start({{"consumers", "0"}});
  auto m = publisher_->publish(tensors_.fill(1), 1, {});  // no consumers named: the option's
  ASSERT_TRUE(m) << m.error().message;
  auto u = consumers_[1]->import_update(*m);
  ASSERT_FALSE(u);
  EXPECT_EQ(u.error().message.rfind("nccl: transport_handle.members: rank 1 is not a member of "
                                    "this update's group (members 0) (update_id=",
                                    0),
            0u)
      << u.error().message;
  EXPECT_EQ(take(0, *m), "ok");
}

TEST_F(nccl_transport_test, the_publisher_waits_for_a_free_slot_then_says_why_not) {
  start({{"slots", "1"}});
  auto m1 = publish(1);
  ASSERT_TRUE(m1) << m1.error().message;
  auto m2 = publish(2);  // version 1 still holds the only slot
  ASSERT_FALSE(m2);
  EXPECT_EQ(m2.error().code, errc::timeout);
  EXPECT_TRUE(contains(m2.error().message, "option slots=1")) << m2.error().message;
  auto a = take_async(0, *m1);
  auto b = take_async(1, *m1);
  EXPECT_EQ(a.get(), "ok");
  EXPECT_EQ(b.get(), "ok");
  publisher_done(*m1);
  auto m3 = publish(3);
  ASSERT_TRUE(m3) << m3.error().message;
  auto a3 = take_async(0, *m3);
  auto b3 = take_async(1, *m3);
  EXPECT_EQ(a3.get(), "ok");
  EXPECT_EQ(b3.get(), "ok");
}

// Over NCCL: the publisher on cuda:0, a consumer on cuda:1, two threads of this process. NCCL
// refuses two ranks on one GPU, so this needs two.
TEST(nccl_transport_gpu, two_gpus_carry_every_version_through_ncclBroadcast) {
  auto second = cuda_fabric(1);
  if (!second) GTEST_SKIP() << "needs two GPUs: " << second.error().message;
  auto on = [](int device) {
    return make_transport({{"consumers", "0"},
                           {"device", std::to_string(device)},
                           {"bucket_bytes", "1048576"},
                           {"timeout_ms", "60000"}},
                          cuda_fabric);
  };
  auto pt = on(0);
  ASSERT_TRUE(pt) << pt.error().message;
  auto ct = on(1);
  ASSERT_TRUE(ct) << ct.error().message;
  publisher_config cfg;
  cfg.model_id = "m";
  cfg.max_segment_bytes = 1 << 20;
  auto p = (*pt)->make_publisher();
  ASSERT_TRUE(p) << p.error().message;
  weight_publisher publisher(std::move(*p), "nccl", cfg);
  auto c = (*ct)->make_consumer();
  ASSERT_TRUE(c) << c.error().message;
  weight_consumer consumer(std::move(*c), consumer_config{0, 1});
  test::pattern_tensors tensors(24, 12 << 10);
  for (std::uint64_t v = 1; v <= 3; ++v) {
    auto m = publisher.publish(tensors.fill(v), v, {0});
    ASSERT_TRUE(m) << m.error().message;
    auto u = consumer.import_update(*m);
    ASSERT_TRUE(u) << u.error().message;
    EXPECT_EQ((*u)->memory.cuda_device, 1);
    ASSERT_TRUE(consumer.verify(m->update_id)) << "version " << v;
    for (std::size_t i = 0; i < (*u)->tensors.size(); ++i) {
      const auto& t = (*u)->tensors[i];
      std::vector<std::byte> host(t.descriptor->nbytes);
      auto copied = gpu::copy_to_host(host.data(), t.data, host.size());
      ASSERT_TRUE(copied) << copied.error().message;
      EXPECT_EQ(test::pattern_mismatches(host.data(), host.size(), v, i), 0u) << "tensor " << i;
    }
    ASSERT_TRUE(consumer.mark_installed(m->update_id));
    ASSERT_TRUE(consumer.acknowledge(m->update_id));
    ASSERT_TRUE(consumer.release(m->update_id));
    ASSERT_TRUE(publisher.on_acknowledged(m->update_id, 0));
    ASSERT_TRUE(publisher.on_released(m->update_id, 0));
  }
}

}  // namespace
}  // namespace wsync::nccl
