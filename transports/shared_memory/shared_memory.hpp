#pragma once

#include <string>
#include <vector>

#include "wsync/transports/registry.hpp"

namespace wsync {

/// Registry entry of "shared-memory": one node, many processes. The publisher keeps a ring of
/// pre-faulted POSIX shared-memory slots (mode 0600, unguessable names); consumers map each
/// slot once, read-only, and import zero-copy.
transport_entry shared_memory_entry();

/// Removes wsync shared-memory objects in `dir` whose owner process is gone (or whose pid now
/// belongs to a younger process). Returns the names removed. Called when a publisher starts.
std::vector<std::string> shm_sweep_orphans(const std::string& dir = "/dev/shm");

}  // namespace wsync
