#pragma once

#include <cstddef>
#include <optional>
#include <string_view>
#include <vector>

namespace wsync {

/// Element types a tensor may have. The names (dtype_name) are the wire format.
enum class dtype {
  f64,
  f32,
  f16,
  bf16,
  fp8_e4m3,
  fp8_e5m2,
  i64,
  i32,
  i16,
  i8,
  u8,
  boolean,
};

/// Bytes per element.
std::size_t dtype_itemsize(dtype t);
/// Wire name: "f64", "bf16", "fp8_e4m3", "bool", ...
std::string_view dtype_name(dtype t);
/// torch's attribute name for it ("bfloat16", "float8_e4m3fn", ...), as vLLM's dtype_names spell
/// it.
std::string_view dtype_torch_name(dtype t);
/// Every dtype, in table order.
std::vector<dtype> dtype_all();
/// Parses a wire name; also accepts torch spellings ("bfloat16", "float32", "float8_e4m3fn", ...).
std::optional<dtype> dtype_parse(std::string_view name);

}  // namespace wsync
