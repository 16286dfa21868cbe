#include "wsync/manifest/dtype.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>

namespace wsync {
namespace {

const std::pair<dtype, std::size_t> all_dtypes[] = {
    {dtype::f64, 8},      {dtype::f32, 4},      {dtype::f16, 2}, {dtype::bf16, 2},
    {dtype::fp8_e4m3, 1}, {dtype::fp8_e5m2, 1}, {dtype::i64, 8}, {dtype::i32, 4},
    {dtype::i16, 2},      {dtype::i8, 1},       {dtype::u8, 1},  {dtype::boolean, 1}};

TEST(dtype, itemsize_of_every_dtype) {
  for (auto [t, size] : all_dtypes) {
    EXPECT_EQ(dtype_itemsize(t), size) << dtype_name(t);
  }
}

TEST(dtype, names_round_trip_through_parse) {
  std::set<std::string_view> names;
  for (auto [t, size] : all_dtypes) {
    auto name = dtype_name(t);
    EXPECT_NE(name, "invalid");
    EXPECT_TRUE(names.insert(name).second) << "duplicate name " << name;
    auto back = dtype_parse(name);
    ASSERT_TRUE(back) << name;
    EXPECT_EQ(*back, t) << name;
  }
}

TEST(dtype, wire_names) {
  EXPECT_EQ(dtype_name(dtype::f64), "f64");
  EXPECT_EQ(dtype_name(dtype::bf16), "bf16");
  EXPECT_EQ(dtype_name(dtype::fp8_e4m3), "fp8_e4m3");
  EXPECT_EQ(dtype_name(dtype::fp8_e5m2), "fp8_e5m2");
  EXPECT_EQ(dtype_name(dtype::boolean), "bool");
}

TEST(dtype, torch_names_parse) {
  const std::pair<const char*, dtype> torch[] = {{"float64", dtype::f64},
                                                 {"float32", dtype::f32},
                                                 {"float16", dtype::f16},
                                                 {"bfloat16", dtype::bf16},
                                                 {"float8_e4m3fn", dtype::fp8_e4m3},
                                                 {"float8_e5m2", dtype::fp8_e5m2},
                                                 {"int64", dtype::i64},
                                                 {"int32", dtype::i32},
                                                 {"int16", dtype::i16},
                                                 {"int8", dtype::i8},
                                                 {"uint8", dtype::u8},
                                                 {"bool", dtype::boolean}};
  for (auto [name, t] : torch) {
    EXPECT_EQ(dtype_parse(name), t) << name;
  }
}

TEST(dtype, unknown_names_give_nullopt) {
  for (const char* name : {"", "complex64", "float", "BF16", "bf16 ", "torch.bfloat16",
                           "float8_e4m3", "fp8", "uint16", "f8"}) {
    EXPECT_EQ(dtype_parse(name), std::nullopt) << name;
  }
}

TEST(dtype, out_of_range_values_have_no_size_or_name) {
  EXPECT_EQ(dtype_itemsize(static_cast<dtype>(12)), 0u);
  EXPECT_EQ(dtype_itemsize(static_cast<dtype>(-1)), 0u);
  EXPECT_EQ(dtype_name(static_cast<dtype>(77)), "invalid");
  EXPECT_EQ(dtype_parse("invalid"), std::nullopt);
}

}  // namespace
}  // namespace wsync
