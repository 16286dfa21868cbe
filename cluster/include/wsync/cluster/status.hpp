#pragma once

#include <ostream>
#include <string>

namespace wsync {

/// Prints a coordinator status object (docs/cluster.md) as a per-rank table, then the recent
/// updates with each rank's state. Returns 0 when the status says "pass", 1 otherwise.
int status_print(const std::string& status_json, std::ostream& out);

}  // namespace wsync
