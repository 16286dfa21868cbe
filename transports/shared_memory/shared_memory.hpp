#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/shared_memory.hpp"

namespace wsync {

/// Registry entry of "shared-memory": one node, many processes. The publisher keeps a ring of
/// pre-faulted POSIX shared-memory slots (mode 0600, unguessable names); consumers map each
/// slot once, read-only, and import zero-copy.
transport_entry shared_memory_entry();

namespace shared_memory_detail {

/// Every slot's name begins with it ("wsync-<pid>-<secret>").
inline constexpr char name_prefix[] = "wsync-";

/// What a consumer reads from a manifest's transport_handle: the slot and where each segment
/// lies in it.
struct handle {
  std::string pool;
  std::uint64_t slot = 0;
  std::string name;
  std::uint64_t generation = 0;
  std::uint64_t capacity = 0;
  std::vector<std::uint64_t> offsets;
};

/// Decodes and bounds-checks m.transport_handle against m's segments; never throws (fuzzed:
/// fuzz/targets/transport_handles.cpp).
result<handle> handle_parse(const weight_update_manifest& m);

}  // namespace shared_memory_detail

}  // namespace wsync
