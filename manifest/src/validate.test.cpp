#include "wsync/manifest/validate.hpp"

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include <limits>

namespace wsync {
namespace {

weight_update_manifest valid_manifest() {
  weight_update_manifest m;
  m.update_id = "u-test-1";
  m.model_id = "model";
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
  m.total_bytes = 1792;
  return m;
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
}

TEST(validate, accepts_a_consistent_manifest) {
  auto r = manifest_validate(valid_manifest());
  EXPECT_TRUE(r) << r.error().message;
}

TEST(validate, accepts_a_transposed_view_within_nbytes) {
  auto m = valid_manifest();
  m.tensors[0].strides = {1, 16};  // column-major view of the same 1024 bytes
  EXPECT_TRUE(manifest_validate(m));
}

TEST(validate, refuses_empty_and_duplicate_names) {
  auto m = valid_manifest();
  m.tensors[1].name = "";
  expect_refused(m, "tensors[1].name");
  m = valid_manifest();
  m.tensors[2].name = "w";
  expect_refused(m, "tensors[2].name");
  m = valid_manifest();
  m.tensors[0].name = "bad\xff";
  expect_refused(m, "tensors[0].name");
  m = valid_manifest();
  m.tensors[0].name = "tab\tname";
  expect_refused(m, "tensors[0].name");
  m = valid_manifest();
  m.tensors[0].name = "caf\xc3\xa9.weight";  // UTF-8 is fine
  EXPECT_TRUE(manifest_validate(m));
}

TEST(validate, refuses_bad_shapes) {
  auto m = valid_manifest();
  m.tensors[0].shape = {16, -16};
  expect_refused(m, "tensors[0].shape");
  m = valid_manifest();
  m.tensors[0].shape = {std::numeric_limits<std::int64_t>::max(), 4};
  expect_refused(m, "tensors[0].shape");
}

TEST(validate, refuses_nbytes_that_disagree_with_the_shape) {
  auto m = valid_manifest();
  m.tensors[1].nbytes = 22;
  expect_refused(m, "tensors[1].nbytes");
}

TEST(validate, refuses_bad_strides) {
  auto m = valid_manifest();
  m.tensors[0].strides = {16};
  expect_refused(m, "tensors[0].strides");
  m = valid_manifest();
  m.tensors[0].strides = {-16, 1};
  expect_refused(m, "tensors[0].strides");
  m = valid_manifest();
  m.tensors[0].strides = {32, 1};  // reaches 15*32+15+1 = 496 elements = 1984 B > 1024
  expect_refused(m, "tensors[0].strides");
}

TEST(validate, refuses_ranges_outside_or_overlapping) {
  auto m = valid_manifest();
  m.tensors[1].offset = 1000;
  expect_refused(m, "tensors[1].offset");  // not aligned
  m = valid_manifest();
  m.tensors[1].offset = 1280;
  expect_refused(m, "tensors[1].offset");  // past the segment end
  m = valid_manifest();
  m.tensors[1].offset = 768;
  expect_refused(m, "tensors[1].offset");  // overlaps "w"
  m = valid_manifest();
  m.tensors[2].segment = 2;
  expect_refused(m, "tensors[2].segment");
  m = valid_manifest();
  m.tensors[2].offset = std::numeric_limits<std::uint64_t>::max() - 255;
  expect_refused(m, "tensors[2].offset");  // offset + nbytes overflows
}

TEST(validate, refuses_inconsistent_or_absurd_sizes) {
  auto m = valid_manifest();
  m.total_bytes = 1793;
  expect_refused(m, "total_bytes");
  m = valid_manifest();
  manifest_limits small;
  small.max_total_bytes = 1024;
  expect_refused(m, "segments[0].nbytes", small);
  m = valid_manifest();
  m.segments[1].nbytes = std::numeric_limits<std::uint64_t>::max();  // the sum overflows
  expect_refused(m, "segments[1].nbytes");
}

TEST(validate, refuses_unknown_dtype_and_transport) {
  auto m = valid_manifest();
  m.tensors[0].dtype = static_cast<dtype>(99);
  expect_refused(m, "tensors[0].dtype");
  m = valid_manifest();
  m.transport = "pigeon";
  expect_refused(m, "transport", {}, [](std::string_view n) { return n == "local-clone"; });
  m.transport = "";
  expect_refused(m, "transport");
}

TEST(validate, refuses_bad_identity_fields) {
  auto m = valid_manifest();
  m.update_id = "";
  expect_refused(m, "update_id");
  m = valid_manifest();
  m.update_id = "has space";
  expect_refused(m, "update_id");
  m = valid_manifest();
  m.model_id = "";
  expect_refused(m, "model_id");
  m = valid_manifest();
  m.source_rank = -1;
  expect_refused(m, "source_rank");
  m = valid_manifest();
  m.tensors[0].device = "gpu0";
  expect_refused(m, "tensors[0].device");
  m = valid_manifest();
  m.tensors.clear();
  expect_refused(m, "tensors");
  m = valid_manifest();
  m.metadata[""] = "x";
  expect_refused(m, "metadata");
}

// Any one field set to a bad value is refused with invalid_manifest.
RC_GTEST_PROP(validate, corruptions_give_invalid_manifest, ()) {
  auto m = valid_manifest();
  switch (*rc::gen::inRange(0, 9)) {
    case 0:
      m.update_id.clear();
      break;
    case 1:
      m.model_id.clear();
      break;
    case 2:
      m.source_rank = *rc::gen::inRange(-1000, -1);
      break;
    case 3:
      m.total_bytes += *rc::gen::inRange<std::uint64_t>(1, 1000);
      break;
    case 4:
      m.tensors[*rc::gen::inRange(0, 3)].name.clear();
      break;
    case 5:
      m.tensors[*rc::gen::inRange(0, 3)].shape[0] = *rc::gen::inRange(-100, -1);
      break;
    case 6:
      m.tensors[*rc::gen::inRange(0, 3)].nbytes += *rc::gen::inRange(1, 100);
      break;
    case 7:
      m.tensors[*rc::gen::inRange(0, 3)].offset += *rc::gen::inRange(1, 255);
      break;
    case 8:
      m.tensors[*rc::gen::inRange(0, 3)].segment = *rc::gen::inRange(2, 100);
      break;
  }
  auto r = manifest_validate(m);
  RC_ASSERT(!r.has_value());
  RC_ASSERT(r.error().code == errc::invalid_manifest);
  RC_ASSERT(r.error().message.rfind("invalid manifest: ", 0) == 0);
}

}  // namespace
}  // namespace wsync
