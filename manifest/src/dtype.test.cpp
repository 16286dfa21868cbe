#include "wsync/manifest/dtype.hpp"

#include <gtest/gtest.h>

namespace wsync {
namespace {

TEST(dtype, itemsizes_and_names_round_trip) {
  const std::pair<dtype, std::size_t> all[] = {
      {dtype::f64, 8},      {dtype::f32, 4},      {dtype::f16, 2}, {dtype::bf16, 2},
      {dtype::fp8_e4m3, 1}, {dtype::fp8_e5m2, 1}, {dtype::i64, 8}, {dtype::i32, 4},
      {dtype::i16, 2},      {dtype::i8, 1},       {dtype::u8, 1},  {dtype::boolean, 1}};
  for (auto [t, size] : all) {
    EXPECT_EQ(dtype_itemsize(t), size) << dtype_name(t);
    EXPECT_EQ(dtype_parse(dtype_name(t)), t) << dtype_name(t);
  }
  EXPECT_EQ(dtype_name(dtype::boolean), "bool");
}

TEST(dtype, torch_names_parse_and_unknown_names_do_not) {
  EXPECT_EQ(dtype_parse("bfloat16"), dtype::bf16);
  EXPECT_EQ(dtype_parse("float8_e4m3fn"), dtype::fp8_e4m3);
  EXPECT_EQ(dtype_parse("float32"), dtype::f32);
  EXPECT_FALSE(dtype_parse("complex64"));
  EXPECT_FALSE(dtype_parse(""));
  EXPECT_EQ(dtype_itemsize(static_cast<dtype>(77)), 0u);
}

}  // namespace
}  // namespace wsync
