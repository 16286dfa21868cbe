#include "wsync/manifest/codec.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <limits>

namespace wsync {
namespace {

weight_update_manifest full_manifest() {
  weight_update_manifest m;
  m.update_id = update_id_generate();
  m.model_id = "org/model-7b";
  m.weight_version = std::numeric_limits<std::uint64_t>::max() - 1;
  m.source_worker = "trainer-3:4242";
  m.source_rank = 3;
  m.transport = "shared-memory";
  for (int b = 0; b < 256; ++b) m.transport_handle.push_back(static_cast<char>(b));
  m.tensors = {{"w", dtype::bf16, {4, 8}, {1, 4}, 64, "cuda:1", 0, 256, 0xfedcba9876543210ull},
               {"b", dtype::fp8_e5m2, {0}, {}, 0, "cpu", 1, 0, 0}};
  m.segments = {{512}, {256}};
  m.metadata = {{"step", "1200"}, {"note", "ünïcödé \"quoted\""}};
  m.total_bytes = 768;
  return m;
}

void expect_refused(const std::string& text, const std::string& prefix) {
  auto r = manifest_from_json(text);
  ASSERT_FALSE(r) << "accepted: " << text;
  EXPECT_EQ(r.error().code, errc::invalid_manifest);
  EXPECT_EQ(r.error().message.rfind("invalid manifest: " + prefix, 0), 0u) << r.error().message;
}

TEST(codec, round_trips_every_field_exactly) {
  auto m = full_manifest();
  auto text = manifest_to_json(m);
  auto back = manifest_from_json(text);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, m);
  EXPECT_EQ(manifest_to_json(*back), text);
  EXPECT_NE(text.find("\"checksum\":\"fedcba9876543210\""), std::string::npos);
}

TEST(codec, names_the_field_of_a_structural_problem) {
  auto text = manifest_to_json(full_manifest());
  auto edit = [&](const std::string& from, const std::string& to) {
    auto t = text;
    auto at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  expect_refused(edit("\"model_id\":", "\"modelid\":"), "model_id: missing");
  expect_refused(edit("\"source_rank\":3", "\"source_rank\":\"3\""), "source_rank: expected");
  expect_refused(edit("\"total_bytes\":768", "\"total_bytes\":768,\"extra\":1"),
                 "extra: unknown field");
  expect_refused(edit("\"dtype\":\"bf16\"", "\"dtype\":\"bf17\""), "tensors[0].dtype: unknown");
  expect_refused(edit("fedcba9876543210", "fedcba987654321g"), "tensors[0].checksum:");
  expect_refused(edit("\"wsync_manifest\":1", "\"wsync_manifest\":2"), "wsync_manifest:");
  expect_refused(edit("\"shape\":[4,8]", "\"shape\":[4,\"8\"]"), "tensors[0].shape[1]:");
  expect_refused(edit("\"segments\":[{\"nbytes\":512}", "\"segments\":[{\"nbytes\":-1}"),
                 "segments[0].nbytes:");
  expect_refused("{\"wsync_manifest\":1", "manifest: not valid JSON");
  expect_refused("[1,2]", "manifest: expected a JSON object");
  auto handle = text.find("\"transport_handle\":\"");
  ASSERT_NE(handle, std::string::npos);
  auto bad = text;
  bad.insert(handle + 20, "*");
  expect_refused(bad, "transport_handle:");
}

TEST(codec, torch_dtype_names_are_read) {
  auto text = manifest_to_json(full_manifest());
  text.replace(text.find("\"bf16\""), 6, "\"bfloat16\"");
  auto m = manifest_from_json(text);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->tensors[0].dtype, dtype::bf16);
}

RC_GTEST_PROP(codec, round_trip_property, ()) {
  weight_update_manifest m;
  auto printable = rc::gen::container<std::string>(rc::gen::inRange<char>(32, 127));
  m.update_id = *printable;
  m.model_id = *printable;
  m.weight_version = *rc::gen::arbitrary<std::uint64_t>();
  m.source_worker = *printable;
  m.source_rank = *rc::gen::inRange(0, 1 << 20);
  m.transport = *printable;
  m.transport_handle = *rc::gen::arbitrary<std::string>();
  auto n = *rc::gen::inRange(0, 6);
  for (int i = 0; i < n; ++i) {
    tensor_descriptor t;
    t.name = *printable;
    t.dtype = static_cast<dtype>(*rc::gen::inRange(0, 12));
    t.shape =
        *rc::gen::container<std::vector<std::int64_t>>(rc::gen::inRange<std::int64_t>(-5, 1000));
    t.strides = *rc::gen::container<std::vector<std::int64_t>>(rc::gen::arbitrary<std::int64_t>());
    t.nbytes = *rc::gen::arbitrary<std::uint64_t>();
    t.device = *printable;
    t.segment = *rc::gen::arbitrary<std::uint32_t>();
    t.offset = *rc::gen::arbitrary<std::uint64_t>();
    t.checksum = *rc::gen::arbitrary<std::uint64_t>();
    m.tensors.push_back(t);
    m.segments.push_back({*rc::gen::arbitrary<std::uint64_t>()});
  }
  m.metadata = *rc::gen::container<std::map<std::string, std::string>>(printable, printable);
  m.total_bytes = *rc::gen::arbitrary<std::uint64_t>();
  auto back = manifest_from_json(manifest_to_json(m));
  RC_ASSERT(back.has_value());
  RC_ASSERT(*back == m);
}

RC_GTEST_PROP(codec, arbitrary_input_never_crashes, ()) {
  auto text = *rc::gen::oneOf(rc::gen::arbitrary<std::string>(),
                              rc::gen::map(rc::gen::arbitrary<std::string>(), [](std::string s) {
                                // Mostly-valid input: a real manifest with a random slice replaced.
                                auto base = manifest_to_json(full_manifest());
                                auto at = s.size() % base.size();
                                return base.substr(0, at) + s +
                                       base.substr(std::min(base.size(), at + s.size() % 7));
                              }));
  auto r = manifest_from_json(text);
  if (!r) RC_ASSERT(r.error().code == errc::invalid_manifest);
}

}  // namespace
}  // namespace wsync
