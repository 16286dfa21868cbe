// The ucx transport beyond the shared suite: relays, chunk checksums, both pull operations,
// failures and options. Publisher, relay and child are three UCX workers in this process.

#include <gtest/gtest.h>

#include <future>
#include <thread>

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

TEST_F(ucx_test, a_relay_refuses_to_forward_a_chunk_whose_checksum_differs) {
  auto t = make();
  auto p = t->make_publisher();
  auto relay = t->make_consumer();
  auto child = t->make_consumer();
  ASSERT_TRUE(p && relay && child);
  auto m = publish(**p, "u-corrupt", {200000}, 3);
  // Bytes change after the publisher computed its chunk checksums: chunk 1 is now corrupt.
  spans_[0][65536 + 10] ^= std::byte{0xff};
  auto relay_got = (*relay)->import_segments(m);
  ASSERT_TRUE(relay_got) << relay_got.error().message;  // leaves check tensors, later

  auto child_manifest = m;
  child_manifest.transport_handle =
      *t->handle_via_relay(m.transport_handle, (*relay)->relay_address());
  auto child_got = (*child)->import_segments(child_manifest);
  ASSERT_FALSE(child_got);
  EXPECT_EQ(child_got.error().code, errc::checksum_mismatch);
  EXPECT_TRUE(contains(child_got.error().message, "tensor checksum mismatch: chunk 1 of segment 0"))
      << child_got.error().message;
  EXPECT_TRUE(contains(child_got.error().message, "update_id=u-corrupt"))
      << child_got.error().message;
  (*relay)->release(m.update_id);
  (*p)->release(m.update_id);
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
                        R"({"address":"00","chunk":65536,"checksums":[["0000000000000000"]]})"}) {
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
