#include "wsync/manifest/dtype.hpp"

#include <array>
#include <utility>

namespace wsync {
namespace {

struct dtype_info {
  dtype type;
  std::size_t itemsize;
  std::string_view name;
  std::string_view torch_name;  // torch attribute name, as vLLM's dtype_names carry it
};

constexpr std::array<dtype_info, 12> table{{
    {dtype::f64, 8, "f64", "float64"},
    {dtype::f32, 4, "f32", "float32"},
    {dtype::f16, 2, "f16", "float16"},
    {dtype::bf16, 2, "bf16", "bfloat16"},
    {dtype::fp8_e4m3, 1, "fp8_e4m3", "float8_e4m3fn"},
    {dtype::fp8_e5m2, 1, "fp8_e5m2", "float8_e5m2"},
    {dtype::i64, 8, "i64", "int64"},
    {dtype::i32, 4, "i32", "int32"},
    {dtype::i16, 2, "i16", "int16"},
    {dtype::i8, 1, "i8", "int8"},
    {dtype::u8, 1, "u8", "uint8"},
    {dtype::boolean, 1, "bool", "bool"},
}};

const dtype_info* find(dtype t) {
  for (const auto& info : table) {
    if (info.type == t) return &info;
  }
  return nullptr;
}

}  // namespace

std::size_t dtype_itemsize(dtype t) {
  const auto* info = find(t);
  return info ? info->itemsize : 0;
}

std::string_view dtype_name(dtype t) {
  const auto* info = find(t);
  return info ? info->name : std::string_view{"invalid"};
}

std::string_view dtype_torch_name(dtype t) {
  const auto* info = find(t);
  return info ? info->torch_name : std::string_view{"invalid"};
}

std::vector<dtype> dtype_all() {
  std::vector<dtype> out;
  for (const auto& info : table) out.push_back(info.type);
  return out;
}

std::optional<dtype> dtype_parse(std::string_view name) {
  for (const auto& info : table) {
    if (name == info.name || name == info.torch_name) return info.type;
  }
  return std::nullopt;
}

}  // namespace wsync
