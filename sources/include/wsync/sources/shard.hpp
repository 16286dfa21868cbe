#pragma once
// The tensors one publisher rank publishes: its share of a model layout (contents generated) or
// of a safetensors checkpoint (mapped, zero-copy). Rank r of n takes tensor i when i % n == r.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"
#include "wsync/sources/layouts.hpp"
#include "wsync/sources/safetensors.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {

/// Where a rank's tensors come from.
struct shard_spec {
  std::string layout = "qwen2.5-0.5b";  ///< a layout name, or "synthetic:<bytes>:<tensors>"
  std::string safetensors;              ///< a checkpoint file; when set, `layout` is not used
  std::int32_t rank = 0;
  std::int32_t ranks = 1;
};

/// A rank's tensors and the memory behind them; `tensors` point into this object.
struct shard_tensors {
  std::vector<std::vector<std::byte>> storage;  ///< generated contents, one buffer per tensor
  std::unique_ptr<safetensors_file> file;       ///< the mapped checkpoint, when reading one
  std::vector<tensor_source> tensors;
};

/// Loads rank `spec.rank`'s share. An unknown layout, a malformed checkpoint or a rank that gets
/// no tensor is errc::invalid_argument saying which.
result<shard_tensors> shard_load(const shard_spec& spec);

/// Whether a checkpoint the shard maps is still the file it mapped (safetensors_file::unchanged);
/// always true for a generated layout. Asked before publishing `version` and again after it
/// (`published`); the error names `rank` and the version.
result<void> shard_unchanged(const shard_tensors& shard, std::int32_t rank, std::uint64_t version,
                             bool published);

/// The model id a publisher announces when none is given: the layout name, or "safetensors".
std::string shard_model_id(const shard_spec& spec);

/// A layout by name, or "synthetic:<bytes>:<tensors>" (layout_synthetic).
result<model_layout> layout_parse(const std::string& text);

/// Fills `n` bytes with a xorshift64 stream continuing from `state` (updated): cheap, varied
/// contents for generated tensors, so checksums and torn reads show up.
void pattern_fill(std::byte* p, std::uint64_t n, std::uint64_t& state);

}  // namespace wsync
