#pragma once
// Housekeeping of the shared-memory transport that other modules and tools may call.

#include <string>
#include <vector>

namespace wsync {

/// Removes wsync shared-memory objects in /dev/shm whose owner process is gone (or whose pid now
/// belongs to a younger process). Returns the names removed. Called when a publisher starts.
std::vector<std::string> shm_sweep_orphans();

/// Names of the wsync shared-memory objects in /dev/shm created by any of `pids` (leak checks).
std::vector<std::string> shm_segments_of(const std::vector<int>& pids);

}  // namespace wsync
