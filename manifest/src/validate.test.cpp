#include "wsync/manifest/validate.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "wsync/manifest/codec.hpp"

// GCC 12 at -O3 reports -Wrestrict inside std::string copies it inlined into this file: a known
// false positive (GCC bug 105651; the strings never overlap). A plain Release build must pass.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

namespace wsync {
namespace {

constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
constexpr std::uint64_t uint64_max = std::numeric_limits<std::uint64_t>::max();

weight_update_manifest valid_manifest() {
  weight_update_manifest m;
  m.update_id = "u-test-1";
  m.model_id = "org/model";
  m.weight_version = 3;
  m.source_worker = "host:1";
  m.source_rank = 2;
  m.transport = "local-clone";
  m.transport_handle = "h";
  // segment 0: a [16,16] f32 (1024 B) at 0, a [10] bf16 (20 B) at 1024; segment 1: 512 B u8.
  m.tensors = {
      {"w", dtype::f32, {16, 16}, {}, 1024, "cpu", 0, 0, 1},
      {"b", dtype::bf16, {10}, {}, 20, "cpu", 0, 1024, 2},
      {"e", dtype::u8, {512}, {}, 512, "cuda:0", 1, 0, 3},
  };
  m.segments = {{1280}, {512}};
  m.metadata = {{"step", "7"}};
  m.total_bytes = 1792;
  return m;
}

bool only_local_clone(std::string_view name) {
  return name == "local-clone";
}

// The error is invalid_manifest, starts with "invalid manifest: <field>:" and names the update.
void expect_refused(const weight_update_manifest& m, const std::string& field,
                    const manifest_limits& limits = {}, bool (*known)(std::string_view) = nullptr) {
  auto r = manifest_validate(m, known, limits);
  ASSERT_FALSE(r) << "accepted; expected a refusal of " << field;
  EXPECT_EQ(r.error().code, errc::invalid_manifest);
  const auto& msg = r.error().message;
  EXPECT_EQ(msg.rfind("invalid manifest: " + field + ":", 0), 0u) << msg;
  EXPECT_NE(msg.find("update_id="), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank="), std::string::npos) << msg;
  EXPECT_NE(msg.find("(" + update_context(m) + ")"), std::string::npos) << msg;
}

void expect_accepted(const weight_update_manifest& m, const manifest_limits& limits = {},
                     bool (*known)(std::string_view) = nullptr) {
  auto r = manifest_validate(m, known, limits);
  EXPECT_TRUE(r) << r.error().message;
}

TEST(validate, accepts_a_consistent_manifest) {
  expect_accepted(valid_manifest());
  expect_accepted(valid_manifest(), {}, only_local_clone);
}

TEST(validate, accepts_a_transposed_view_within_nbytes) {
  auto m = valid_manifest();
  m.tensors[0].strides = {1, 16};  // column-major view of the same 1024 bytes
  expect_accepted(m);
  m.tensors[0].shape = {8, 32};  // a [32,8] tensor's .t(): reaches 7 + 31*8 + 1 = 256 elements
  m.tensors[0].strides = {1, 8};
  expect_accepted(m);
}

TEST(validate, accepts_explicit_row_major_strides) {
  auto m = valid_manifest();
  m.tensors[0].strides = {16, 1};
  expect_accepted(m);
}

TEST(validate, accepts_empty_and_scalar_tensors) {
  auto m = valid_manifest();
  m.tensors.push_back({"empty", dtype::f32, {0, 4}, {}, 0, "cpu", 1, 512, 0});
  m.tensors.push_back({"scalar", dtype::i64, {}, {}, 8, "cpu", 0, 1280, 0});
  m.segments[0].nbytes = 1536;
  m.total_bytes = 2048;
  expect_accepted(m);
}

TEST(validate, accepts_utf8_names) {
  auto m = valid_manifest();
  m.tensors[0].name = "caf\xc3\xa9.weight";
  expect_accepted(m);
}

TEST(validate, refuses_empty_name) {
  auto m = valid_manifest();
  m.tensors[1].name = "";
  expect_refused(m, "tensors[1].name");
}

TEST(validate, refuses_duplicate_names) {
  auto m = valid_manifest();
  m.tensors[2].name = "w";
  expect_refused(m, "tensors[2].name");
  auto r = manifest_validate(m);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("duplicate name \"w\""), std::string::npos) << r.error().message;
}

// Names spread over a table that grows past its first guess; each is new once and a duplicate
// after, empty names included (a free slot must not pass for one).
TEST(name_set, finds_every_duplicate_past_its_first_size) {
  std::vector<std::string> names = {""};
  for (int i = 0; i < 1000; ++i) names.push_back("model.layers." + std::to_string(i) + ".w");
  name_set set(3);
  for (const auto& n : names) EXPECT_TRUE(set.insert(n)) << n;
  for (const auto& n : names) EXPECT_FALSE(set.insert(n)) << n;
  EXPECT_FALSE(set.insert(std::string_view()));  // a default view is the empty name
  EXPECT_TRUE(set.contains(std::string_view()));
  EXPECT_FALSE(set.contains("model.layers.1000.w"));
  EXPECT_TRUE(set.insert("model.layers.1000.w"));
  EXPECT_TRUE(set.contains("model.layers.1000.w"));
}

TEST(validate, refuses_names_that_are_not_text) {
  auto m = valid_manifest();
  m.tensors[0].name = "bad\xff";
  expect_refused(m, "tensors[0].name");
  m.tensors[0].name = "tab\tname";
  expect_refused(m, "tensors[0].name");
  m.tensors[0].name = "cut\xc3";  // truncated two-byte sequence
  expect_refused(m, "tensors[0].name");
  // Not UTF-8 though shaped like it: the JSON writer would replace them, renaming the tensor
  // (and "a\xc0\x80", "a\xc1\x81" would become one name).
  for (const char* bad : {"w\xc0\x80", "w\xc1\x81", "w\xe0\x80\x80", "w\xed\xa0\x80",
                          "w\xf0\x80\x80\x80", "w\xf4\x90\x80\x80", "w\xf5\x80\x80\x80"}) {
    m.tensors[0].name = bad;
    expect_refused(m, "tensors[0].name");
  }
  // Control characters a terminal acts on when a log shows the name: DEL and the C1 range
  // (U+0080..U+009F; U+009B opens an escape sequence like ESC [ does).
  for (const char* bad : {"w\x7f", "w\xc2\x80", "w\xc2\x9b", "w\xc2\x9f"}) {
    m.tensors[0].name = bad;
    expect_refused(m, "tensors[0].name");
  }
  // The edges that are text: U+00A0, U+D7FF, U+E000, U+10FFFF, U+0800, U+10000.
  for (const char* good : {"w\xc2\xa0", "w~", "w\xed\x9f\xbf", "w\xee\x80\x80", "w\xf4\x8f\xbf\xbf",
                           "w\xe0\xa0\x80", "w\xf0\x90\x80\x80"}) {
    m.tensors[0].name = good;
    expect_accepted(m);
    auto back = manifest_from_json(manifest_to_json(m));  // and it round-trips exactly
    ASSERT_TRUE(back) << back.error().message;
    EXPECT_EQ(back->tensors[0].name, m.tensors[0].name);
  }
}

// The ASCII fast path reads eight bytes at a time: whatever the word or byte a bad or good
// character falls on, the answer is the byte-by-byte one.
TEST(validate, judges_text_the_same_at_every_position) {
  auto m = valid_manifest();
  for (std::size_t at = 0; at < 20; ++at) {
    const std::string head = "n" + std::string(at, 'a');
    const std::string tail(19 - at, 'z');
    for (const std::string bad : {"\x1f", "\x01", "\x7f", "\xff", "\x80", "\xc3", "\xc2\x9b"}) {
      m.tensors[0].name = head + bad + tail;
      expect_refused(m, "tensors[0].name");
    }
    for (const std::string good : {" ", "\xc2\xa0", "\xc3\xa9", "~", "\xf0\x90\x80\x80"}) {
      m.tensors[0].name = head + good + tail;
      expect_accepted(m);
    }
  }
}

TEST(validate, refuses_names_above_the_limit) {
  auto m = valid_manifest();
  manifest_limits limits;
  limits.max_name_bytes = 8;
  m.tensors[1].name = "123456789";
  m.model_id = "model";
  expect_refused(m, "tensors[1].name", limits);
}

TEST(validate, refuses_negative_shape_dimension) {
  auto m = valid_manifest();
  m.tensors[0].shape = {16, -16};
  expect_refused(m, "tensors[0].shape");
}

TEST(validate, refuses_shape_whose_element_count_overflows) {
  auto m = valid_manifest();
  m.tensors[0].shape = {int64_max, 4};
  expect_refused(m, "tensors[0].shape");
  m.tensors[0].shape = {std::int64_t{1} << 32, std::int64_t{1} << 32};  // exactly 2^64
  expect_refused(m, "tensors[0].shape");
  m.tensors[0].shape = {std::int64_t{1} << 62};  // fits in elements, not in bytes (x4)
  expect_refused(m, "tensors[0].shape");
}

TEST(validate, refuses_too_many_dimensions) {
  auto m = valid_manifest();
  m.tensors[2].shape = std::vector<std::int64_t>(17, 1);
  m.tensors[2].shape.back() = 512;
  expect_refused(m, "tensors[2].shape");
}

TEST(validate, refuses_nbytes_other_than_elements_times_itemsize) {
  auto m = valid_manifest();
  m.tensors[1].nbytes = 22;
  expect_refused(m, "tensors[1].nbytes");
  m.tensors[1].nbytes = 10;  // element count, not bytes
  expect_refused(m, "tensors[1].nbytes");
  m = valid_manifest();
  m.tensors[0].strides = {16, 1};  // explicit row-major strides are still contiguous
  m.tensors[0].nbytes = 1020;
  expect_refused(m, "tensors[0].nbytes");
}

TEST(validate, refuses_strides_of_the_wrong_length) {
  auto m = valid_manifest();
  m.tensors[0].strides = {16};
  expect_refused(m, "tensors[0].strides");
  m.tensors[0].strides = {16, 1, 1};
  expect_refused(m, "tensors[0].strides");
}

TEST(validate, refuses_negative_strides) {
  auto m = valid_manifest();
  m.tensors[0].strides = {-16, 1};
  expect_refused(m, "tensors[0].strides");
  m.tensors[0].strides = {1, -16};
  expect_refused(m, "tensors[0].strides");
}

TEST(validate, refuses_strides_reaching_outside_nbytes) {
  auto m = valid_manifest();
  m.tensors[0].strides = {32, 1};  // reaches 15*32 + 15 + 1 = 496 elements = 1984 B > 1024
  expect_refused(m, "tensors[0].strides");
  m.tensors[0].strides = {1, 17};  // reaches 15 + 15*17 + 1 = 271 elements = 1084 B > 1024
  expect_refused(m, "tensors[0].strides");
}

TEST(validate, refuses_strides_whose_reach_overflows) {
  auto m = valid_manifest();
  m.tensors[0].strides = {int64_max, 1};
  expect_refused(m, "tensors[0].strides");
  m.tensors[0].strides = {int64_max / 2, int64_max / 2};
  expect_refused(m, "tensors[0].strides");
}

// An empty tensor with strides: the row-major check must not overflow on the dimensions that
// follow the zero (signed overflow is undefined; UBSan aborts on it in the asan preset).
TEST(validate, empty_tensor_with_huge_dimensions_and_strides_does_not_overflow) {
  auto m = valid_manifest();
  m.tensors[0].shape = {0, std::int64_t{1} << 31, std::int64_t{1} << 31};
  m.tensors[0].strides = {std::int64_t{1} << 62, std::int64_t{1} << 31, 1};
  m.tensors[0].nbytes = 0;
  expect_accepted(m);
  // The same dimensions with the zero last: empty all the same.
  m.tensors[0].shape = {std::int64_t{1} << 31, std::int64_t{1} << 31, 0};
  m.tensors[0].strides.clear();
  expect_accepted(m);
}

// Engines multiply every dimension in order and refuse an overflow a later zero would cancel
// (torch's storage-size check does): an empty tensor whose other dimensions pass 64 bits could
// not be made there.
TEST(validate, refuses_an_empty_tensor_whose_other_dimensions_overflow) {
  auto m = valid_manifest();
  m.tensors[0].nbytes = 0;
  for (const auto& shape : {
           std::vector<std::int64_t>{std::int64_t{1} << 40, std::int64_t{1} << 40, 0},
           std::vector<std::int64_t>{0, std::int64_t{1} << 32, std::int64_t{1} << 31},
       }) {
    m.tensors[0].shape = shape;
    expect_refused(m, "tensors[0].shape");
  }
}

TEST(validate, refuses_bytes_for_a_strided_tensor_without_elements) {
  auto m = valid_manifest();
  m.tensors[0].shape = {0, 16};
  m.tensors[0].strides = {1, 16};  // not row-major: the span rules apply
  m.tensors[0].nbytes = 1024;
  expect_refused(m, "tensors[0].nbytes");
  m.tensors[0].nbytes = 0;
  expect_accepted(m);
}

TEST(validate, refuses_a_source_worker_or_transport_that_is_not_text) {
  auto m = valid_manifest();
  m.source_worker = "trainer\xff";
  expect_refused(m, "source_worker");
  m.source_worker = std::string(2000, 'w');
  expect_refused(m, "source_worker");
  m = valid_manifest();
  m.transport = "shm\x1b[2J";
  expect_refused(m, "transport");
}

TEST(validate, refuses_offset_not_256_aligned) {
  auto m = valid_manifest();
  m.tensors[1].offset = 1000;
  expect_refused(m, "tensors[1].offset");
  m.tensors[1].offset = 1025;
  expect_refused(m, "tensors[1].offset");
}

TEST(validate, refuses_range_outside_its_segment) {
  auto m = valid_manifest();
  m.tensors[1].offset = 1280;  // starts at the segment end
  expect_refused(m, "tensors[1].offset");
  m = valid_manifest();
  m.tensors[2].offset = 256;  // [256, 768) in a 512-byte segment
  expect_refused(m, "tensors[2].offset");
  m = valid_manifest();
  m.tensors[2].offset = uint64_max - 255;  // aligned, but offset + nbytes overflows
  expect_refused(m, "tensors[2].offset");
}

TEST(validate, refuses_segment_index_out_of_range) {
  auto m = valid_manifest();
  m.tensors[2].segment = 2;
  expect_refused(m, "tensors[2].segment");
  m.tensors[2].segment = std::numeric_limits<std::uint32_t>::max();
  expect_refused(m, "tensors[2].segment");
}

TEST(validate, refuses_overlapping_ranges_in_one_segment) {
  auto m = valid_manifest();
  m.tensors[1].offset = 768;  // inside "w" [0, 1024)
  expect_refused(m, "tensors[1].offset");
  m = valid_manifest();
  m.tensors[1].offset = 0;  // same start as "w": either of the two may be reported
  auto r = manifest_validate(m);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::invalid_manifest);
  EXPECT_EQ(r.error().message.rfind("invalid manifest: tensors[", 0), 0u) << r.error().message;
  EXPECT_NE(r.error().message.find("range overlaps"), std::string::npos) << r.error().message;
}

TEST(validate, overlap_is_judged_per_segment) {
  auto m = valid_manifest();
  m.tensors[2].segment = 0;
  m.tensors[2].offset = 512;
  expect_refused(m, "tensors[2].offset");  // "e" moved into segment 0 overlaps "w"
  m = valid_manifest();
  m.tensors[1].segment = 1;
  m.tensors[1].offset = 512;
  m.segments = {{1024}, {768}};
  expect_accepted(m);
}

// A zero-byte tensor sorted between two overlapping ones must not hide their overlap.
TEST(validate, refuses_overlap_with_an_empty_tensor_in_between) {
  auto m = valid_manifest();
  m.tensors.push_back({"z", dtype::f32, {0}, {}, 0, "cpu", 0, 512, 0});
  m.tensors[1].offset = 768;  // overlaps "w" [0, 1024); "z" at 512 sorts between them
  expect_refused(m, "tensors[1].offset");
  m = valid_manifest();
  m.tensors.push_back({"z", dtype::f32, {0}, {}, 0, "cpu", 0, 768, 0});
  m.tensors[1].offset = 768;  // same offset as the empty "z", still inside "w"
  auto r = manifest_validate(m);
  ASSERT_FALSE(r) << "overlap of \"b\" with \"w\" went unnoticed";
  EXPECT_EQ(r.error().code, errc::invalid_manifest);
  EXPECT_EQ(r.error().message.rfind("invalid manifest: tensors[", 0), 0u) << r.error().message;
  EXPECT_NE(r.error().message.find("overlaps tensor \"w\""), std::string::npos)
      << r.error().message;
}

// A large tensor can overlap a later one that is not its neighbour in offset order.
TEST(validate, refuses_overlap_with_a_non_neighbour) {
  auto m = valid_manifest();
  m.segments = {{2048}, {512}};
  m.total_bytes = 2560;
  m.tensors[0].shape = {16, 32};  // "w" now spans [0, 2048)
  m.tensors[0].nbytes = 2048;
  m.tensors[1].offset = 256;                                               // inside "w"
  m.tensors.push_back({"c", dtype::u8, {16}, {}, 16, "cpu", 0, 1536, 0});  // also inside "w"
  expect_refused(m, "tensors[1].offset");
}

TEST(validate, refuses_total_bytes_mismatch) {
  auto m = valid_manifest();
  m.total_bytes = 1793;
  expect_refused(m, "total_bytes");
  m.total_bytes = 0;
  expect_refused(m, "total_bytes");
}

TEST(validate, refuses_total_size_above_limits) {
  auto m = valid_manifest();
  manifest_limits small;
  small.max_total_bytes = 1024;  // segment 0 alone is 1280
  expect_refused(m, "segments[0].nbytes", small);
  small.max_total_bytes = 1500;  // segment 0 fits, the sum 1792 does not
  expect_refused(m, "segments[1].nbytes", small);
  small.max_total_bytes = 1792;
  expect_accepted(m, small);
}

TEST(validate, refuses_segment_sizes_whose_sum_overflows) {
  auto m = valid_manifest();
  m.segments[1].nbytes = uint64_max;
  expect_refused(m, "segments[1].nbytes");
}

TEST(validate, refuses_missing_segments) {
  auto m = valid_manifest();
  m.segments.clear();
  expect_refused(m, "segments");
}

TEST(validate, refuses_unknown_dtype) {
  auto m = valid_manifest();
  m.tensors[0].dtype = static_cast<dtype>(99);
  expect_refused(m, "tensors[0].dtype");
  m.tensors[0].dtype = static_cast<dtype>(-1);
  expect_refused(m, "tensors[0].dtype");
  m.tensors[0].dtype = static_cast<dtype>(12);  // one past the last enumerator
  expect_refused(m, "tensors[0].dtype");
}

TEST(validate, refuses_unknown_transport) {
  auto m = valid_manifest();
  m.transport = "pigeon";
  expect_refused(m, "transport", {}, only_local_clone);
  auto r = manifest_validate(m, only_local_clone);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("\"pigeon\""), std::string::npos) << r.error().message;
  expect_accepted(m);  // without a predicate any non-empty name is accepted
}

TEST(validate, refuses_empty_transport) {
  auto m = valid_manifest();
  m.transport = "";
  expect_refused(m, "transport");
}

TEST(validate, refuses_empty_update_id) {
  auto m = valid_manifest();
  m.update_id = "";
  expect_refused(m, "update_id");
  auto r = manifest_validate(m);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("update_id=<none> rank=2"), std::string::npos)
      << r.error().message;
}

TEST(validate, refuses_malformed_update_id) {
  auto m = valid_manifest();
  m.update_id = "has space";
  expect_refused(m, "update_id");
  m.update_id = std::string(129, 'a');
  expect_refused(m, "update_id");
  m.update_id = update_id_generate();
  expect_accepted(m);
}

TEST(validate, refuses_bad_model_id_and_rank) {
  auto m = valid_manifest();
  m.model_id = "";
  expect_refused(m, "model_id");
  m.model_id = "a\nb";
  expect_refused(m, "model_id");
  m = valid_manifest();
  m.source_rank = -1;
  expect_refused(m, "source_rank");
  m.source_rank = (1 << 24) + 1;
  expect_refused(m, "source_rank");
}

TEST(validate, refuses_bad_device_strings) {
  for (const char* device :
       {"gpu0", "", "cuda", "cuda:", "cuda:x", "cuda:1a", "cuda:12345", "CPU", "cpu ", "cuda:-1"}) {
    auto m = valid_manifest();
    m.tensors[1].device = device;
    SCOPED_TRACE(device);
    expect_refused(m, "tensors[1].device");
  }
  for (const char* device : {"cpu", "cuda:0", "cuda:7", "cuda:1023"}) {
    auto m = valid_manifest();
    m.tensors[1].device = device;
    SCOPED_TRACE(device);
    expect_accepted(m);
  }
}

TEST(validate, refuses_empty_tensors) {
  auto m = valid_manifest();
  m.tensors.clear();
  expect_refused(m, "tensors");
}

TEST(validate, refuses_more_segments_than_tensors) {
  auto m = valid_manifest();
  m.segments.push_back({0});
  m.segments.push_back({0});
  expect_refused(m, "segments");
}

TEST(validate, refuses_oversized_handle) {
  auto m = valid_manifest();
  manifest_limits limits;
  limits.max_handle_bytes = 4;
  m.transport_handle = "12345";
  expect_refused(m, "transport_handle", limits);
}

TEST(validate, refuses_bad_metadata) {
  auto m = valid_manifest();
  m.metadata[""] = "x";
  expect_refused(m, "metadata");
  m = valid_manifest();
  m.metadata["k"] = "bell\a";
  expect_refused(m, "metadata");
}

TEST(validate, span_and_element_count_helpers) {
  tensor_descriptor t;
  t.dtype = dtype::f32;
  t.shape = {16, 16};
  std::uint64_t n = 0;
  ASSERT_TRUE(tensor_element_count(t, n));
  EXPECT_EQ(n, 256u);
  ASSERT_TRUE(tensor_span_bytes(t, n));
  EXPECT_EQ(n, 1024u);
  t.strides = {1, 16};
  ASSERT_TRUE(tensor_span_bytes(t, n));
  EXPECT_EQ(n, 1024u);
  t.strides = {0, 1};  // broadcast along dimension 0
  ASSERT_TRUE(tensor_span_bytes(t, n));
  EXPECT_EQ(n, 64u);
  t.shape = {};
  t.strides = {};
  ASSERT_TRUE(tensor_element_count(t, n));
  EXPECT_EQ(n, 1u);
  t.shape = {3, 0};
  t.strides = {1, 1};
  ASSERT_TRUE(tensor_span_bytes(t, n));
  EXPECT_EQ(n, 0u);
  t.shape = {-1};
  EXPECT_FALSE(tensor_element_count(t, n));
  t.shape = {int64_max, int64_max};
  EXPECT_FALSE(tensor_element_count(t, n));
  // Strides that do not match the shape's rank have no span; they must not be read past.
  t.shape = {4, 4};
  t.strides = {4};
  EXPECT_FALSE(tensor_span_bytes(t, n));
}

// --- properties ---------------------------------------------------------------------------

// A random valid manifest: 1-8 tensors of random dtype and shape, packed 256-aligned into 1-3
// segments, optionally with a transposed (non-contiguous) 2-D view.
weight_update_manifest gen_valid_manifest() {
  weight_update_manifest m;
  m.update_id = "u-" + std::to_string(*rc::gen::inRange(0, 1 << 30));
  m.model_id = "model";
  m.weight_version = *rc::gen::arbitrary<std::uint64_t>();
  m.source_worker = "host:1";
  m.source_rank = *rc::gen::inRange(0, 1 << 24);
  m.transport = "local-clone";
  m.transport_handle = *rc::gen::arbitrary<std::string>();
  const int n = *rc::gen::inRange(1, 9);
  const int segments = *rc::gen::inRange(1, std::min(n, 3) + 1);
  std::vector<std::uint64_t> cursor(static_cast<std::size_t>(segments), 0);
  for (int i = 0; i < n; ++i) {
    tensor_descriptor t;
    t.name = "t" + std::to_string(i);
    t.dtype = static_cast<dtype>(*rc::gen::inRange(0, 12));
    t.shape = *rc::gen::container<std::vector<std::int64_t>>(*rc::gen::inRange<std::size_t>(0, 4),
                                                             rc::gen::inRange<std::int64_t>(0, 9));
    std::uint64_t elements = 1;
    for (auto d : t.shape) elements *= static_cast<std::uint64_t>(d);
    t.nbytes = elements * dtype_itemsize(t.dtype);
    if (t.shape.size() == 2 && *rc::gen::arbitrary<bool>()) {
      t.strides = {1, t.shape[0]};  // column-major view over the same bytes
    }
    t.device = *rc::gen::elementOf(std::vector<std::string>{"cpu", "cuda:0", "cuda:3"});
    t.segment = static_cast<std::uint32_t>(i % segments);
    auto& at = cursor[t.segment];
    at = (at + tensor_alignment - 1) / tensor_alignment * tensor_alignment;
    t.offset = at;
    at += t.nbytes;
    t.checksum = *rc::gen::arbitrary<std::uint64_t>();
    m.tensors.push_back(std::move(t));
  }
  for (auto used : cursor) {
    m.segments.push_back({used + *rc::gen::inRange<std::uint64_t>(0, 300)});
    m.total_bytes += m.segments.back().nbytes;
  }
  return m;
}

RC_GTEST_PROP(validate, generated_valid_manifests_are_accepted, ()) {
  auto m = gen_valid_manifest();
  auto r = manifest_validate(m, only_local_clone);
  RC_ASSERT(r.has_value());
}

std::string tensor_field(std::size_t i, const std::string& field) {
  return "tensors[" + std::to_string(i) + "]." + field;
}

// One field of a valid manifest set to a bad value is refused with invalid_manifest, the message
// names that field and the update.
RC_GTEST_PROP(validate, corruptions_are_refused_and_name_the_field, ()) {
  auto m = gen_valid_manifest();
  const std::size_t n = m.tensors.size();
  const std::size_t i = *rc::gen::inRange<std::size_t>(0, n);
  auto& t = m.tensors[i];
  std::uint64_t want_bytes = 1;
  for (auto d : t.shape) want_bytes *= static_cast<std::uint64_t>(d);
  want_bytes *= dtype_itemsize(t.dtype);

  std::string field;
  // At nominal size so that every case is drawn about equally often.
  const int which = *rc::gen::resize(rc::kNominalSize, rc::gen::inRange(0, 20));
  RC_TAG(which);
  switch (which) {
    case 0:
      m.update_id = *rc::gen::elementOf(
          std::vector<std::string>{"", "has space", "semi;colon", "a\nb", std::string(129, 'x')});
      field = "update_id";
      break;
    case 1:
      m.model_id =
          *rc::gen::elementOf(std::vector<std::string>{"", "bad model", "caf\xc3\xa9", "q?"});
      field = "model_id";
      break;
    case 2:
      m.source_rank = *rc::gen::oneOf(
          rc::gen::inRange(std::numeric_limits<std::int32_t>::min(), 0),
          rc::gen::inRange((1 << 24) + 1, std::numeric_limits<std::int32_t>::max()));
      field = "source_rank";
      break;
    case 3:
      m.transport = *rc::gen::elementOf(
          std::vector<std::string>{"", "pigeon", "local_clone", "shared-memory"});
      field = "transport";
      break;
    case 4:
      m.total_bytes += *rc::gen::suchThat(rc::gen::arbitrary<std::uint64_t>(),
                                          [](std::uint64_t d) { return d != 0; });
      field = "total_bytes";
      break;
    case 5:
      if (n >= 2 && i > 0) {
        t.name = m.tensors[*rc::gen::inRange<std::size_t>(0, i)].name;  // duplicate
      } else {
        t.name =
            *rc::gen::elementOf(std::vector<std::string>{"", "tab\tname", "bad\xff", "nul\x01"});
      }
      field = tensor_field(i, "name");
      break;
    case 6:
      t.shape.insert(t.shape.begin() + *rc::gen::inRange<std::size_t>(0, t.shape.size() + 1),
                     *rc::gen::inRange<std::int64_t>(std::numeric_limits<std::int64_t>::min(), 0));
      t.strides.clear();
      field = tensor_field(i, "shape");
      break;
    case 7:
      t.strides.clear();
      t.nbytes = *rc::gen::suchThat(rc::gen::arbitrary<std::uint64_t>(),
                                    [&](std::uint64_t b) { return b != want_bytes; });
      field = tensor_field(i, "nbytes");
      break;
    case 8:
      t.strides = *rc::gen::suchThat(
          rc::gen::nonEmpty(rc::gen::container<std::vector<std::int64_t>>(
              rc::gen::inRange<std::int64_t>(0, 100))),
          [&](const std::vector<std::int64_t>& s) { return s.size() != t.shape.size(); });
      field = tensor_field(i, "strides");
      break;
    case 9:
      if (t.shape.empty()) t.shape = {1};
      t.strides.assign(t.shape.size(), 1);
      t.strides[*rc::gen::inRange<std::size_t>(0, t.shape.size())] =
          *rc::gen::inRange<std::int64_t>(std::numeric_limits<std::int64_t>::min(), 0);
      t.nbytes = want_bytes;
      field = tensor_field(i, "strides");
      break;
    case 10:
      t.offset += *rc::gen::inRange<std::uint64_t>(1, tensor_alignment);
      field = tensor_field(i, "offset");
      break;
    case 11:
      t.segment = static_cast<std::uint32_t>(m.segments.size()) +
                  *rc::gen::inRange<std::uint32_t>(0, 1u << 31);
      field = tensor_field(i, "segment");
      break;
    case 12:
      t.dtype = static_cast<dtype>(
          *rc::gen::oneOf(rc::gen::inRange(12, 1 << 20), rc::gen::inRange(-1000, 0)));
      field = tensor_field(i, "dtype");
      break;
    case 13:
      t.device = *rc::gen::oneOf(rc::gen::elementOf(std::vector<std::string>{
                                     "", "gpu", "cuda:", "cuda:12345", "CPU", "cuda:a"}),
                                 rc::gen::map(rc::gen::arbitrary<std::string>(),
                                              [](const std::string& s) { return "x" + s; }));
      field = tensor_field(i, "device");
      break;
    case 14: {
      // Shrink the segment of a non-empty tensor so that the tensor no longer fits.
      auto nonempty = *rc::gen::inRange<std::size_t>(0, n);
      for (std::size_t k = 0; k < n && m.tensors[nonempty].nbytes == 0; ++k) {
        nonempty = (nonempty + 1) % n;
      }
      RC_PRE(m.tensors[nonempty].nbytes > 0);
      auto s = m.tensors[nonempty].segment;
      std::uint64_t end = m.tensors[nonempty].offset + m.tensors[nonempty].nbytes;
      std::uint64_t size = *rc::gen::inRange<std::uint64_t>(0, end);
      m.total_bytes = m.total_bytes - m.segments[s].nbytes + size;
      m.segments[s].nbytes = size;
      for (std::size_t k = 0; k < n; ++k) {
        const auto& u = m.tensors[k];
        if (u.segment == s && u.offset + u.nbytes > size) {
          field = tensor_field(k, "offset");
          break;
        }
      }
      break;
    }
    case 15:
      m.tensors.clear();
      field = "tensors";
      break;
    case 16:
      m.segments.clear();
      field = "segments";
      break;
    case 17:
      m.metadata[*rc::gen::elementOf(std::vector<std::string>{"", "k"})] =
          *rc::gen::elementOf(std::vector<std::string>{"", "\x01", "\xff"});
      if (m.metadata.count("k") && m.metadata["k"].empty()) m.metadata["k"] = "\n";
      field = "metadata";
      break;
    case 18: {
      // Move a non-empty tensor onto another non-empty tensor of the same segment.
      std::vector<std::size_t> nonempty;
      for (std::size_t k = 0; k < n; ++k) {
        if (m.tensors[k].nbytes > 0) nonempty.push_back(k);
      }
      RC_PRE(nonempty.size() >= 2);
      auto a = nonempty[0], b = nonempty[1];
      auto& mover = m.tensors[b];
      mover.segment = m.tensors[a].segment;
      mover.offset = m.tensors[a].offset;
      // Keep it inside the segment so that the overlap is the first problem found.
      auto& seg = m.segments[mover.segment];
      if (mover.offset + mover.nbytes > seg.nbytes) {
        m.total_bytes += mover.offset + mover.nbytes - seg.nbytes;
        seg.nbytes = mover.offset + mover.nbytes;
      }
      field = "overlap";  // either of the two may be reported, depending on sort order
      break;
    }
    case 19:
      t.strides.clear();
      t.shape = {*rc::gen::inRange<std::int64_t>(std::int64_t{1} << 62, int64_max)};
      t.shape.push_back(*rc::gen::inRange<std::int64_t>(4, 1 << 20));
      field = tensor_field(i, "shape");
      break;
  }
  auto r = manifest_validate(m, only_local_clone);
  RC_ASSERT(!r.has_value());
  RC_ASSERT(r.error().code == errc::invalid_manifest);
  const auto& msg = r.error().message;
  RC_ASSERT(msg.rfind("invalid manifest: ", 0) == 0u);
  if (field == "overlap") {
    RC_ASSERT(msg.rfind("invalid manifest: tensors[", 0) == 0u);
    RC_ASSERT(msg.find("range overlaps") != std::string::npos);
  } else {
    RC_ASSERT(msg.rfind("invalid manifest: " + field + ":", 0) == 0u);
  }
  RC_ASSERT(msg.find("(" + update_context(m) + ")") != std::string::npos);
}

// Arbitrary field values (negative, huge, mismatched) never crash the validator or overflow
// silently: the answer is acceptance or invalid_manifest.
RC_GTEST_PROP(validate, arbitrary_manifests_are_judged_without_crashing, ()) {
  auto m = gen_valid_manifest();
  auto small = rc::gen::inRange<std::int64_t>(-3, 40);
  auto any = rc::gen::oneOf(small, rc::gen::arbitrary<std::int64_t>());
  for (auto& t : m.tensors) {
    if (*rc::gen::arbitrary<bool>()) t.shape = *rc::gen::container<std::vector<std::int64_t>>(any);
    if (*rc::gen::arbitrary<bool>()) {
      t.strides = *rc::gen::container<std::vector<std::int64_t>>(any);
    }
    if (*rc::gen::arbitrary<bool>()) t.nbytes = *rc::gen::arbitrary<std::uint64_t>();
    if (*rc::gen::arbitrary<bool>()) t.offset = *rc::gen::arbitrary<std::uint64_t>() & ~255ull;
    if (*rc::gen::arbitrary<bool>()) t.segment = *rc::gen::inRange<std::uint32_t>(0, 4);
  }
  if (*rc::gen::arbitrary<bool>()) {
    for (auto& seg : m.segments) seg.nbytes = *rc::gen::arbitrary<std::uint64_t>();
  }
  auto r = manifest_validate(m);
  if (!r) {
    RC_ASSERT(r.error().code == errc::invalid_manifest);
    RC_ASSERT(r.error().message.rfind("invalid manifest: ", 0) == 0u);
  }
}

}  // namespace
}  // namespace wsync

namespace wsync {
namespace {

TEST(validate, the_chunked_checksum_needs_a_power_of_two_chunk_in_range) {
  auto m = valid_manifest();
  m.checksum_method = {checksum_algorithm::xxh3_64_chunked, 4096};
  expect_accepted(m);
  m.checksum_method.chunk_bytes = std::uint64_t{1} << 30;
  expect_accepted(m);
  for (std::uint64_t bad :
       {std::uint64_t{0}, std::uint64_t{2048}, std::uint64_t{6144}, std::uint64_t{2} << 30}) {
    m.checksum_method.chunk_bytes = bad;
    expect_refused(m, "checksum.chunk_bytes");
  }
  m.checksum_method = {checksum_algorithm::xxh3_64, 4096};
  expect_refused(m, "checksum.chunk_bytes");
  m.checksum_method = {static_cast<checksum_algorithm>(2), 4096};  // from no build of ours
  expect_refused(m, "checksum.algorithm");
}

}  // namespace
}  // namespace wsync
