#pragma once
// Tensor layouts of real model checkpoints (names, dtypes and shapes as the published
// checkpoints have them), built from their published configurations; contents are generated.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/manifest/dtype.hpp"

namespace wsync {

struct layout_tensor {
  std::string name;
  wsync::dtype dtype = wsync::dtype::bf16;
  std::vector<std::int64_t> shape;
  std::uint64_t nbytes() const;
};

struct model_layout {
  std::string name;
  std::string description;
  std::vector<layout_tensor> tensors;
  std::uint64_t bytes() const;  ///< sum of tensor sizes, without alignment padding
};

/// Names accepted by layout_find(), e.g. "qwen2.5-0.5b".
std::vector<std::string> layout_names();
std::optional<model_layout> layout_find(std::string_view name);

/// `tensors` bf16 tensors adding up to about `bytes` (each a whole number of 4 KiB rows).
model_layout layout_synthetic(std::uint64_t bytes, std::uint64_t tensors);

}  // namespace wsync
