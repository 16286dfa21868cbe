// The forwarding halves pass every call of the contract to the wrapped half, answers included.

#include "wsync/transports/forwarding.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

// Answers each call with something no default gives, and records the call.
class marked_publisher final : public publisher_transport {
 public:
  std::vector<std::string> calls;
  memory_location memory() const override { return {3}; }
  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> bytes,
                                                    std::chrono::milliseconds) override {
    calls.push_back("acquire " + id + " " + std::to_string(bytes.size()));
    return std::vector<std::span<std::byte>>{};
  }
  result<void> consumers_set(const update_id& id, std::span<const std::int32_t> c) override {
    calls.push_back("consumers_set " + id + " " + std::to_string(c.size()));
    return make_error(errc::try_again, "consumers_set reached");
  }
  bool can_lend() const override { return true; }
  result<void> lend(const update_id& id, std::span<const std::uint64_t>,
                    std::vector<lent_range> ranges) override {
    calls.push_back("lend " + id + " " + std::to_string(ranges.size()));
    return {};
  }
  result<void> lent_wait(const update_id& id, std::chrono::milliseconds) override {
    calls.push_back("lent_wait " + id);
    return make_error(errc::timeout, "lent_wait reached");
  }
  result<std::string> expose(const update_id& id) override { return "handle of " + id; }
  result<void> announce(const weight_update_manifest& m) override {
    calls.push_back("announce " + m.update_id);
    return make_error(errc::io_error, "announce reached");
  }
  void release(const update_id& id) override { calls.push_back("release " + id); }
  void closing() override { calls.push_back("closing"); }
};

class marked_consumer final : public consumer_transport {
 public:
  std::vector<std::string> calls;
  memory_location memory() const override { return {2}; }
  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    calls.push_back("import " + m.update_id);
    return std::vector<std::span<const std::byte>>{};
  }
  void release(const update_id& id) override { calls.push_back("release " + id); }
  result<void> intact(const update_id& id) const override {
    return make_error(errc::unknown_update, "rewritten: " + id);
  }
  void rank_set(std::int32_t rank) override { calls.push_back("rank " + std::to_string(rank)); }
  std::string import_source(const update_id& id) const override { return "peer of " + id; }
  std::string relay_address() const override { return "relay:1"; }
};

TEST(forwarding_publisher, passes_every_call_and_its_answer) {
  auto inner = std::make_shared<marked_publisher>();
  forwarding_publisher f(inner);
  EXPECT_EQ(f.memory().cuda_device, 3);
  const std::uint64_t bytes[] = {1, 2};
  EXPECT_TRUE(f.acquire("u", bytes, std::chrono::milliseconds(1)));
  const std::int32_t consumers[] = {0, 1, 2};
  EXPECT_EQ(f.consumers_set("u", consumers).error().message, "consumers_set reached");
  EXPECT_TRUE(f.can_lend());
  EXPECT_TRUE(f.lend("u", bytes, {lent_range{}}));
  EXPECT_EQ(f.lent_wait("u", std::chrono::milliseconds(1)).error().code, errc::timeout);
  EXPECT_EQ(*f.expose("u"), "handle of u");
  weight_update_manifest m;
  m.update_id = "u";
  EXPECT_EQ(f.announce(m).error().message, "announce reached");
  f.release("u");
  f.closing();
  EXPECT_EQ(inner->calls,
            (std::vector<std::string>{"acquire u 2", "consumers_set u 3", "lend u 1", "lent_wait u",
                                      "announce u", "release u", "closing"}));
}

TEST(forwarding_consumer, passes_every_call_and_its_answer) {
  auto inner = std::make_shared<marked_consumer>();
  forwarding_consumer f(inner);
  EXPECT_EQ(f.memory().cuda_device, 2);
  weight_update_manifest m;
  m.update_id = "u";
  EXPECT_TRUE(f.import_segments(m));
  EXPECT_EQ(f.intact("u").error().message, "rewritten: u");
  f.rank_set(7);
  EXPECT_EQ(f.import_source("u"), "peer of u");
  EXPECT_EQ(f.relay_address(), "relay:1");
  f.release("u");
  EXPECT_EQ(inner->calls, (std::vector<std::string>{"import u", "rank 7", "release u"}));
}

// A transport whose expose fails (file-mmap's fdatasync, say): the publish error names the
// update and the rank, as every publish error does, and nothing stays acquired.
class failing_expose final : public forwarding_publisher {
 public:
  using forwarding_publisher::forwarding_publisher;
  result<std::string> expose(const update_id& id) override {
    return make_error(errc::io_error, "disk gone while exposing " + id);
  }
};

// Publishes one 64-byte tensor as publisher rank 3 of local-clone through `Wrapper`: the
// publish's outcome, and whether the publisher holds nothing afterwards.
template <class Wrapper>
std::pair<result<weight_update_manifest>, bool> publish_through() {
  auto t = make_transport("local-clone", {});
  if (!t) return {t.error(), false};
  auto inner = (*t)->make_publisher();
  if (!inner) return {inner.error(), false};
  publisher_config cfg;
  cfg.model_id = "m";
  cfg.source_rank = 3;
  cfg.slot_wait = std::chrono::milliseconds(100);
  weight_publisher p(std::make_unique<Wrapper>(std::move(*inner)), "local-clone", cfg);
  std::vector<std::byte> bytes(64, std::byte{1});
  std::vector<tensor_source> sources = {{"w", dtype::u8, {64}, {}, bytes.data(), bytes.size()}};
  auto m = p.publish(sources, 1, {});
  return {std::move(m), p.held_updates().empty()};
}

TEST(forwarding_publisher, a_failed_expose_names_the_update_and_the_rank) {
  auto [m, nothing_held] = publish_through<failing_expose>();
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error().code, errc::io_error);
  EXPECT_NE(m.error().message.find("disk gone while exposing"), std::string::npos);
  EXPECT_NE(m.error().message.find(" rank=3"), std::string::npos) << m.error().message;
  EXPECT_TRUE(nothing_held);
}

// A handle consumers would refuse as too large (ucx lists a checksum per chunk): the publish
// fails, naming the field and what to change, instead of every consumer rejecting it.
class huge_handle final : public forwarding_publisher {
 public:
  using forwarding_publisher::forwarding_publisher;
  result<std::string> expose(const update_id&) override { return std::string(1u << 20, 'x'); }
};

TEST(forwarding_publisher, a_handle_consumers_would_refuse_fails_the_publish) {
  auto [m, nothing_held] = publish_through<huge_handle>();
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error().code, errc::invalid_argument);
  EXPECT_EQ(m.error().message.rfind("publish failed: transport_handle: 1048576 bytes", 0), 0u)
      << m.error().message;
  EXPECT_NE(m.error().message.find(" rank=3"), std::string::npos) << m.error().message;
  EXPECT_TRUE(nothing_held);
}

}  // namespace
}  // namespace wsync
