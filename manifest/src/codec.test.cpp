#include "wsync/manifest/codec.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/codec_json.hpp"
#include "wsync/manifest/json_bounded.hpp"
#include "wsync/manifest/validate.hpp"

// GCC 12 at -O3 reports -Wrestrict inside std::string copies it inlined into this file: a known
// false positive (GCC bug 105651; the strings never overlap). A plain Release build must pass.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

namespace wsync {
namespace {

// `text` in double quotes.
std::string quoted(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  out += text;
  out += '"';
  return out;
}

weight_update_manifest full_manifest() {
  weight_update_manifest m;
  m.update_id = "u-0190a3f5e2c-00112233445566778899aabbccddeeff";
  m.model_id = "org/model-7b";
  m.weight_version = std::numeric_limits<std::uint64_t>::max() - 1;
  m.source_worker = "trainer-3:4242";
  m.source_rank = 3;
  m.transport = "shared-memory";
  for (int b = 0; b < 256; ++b) m.transport_handle.push_back(static_cast<char>(b));
  m.tensors = {{"w", dtype::bf16, {4, 8}, {1, 4}, 64, "cuda:1", 0, 256, 0xfedcba9876543210ull},
               {"b", dtype::fp8_e5m2, {0}, {}, 0, "cpu", 1, 0, 0},
               {"layers.0.mlp.weight",
                dtype::i64,
                {2, 3},
                {3, 1},
                48,
                "cpu",
                1,
                256,
                0x8000000000000001ull}};
  m.segments = {{512}, {512}};
  m.metadata = {{"step", "1200"}, {"note", "\xc3\xbcn\xc3\xaf \"quoted\" \\ back/slash"}};
  m.total_bytes = 1024;
  return m;
}

// The input is refused with invalid_manifest and the message starts "invalid manifest: <prefix>".
void expect_refused(const std::string& text, const std::string& prefix) {
  auto r = manifest_from_json(text);
  ASSERT_FALSE(r) << "accepted: " << text;
  EXPECT_EQ(r.error().code, errc::invalid_manifest);
  EXPECT_EQ(r.error().message.rfind("invalid manifest: " + prefix, 0), 0u) << r.error().message;
  EXPECT_NE(r.error().message.find("update_id="), std::string::npos) << r.error().message;
  EXPECT_NE(r.error().message.find("rank="), std::string::npos) << r.error().message;
}

// The full manifest's JSON with the first occurrence of `from` replaced by `to`.
std::string edited(const std::string& from, const std::string& to) {
  auto text = manifest_to_json(full_manifest());
  auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from << " not in " << text;
  if (at == std::string::npos) return text;
  return text.replace(at, from.size(), to);
}

TEST(codec, full_manifest_is_valid) {
  auto r = manifest_validate(full_manifest());
  EXPECT_TRUE(r) << r.error().message;
}

TEST(codec, round_trips_every_field_exactly) {
  auto m = full_manifest();
  auto text = manifest_to_json(m);
  auto back = manifest_from_json(text);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, m);
  EXPECT_EQ(back->transport_handle.size(), 256u);
  EXPECT_EQ(back->weight_version, std::numeric_limits<std::uint64_t>::max() - 1);
  EXPECT_EQ(back->tensors[0].checksum, 0xfedcba9876543210ull);
  EXPECT_EQ(back->tensors[0].strides, (std::vector<std::int64_t>{1, 4}));
  EXPECT_EQ(manifest_to_json(*back), text);
  // 64-bit checksums travel as hex text, never as JSON numbers.
  EXPECT_NE(text.find("\"checksum\":\"fedcba9876543210\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"checksum\":\"0000000000000000\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"wsync_manifest\":1"), std::string::npos) << text;
}

TEST(codec, round_trips_extreme_integers) {
  auto m = full_manifest();
  m.weight_version = std::numeric_limits<std::uint64_t>::max();
  m.total_bytes = std::numeric_limits<std::uint64_t>::max();
  m.source_rank = std::numeric_limits<std::int32_t>::max();
  m.tensors[0].shape = {std::numeric_limits<std::int64_t>::max(), 0};
  m.tensors[0].strides = {std::numeric_limits<std::int64_t>::min(), -1};
  m.tensors[0].segment = std::numeric_limits<std::uint32_t>::max();
  m.tensors[0].offset = std::numeric_limits<std::uint64_t>::max();
  m.tensors[0].nbytes = std::numeric_limits<std::uint64_t>::max();
  m.tensors[0].checksum = std::numeric_limits<std::uint64_t>::max();
  auto back = manifest_from_json(manifest_to_json(m));
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, m);
}

TEST(codec, round_trips_every_handle_length_mod_3) {
  for (std::size_t n = 0; n < 8; ++n) {
    auto m = full_manifest();
    m.transport_handle.assign(n, '\xff');
    if (n > 1) m.transport_handle[1] = '\0';
    auto back = manifest_from_json(manifest_to_json(m));
    ASSERT_TRUE(back) << n << ": " << back.error().message;
    EXPECT_EQ(back->transport_handle, m.transport_handle) << n;
  }
}

TEST(codec, round_trips_empty_collections) {
  weight_update_manifest m;  // every field at its default
  auto back = manifest_from_json(manifest_to_json(m));
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, m);
}

TEST(codec, missing_field_is_named) {
  expect_refused(edited("\"model_id\":", "\"modelid\":"), "model_id: missing");
  expect_refused(edited(",\"wsync_manifest\":1", ""), "wsync_manifest: missing");
  expect_refused(edited("\"name\":\"w\",", ""), "tensors[0].name: missing");
  expect_refused(edited("\"checksum\":\"fedcba9876543210\"", "\"crc\":\"fedcba9876543210\""),
                 "tensors[0].checksum: missing");
  expect_refused(edited("{\"nbytes\":512}", "{}"), "segments[0].nbytes: missing");
}

TEST(codec, missing_field_error_names_the_update) {
  auto r = manifest_from_json(edited("\"model_id\":", "\"modelid\":"));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message.rfind("invalid manifest: model_id: missing", 0), 0u)
      << r.error().message;
  EXPECT_NE(r.error().message.find("update_id=" + full_manifest().update_id), std::string::npos)
      << r.error().message;
}

TEST(codec, wrong_type_is_named) {
  expect_refused(edited("\"source_rank\":3", "\"source_rank\":\"3\""), "source_rank: expected");
  expect_refused(edited("\"model_id\":\"org/model-7b\"", "\"model_id\":7"), "model_id: expected");
  expect_refused(edited("\"total_bytes\":1024", "\"total_bytes\":-1"),
                 "total_bytes: expected a non-negative integer");
  expect_refused(edited("\"total_bytes\":1024", "\"total_bytes\":1024.5"), "total_bytes: expected");
  expect_refused(edited("\"shape\":[4,8]", "\"shape\":[4,\"8\"]"), "tensors[0].shape[1]:");
  expect_refused(edited("\"shape\":[4,8]", "\"shape\":{}"), "tensors[0].shape: expected");
  expect_refused(edited("\"strides\":[1,4]", "\"strides\":[1,9223372036854775808]"),
                 "tensors[0].strides[1]: out of range");
  expect_refused(edited("\"segment\":0", "\"segment\":4294967296"),
                 "tensors[0].segment: out of range");
  expect_refused(edited("\"source_rank\":3", "\"source_rank\":2147483648"),
                 "source_rank: out of range");
  expect_refused(edited("{\"nbytes\":512}", "{\"nbytes\":-1}"), "segments[0].nbytes:");
  expect_refused(edited("\"tensors\":[", "\"tensors\":[7,"), "tensors[0]: expected an object");
  expect_refused(edited("\"segments\":[", "\"segments\":[\"x\","), "segments[0]: expected");
  expect_refused(edited("\"metadata\":{", "\"metadata\":{\"n\":1,"), "metadata.n: expected");
  expect_refused(edited("\"metadata\":{", "\"metadata\":[],\"x\":{"), "metadata: expected");
}

TEST(codec, unknown_field_is_named) {
  expect_refused(edited("\"total_bytes\":1024", "\"total_bytes\":1024,\"extra\":1"),
                 "extra: unknown field");
  expect_refused(edited("\"name\":\"w\"", "\"name\":\"w\",\"stride\":[]"),
                 "tensors[0].stride: unknown field");
  expect_refused(edited("{\"nbytes\":512}", "{\"nbytes\":512,\"pad\":0}"),
                 "segments[0].pad: unknown field");
}

TEST(codec, unknown_dtype_is_named) {
  expect_refused(edited("\"dtype\":\"bf16\"", "\"dtype\":\"bf17\""),
                 "tensors[0].dtype: unknown dtype \"bf17\"");
  expect_refused(edited("\"dtype\":\"bf16\"", "\"dtype\":\"\""), "tensors[0].dtype: unknown");
}

TEST(codec, torch_dtype_names_are_read) {
  auto m = manifest_from_json(edited("\"bf16\"", "\"bfloat16\""));
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->tensors[0].dtype, dtype::bf16);
}

TEST(codec, bad_checksum_hex_is_named) {
  for (const char* bad : {"fedcba987654321g", "FEDCBA9876543210", "fedcba987654321",
                          "fedcba98765432100", "", "0xfedcba98765432"}) {
    SCOPED_TRACE(bad);
    expect_refused(edited("\"fedcba9876543210\"", quoted(bad)), "tensors[0].checksum:");
  }
  expect_refused(edited("\"fedcba9876543210\"", "18364758544493064720"),
                 "tensors[0].checksum: expected a string");
}

TEST(codec, bad_base64_handle_is_named) {
  auto text = manifest_to_json(full_manifest());
  auto at = text.find("\"transport_handle\":\"");
  ASSERT_NE(at, std::string::npos);
  at += 20;
  auto bad = text;
  bad.insert(at, "*");
  expect_refused(bad, "transport_handle: not valid base64");
  for (const char* handle : {"QQ", "Q===", "QQ==QQ==", "QQ=A", "QUJD\\n", "QU JD"}) {
    SCOPED_TRACE(handle);
    auto m = full_manifest();
    m.transport_handle = "x";
    auto t = manifest_to_json(m);
    expect_refused(t.replace(t.find("\"eA==\""), 6, quoted(handle)),
                   "transport_handle: not valid base64");
  }
}

TEST(codec, not_json_at_all) {
  for (const char* text : {"", "not json", "{\"wsync_manifest\":1", "{]", "\xff\xfe"}) {
    SCOPED_TRACE(text);
    expect_refused(text, "manifest: not valid JSON");
  }
  expect_refused("[1,2]", "manifest: expected a JSON object");
  expect_refused("null", "manifest: expected a JSON object");
  expect_refused("42", "manifest: expected a JSON object");
}

// An error names the rank the manifest gives, and none where it gives none: 0 would name a rank
// the text never said.
TEST(codec, errors_name_the_manifests_rank_or_none) {
  auto none = manifest_from_json("not json");
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message.find("(update_id=<none> rank=<none>)"), std::string::npos)
      << none.error().message;
  auto m = full_manifest();
  m.source_rank = 3;
  auto bad = manifest_from_json(manifest_to_json(m).replace(0, 1, "{\"x\":1,"));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find(" rank=3)"), std::string::npos) << bad.error().message;
}

TEST(codec, trailing_garbage_is_refused) {
  expect_refused(manifest_to_json(full_manifest()) + "x", "manifest: not valid JSON");
}

TEST(codec, wrong_format_version_is_refused) {
  expect_refused(edited("\"wsync_manifest\":1", "\"wsync_manifest\":2"),
                 "wsync_manifest: format 2 is not supported (want 1)");
  expect_refused(edited("\"wsync_manifest\":1", "\"wsync_manifest\":0"),
                 "wsync_manifest: format 0 is not supported");
  expect_refused(edited("\"wsync_manifest\":1", "\"wsync_manifest\":\"1\""),
                 "wsync_manifest: expected");
  expect_refused(edited("\"wsync_manifest\":1", "\"wsync_manifest\":4294967297"),
                 "wsync_manifest: out of range");
}

TEST(codec, deeply_nested_input_is_refused_at_the_parse) {
  // nlohmann parses any depth, but dump(), copies and comparisons recurse: refused up front.
  const std::string why = "manifest: nested deeper than 64 levels";
  std::string deep(200000, '[');
  expect_refused(deep, why);
  deep += std::string(200000, ']');
  expect_refused(deep, why);
  auto nested = edited("\"metadata\":{", "\"metadata\":{\"deep\":" + std::string(100000, '[') +
                                             std::string(100000, ']') + ",");
  expect_refused(nested, why);
  // wsync's own documents nest a few levels: 64 is far from them. The limit, exactly: the
  // manifest's object and metadata's, then 63 arrays are 65 levels (the outermost counts 0).
  auto shallow = edited("\"metadata\":{", "\"metadata\":{\"deep\":" + std::string(63, '[') +
                                              std::string(63, ']') + ",");
  expect_refused(shallow, "metadata.deep: expected a string");
  auto just_over = edited("\"metadata\":{", "\"metadata\":{\"deep\":" + std::string(64, '[') +
                                                std::string(64, ']') + ",");
  expect_refused(just_over, why);
  // Brackets inside strings nest nothing, escaped quotes included.
  auto in_text =
      edited("\"metadata\":{", "\"metadata\":{\"deep\":\"\\\"" + std::string(100000, '[') + "\",");
  auto parsed = manifest_from_json(in_text);
  ASSERT_TRUE(parsed) << parsed.error().message;
  EXPECT_EQ(parsed->metadata.at("deep").size(), 100001u);
}

TEST(codec, a_tensor_list_past_the_limit_is_refused_before_it_is_sized) {
  // "{}," is three bytes of body and a tensor descriptor each: refused at the count.
  std::string many;
  many.reserve(3 * (manifest_limits{}.max_tensors + 1));
  for (std::uint64_t i = 0; i <= manifest_limits{}.max_tensors; ++i) many += i ? ",{}" : "{}";
  auto text = edited("\"tensors\":[", "\"tensors\":[" + many + ",");
  expect_refused(text, "tensors: more than 1048576 tensors");
}

TEST(json_bounded, reads_every_kind_of_value_as_nlohmann_does) {
  const std::string text =
      R"({"a":[1,-2,3.5,1e300,18446744073709551615,true,false,null,"s\u00fc\"x"],)"
      R"("b":{"c":{},"d":[],"e":[[{"f":"g"}]]},"k":"v","k2":-9223372036854775808})";
  const auto ours = json_parse_bounded(text);
  ASSERT_FALSE(ours.is_discarded());
  EXPECT_EQ(ours, nlohmann::json::parse(text));
  EXPECT_EQ(json_parse_bounded("7"), nlohmann::json(7));
  EXPECT_EQ(json_parse_bounded(R"("top")"), nlohmann::json("top"));
  for (const char* bad : {"", "{", "[1,]", "{\"a\":1}x", "\"\xff\"", "{1:2}"}) {
    EXPECT_TRUE(json_parse_bounded(bad).is_discarded()) << bad;
  }
}

TEST(json_bounded, nesting_is_refused_where_anything_lies_inside_65_containers) {
  bool deep = false;
  const std::string open(65, '['), close(65, ']');
  EXPECT_FALSE(json_parse_bounded(open + close, &deep).is_discarded());
  EXPECT_FALSE(deep);
  EXPECT_TRUE(json_parse_bounded(open + "1" + close, &deep).is_discarded());
  EXPECT_TRUE(deep);
  EXPECT_TRUE(json_parse_bounded(std::string(64, '[') + "{\"k\":1}" + std::string(64, ']'), &deep)
                  .is_discarded());
  EXPECT_TRUE(deep);
  EXPECT_FALSE(
      json_parse_bounded(std::string(64, '[') + "1" + std::string(64, ']'), &deep).is_discarded());
  EXPECT_FALSE(deep);
}

TEST(json_bounded, a_key_given_twice_is_named_with_its_object_depth) {
  std::string twice;
  std::size_t depth = 0;
  EXPECT_TRUE(json_parse_bounded(R"({"a":{"b":1,"b":2}})", nullptr, &twice, &depth).is_discarded());
  EXPECT_EQ(twice, "b");
  EXPECT_EQ(depth, 2u);
  EXPECT_TRUE(json_parse_bounded(R"({"":1,"":2})", nullptr, &twice, &depth).is_discarded());
  EXPECT_EQ(twice, "");
  EXPECT_EQ(depth, 1u);
  // Without asking, the last value is kept, as nlohmann's parse keeps it.
  EXPECT_EQ(json_parse_bounded(R"({"a":1,"a":2})")["a"], 2);
}

// --- properties ---------------------------------------------------------------------------

rc::Gen<std::string> gen_printable() {
  return rc::gen::container<std::string>(rc::gen::inRange<char>(32, 127));
}

weight_update_manifest gen_manifest() {
  weight_update_manifest m;
  m.update_id = *gen_printable();
  m.model_id = *gen_printable();
  m.weight_version = *rc::gen::arbitrary<std::uint64_t>();
  m.source_worker = *gen_printable();
  // Negative ranks are refused by validation and have no JSON form (the field is unsigned).
  m.source_rank = *rc::gen::inRange(0, std::numeric_limits<std::int32_t>::max());
  m.transport = *gen_printable();
  m.transport_handle = *rc::gen::container<std::string>(rc::gen::arbitrary<char>());
  const auto n = *rc::gen::inRange(0, 6);
  for (int i = 0; i < n; ++i) {
    tensor_descriptor t;
    t.name = *gen_printable();
    t.dtype = static_cast<dtype>(*rc::gen::inRange(0, 12));
    t.shape = *rc::gen::container<std::vector<std::int64_t>>(rc::gen::arbitrary<std::int64_t>());
    t.strides = *rc::gen::container<std::vector<std::int64_t>>(rc::gen::arbitrary<std::int64_t>());
    t.nbytes = *rc::gen::arbitrary<std::uint64_t>();
    t.device = *gen_printable();
    t.segment = *rc::gen::arbitrary<std::uint32_t>();
    t.offset = *rc::gen::arbitrary<std::uint64_t>();
    t.checksum = *rc::gen::arbitrary<std::uint64_t>();
    m.tensors.push_back(std::move(t));
  }
  m.segments = *rc::gen::container<std::vector<segment_descriptor>>(
      rc::gen::map(rc::gen::arbitrary<std::uint64_t>(),
                   [](std::uint64_t size) { return segment_descriptor{size}; }));
  m.metadata =
      *rc::gen::container<std::map<std::string, std::string>>(gen_printable(), gen_printable());
  m.total_bytes = *rc::gen::arbitrary<std::uint64_t>();
  return m;
}

// m with every quote and backslash in its text made '_': text the writer writes unescaped,
// which the plain lexer reads.
weight_update_manifest unescaped(weight_update_manifest m) {
  auto fix = [](std::string s) {
    std::replace_if(
        s.begin(), s.end(), [](char c) { return c == '"' || c == '\\'; }, '_');
    return s;
  };
  for (auto* s : {&m.update_id, &m.model_id, &m.source_worker, &m.transport}) *s = fix(*s);
  for (auto& t : m.tensors) {
    t.name = fix(t.name);
    t.device = fix(t.device);
  }
  std::map<std::string, std::string> metadata;
  for (const auto& [k, v] : m.metadata) metadata.emplace(fix(k), fix(v));
  m.metadata = std::move(metadata);
  return m;
}

RC_GTEST_PROP(codec, round_trip_property, ()) {
  auto m = gen_manifest();
  auto text = manifest_to_json(m);
  auto back = manifest_from_json(text);
  RC_ASSERT(back.has_value());
  RC_ASSERT(*back == m);
  RC_ASSERT(manifest_to_json(*back) == text);
  const auto plain = unescaped(m);
  auto read = detail::manifest_from_plain_json(manifest_to_json(plain));
  RC_ASSERT(read.has_value());
  RC_ASSERT(*read == plain);
}

// The manifest as nlohmann's dump() writes it (what manifest_to_json did before it wrote the
// text itself): the reference the writer must match byte for byte.
std::string reference_json(const weight_update_manifest& m) {
  using json = nlohmann::json;
  json tensors = json::array();
  for (const auto& t : m.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", dtype_name(t.dtype)},
                       {"shape", t.shape},
                       {"strides", t.strides},
                       {"nbytes", t.nbytes},
                       {"device", t.device},
                       {"segment", t.segment},
                       {"offset", t.offset},
                       {"checksum", checksum_hex(t.checksum)}});
  }
  json segments = json::array();
  for (const auto& seg : m.segments) segments.push_back({{"nbytes", seg.nbytes}});
  // transport_handle travels as base64: take the writer's (any bytes, tested by the round trip).
  auto written = json::parse(manifest_to_json(m), nullptr, false);
  json j = {{"wsync_manifest", 1},
            {"update_id", m.update_id},
            {"model_id", m.model_id},
            {"weight_version", m.weight_version},
            {"source_worker", m.source_worker},
            {"source_rank", m.source_rank},
            {"transport", m.transport},
            {"transport_handle", written.is_object() ? written["transport_handle"] : json()},
            {"tensors", std::move(tensors)},
            {"segments", std::move(segments)},
            {"metadata", m.metadata},
            {"total_bytes", m.total_bytes}};
  if (m.checksum_method != checksum_method{}) {
    j["checksum"] = {{"algorithm", checksum_algorithm_name(m.checksum_method.algorithm)},
                     {"chunk_bytes", m.checksum_method.chunk_bytes}};
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

TEST(codec, writes_what_a_json_library_would_write) {
  auto m = full_manifest();
  EXPECT_EQ(manifest_to_json(m), reference_json(m));
  m.checksum_method = {checksum_algorithm::xxh3_64_chunked, 1 << 20};
  m.tensors[0].name = "ctl\x01\x1f tab\t nl\n del\x7f \"q\" \\ \xe2\x82\xac";
  m.tensors[1].name = "bad utf-8 \xff\xc3";  // replaced, as the library replaces it
  m.metadata["\"key\"\n"] = "\x02";
  EXPECT_EQ(manifest_to_json(m), reference_json(m));
  m.metadata.clear();
  m.tensors.clear();
  m.segments.clear();
  EXPECT_EQ(manifest_to_json(m), reference_json(m));
}

RC_GTEST_PROP(codec, the_writer_matches_the_library_on_any_bytes, ()) {
  auto m = gen_manifest();
  auto any = [] {
    return *rc::gen::container<std::string>(rc::gen::arbitrary<char>());
  };
  m.update_id = any();
  m.source_worker = any();
  if (!m.tensors.empty()) m.tensors[0].name = any();
  m.metadata[any()] = any();
  if (*rc::gen::arbitrary<bool>()) {
    m.checksum_method = {checksum_algorithm::xxh3_64_chunked, *rc::gen::arbitrary<std::uint64_t>()};
  }
  RC_ASSERT(manifest_to_json(m) == reference_json(m));
}

// The decoder's two paths give the same answer: the same manifest, or the same error.
void expect_same_answer(const std::string& text) {
  auto fast = manifest_from_json(text);
  auto slow = detail::manifest_from_json_document(text);
  // Parsed already (inside an HTTP body): read as it stands, with the same answer.
  if (auto parsed = json_parse_bounded(text); !parsed.is_discarded()) {
    auto value = manifest_from_json_value(parsed);
    RC_ASSERT(value.has_value() == slow.has_value());
    if (value) {
      RC_ASSERT(*value == *slow);
    } else {
      RC_ASSERT(value.error().message == slow.error().message);
    }
  }
  if (auto plain = detail::manifest_from_plain_json(text)) {
    RC_ASSERT(slow.has_value());
    RC_ASSERT(*plain == *slow);
  }
  RC_ASSERT(fast.has_value() == slow.has_value());
  if (fast) {
    RC_ASSERT(*fast == *slow);
  } else {
    RC_ASSERT(fast.error().message == slow.error().message);
  }
}

RC_GTEST_PROP(codec, both_decoder_paths_agree_on_a_manifest_however_mangled, ()) {
  auto m = gen_manifest();
  if (*rc::gen::arbitrary<bool>()) m = unescaped(std::move(m));  // the plain lexer's text
  if (*rc::gen::arbitrary<bool>()) {
    m.checksum_method = {checksum_algorithm::xxh3_64_chunked, *rc::gen::arbitrary<std::uint64_t>()};
  }
  auto text = manifest_to_json(m);
  expect_same_answer(text);
  // Damage it: bytes replaced, removed or repeated, or a stretch swapped for common JSON.
  const auto edits = *rc::gen::inRange(1, 4);
  for (int e = 0; e < edits && !text.empty(); ++e) {
    const auto at = *rc::gen::inRange<std::size_t>(0, text.size());
    const auto len = *rc::gen::inRange<std::size_t>(0, std::min<std::size_t>(12, text.size() - at));
    switch (*rc::gen::inRange(0, 4)) {
      case 0:
        text[at] = *rc::gen::element(',', ':', '"', '{', '}', '[', ']', '-', '1', 'x', '.', ' ');
        break;
      case 1:
        text.erase(at, len);
        break;
      case 2:
        text.insert(at, text.substr(at, len));
        break;
      default:
        text.replace(at, len,
                     *rc::gen::element<std::string>(
                         "null", "true", "-1", "1.5", "\"\"", "{}", "[]", "\"x\":1,",
                         "18446744073709551616", "01", "-0", "1e5", " \t\r\n", "\\n", "\\u0041",
                         "\xc3\xa9", "\x01", "-9223372036854775808", "-9223372036854775809", "0"));
    }
  }
  expect_same_answer(text);
}

// The plain lexer reads what the writer writes, and JSON laid out otherwise; it leaves
// escapes, non-ASCII text, fractions and the like to the library's lexer, which reads them the
// same way the document does.
TEST(codec, the_plain_lexer_reads_plain_json_and_leaves_the_rest) {
  auto m = full_manifest();
  m.metadata = {{"step", "1200"}};
  m.tensors[2].shape = {2, -3};
  const auto text = manifest_to_json(m);
  auto plain = detail::manifest_from_plain_json(text);
  ASSERT_TRUE(plain);
  EXPECT_EQ(*plain, m);
  const auto pretty = nlohmann::json::parse(text).dump(2);  // spaces and newlines between tokens
  plain = detail::manifest_from_plain_json(pretty);
  ASSERT_TRUE(plain);
  EXPECT_EQ(*plain, m);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"step\":\"1200\"", "\"step\":\"12\\u0030\""},  // an escape
           {"\"step\":\"1200\"", "\"step\":\"\xc3\xa9\""},   // UTF-8
           {"\"nbytes\":512", "\"nbytes\":5.12e2"},          // a fraction
           {"\"source_rank\":3", "\"source_rank\":03"},      // not JSON
           {"[2,-3]", "[2,-0]"}}) {
    auto variant = text;
    const auto at = variant.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    variant.replace(at, from.size(), to);
    SCOPED_TRACE(to);
    EXPECT_FALSE(detail::manifest_from_plain_json(variant));
    auto got = manifest_from_json(variant);
    auto reference = detail::manifest_from_json_document(variant);
    ASSERT_EQ(got.has_value(), reference.has_value());
    if (got) {
      EXPECT_EQ(*got, *reference);
    }
  }
}

TEST(codec, a_key_given_twice_is_refused_not_read_as_its_last_value) {
  const auto text = manifest_to_json(full_manifest());
  // At the top (the id another parser would read as the first) and inside a tensor.
  for (const auto& [variant, key] : std::vector<std::pair<std::string, std::string>>{
           {"{\"update_id\":\"u-other\"," + text.substr(1), "update_id"},
           {edited("\"segment\":0", "\"segment\":0,\"segment\":0"), "segment"},
       }) {
    auto got = manifest_from_json(variant);
    ASSERT_FALSE(got) << variant.substr(0, 80);
    EXPECT_EQ(got.error().code, errc::invalid_manifest);
    EXPECT_NE(got.error().message.find("key \"" + key + "\" given twice in one object"),
              std::string::npos)
        << got.error().message;
  }
}

TEST(codec, both_decoder_paths_agree_on_fields_out_of_order_repeated_or_unknown) {
  const auto text = manifest_to_json(full_manifest());
  for (const auto& variant : std::vector<std::string>{
           text,
           // A key repeated: refused by both.
           "{\"model_id\":\"first\"," + text.substr(1),
           // Fields out of order.
           "{\"wsync_manifest\":1," + text.substr(1, text.rfind(",\"wsync_manifest\"") - 1) + "}",
           // Unknown, missing and mistyped fields, and a format from the future.
           "{\"extra\":1," + text.substr(1),
           edited("\"wsync_manifest\":1", "\"wsync_manifest\":2"),
           edited("\"source_rank\":3", "\"source_rank\":-3"),
           edited("\"segment\":0", "\"segment\":4294967296"),
           edited("\"metadata\":{", "\"metadata\":{\"step\":\"x\","),
           edited(",\"total_bytes\":1024", ""),
       }) {
    SCOPED_TRACE(variant.substr(0, 80));
    auto fast = manifest_from_json(variant);
    auto slow = detail::manifest_from_json_document(variant);
    ASSERT_EQ(fast.has_value(), slow.has_value());
    if (fast) {
      EXPECT_EQ(*fast, *slow);
    } else {
      EXPECT_EQ(fast.error().message, slow.error().message);
    }
  }
}

RC_GTEST_PROP(codec, arbitrary_strings_never_crash_the_decoder, (const std::string& text)) {
  auto r = manifest_from_json(text);
  if (!r) {
    RC_ASSERT(r.error().code == errc::invalid_manifest);
    RC_ASSERT(r.error().message.rfind("invalid manifest: ", 0) == 0u);
  }
}

RC_GTEST_PROP(codec, arbitrary_bytes_never_crash_the_decoder, ()) {
  auto text = *rc::gen::container<std::string>(rc::gen::arbitrary<char>());
  auto r = manifest_from_json(text);
  if (!r) RC_ASSERT(r.error().code == errc::invalid_manifest);
}

// Mostly-valid input: a real manifest's JSON with a random slice replaced, so the decoder gets
// past the parser and into field checks.
RC_GTEST_PROP(codec, spliced_manifests_never_crash_the_decoder, ()) {
  auto base = manifest_to_json(*rc::gen::oneOf(rc::gen::just(full_manifest()),
                                               rc::gen::exec([] { return gen_manifest(); })));
  auto at = *rc::gen::inRange<std::size_t>(0, base.size() + 1);
  auto cut = *rc::gen::inRange<std::size_t>(0, 8);
  auto insert =
      *rc::gen::oneOf(rc::gen::arbitrary<std::string>(),
                      rc::gen::elementOf(std::vector<std::string>{
                          "\"", "{", "}", "[", "]", ",", ":", "-1", "1e400", "null", "true",
                          "\"x\":", "18446744073709551616", "\\u0000", "\\ud800"}));
  auto text = base.substr(0, at) + insert + base.substr(std::min(base.size(), at + cut));
  auto r = manifest_from_json(text);
  if (!r) {
    RC_ASSERT(r.error().code == errc::invalid_manifest);
    RC_ASSERT(r.error().message.rfind("invalid manifest: ", 0) == 0u);
  }
}

}  // namespace
}  // namespace wsync

namespace wsync {
namespace {

TEST(codec, the_checksum_method_round_trips_and_its_absence_means_xxh3_64) {
  auto plain = manifest_to_json(full_manifest());
  EXPECT_EQ(plain.find("\"checksum\":{"), std::string::npos) << "xxh3-64 is written as before";
  auto m = full_manifest();
  m.checksum_method = {checksum_algorithm::xxh3_64_chunked, 1 << 20};
  auto text = manifest_to_json(m);
  EXPECT_NE(text.find("\"checksum\":{\"algorithm\":\"xxh3-64-chunked\",\"chunk_bytes\":1048576}"),
            std::string::npos)
      << text;
  auto back = manifest_from_json(text);
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, m);
  auto old = manifest_from_json(plain);
  ASSERT_TRUE(old) << old.error().message;
  EXPECT_EQ(old->checksum_method, checksum_method{});
}

TEST(codec, a_bad_checksum_method_is_named) {
  auto m = full_manifest();
  m.checksum_method = {checksum_algorithm::xxh3_64_chunked, 4096};
  auto text = manifest_to_json(m);
  auto edit = [&](const std::string& from, const std::string& to) {
    auto t = text;
    return t.replace(t.find(from), from.size(), to);
  };
  expect_refused(edit("\"xxh3-64-chunked\"", "\"crc32\""),
                 "checksum.algorithm: \"crc32\" is neither xxh3-64 nor xxh3-64-chunked");
  expect_refused(edit("\"chunk_bytes\":4096", "\"chunk_bytes\":4096,\"seed\":1"),
                 "checksum.seed: unknown field");
  expect_refused(edit("\"chunk_bytes\":4096", "\"chunk_bytes\":-1"), "checksum.chunk_bytes:");
}

}  // namespace
}  // namespace wsync
