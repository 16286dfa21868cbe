#pragma once
// A trainer rank without a coordinator, for consumers driven over HTTP.

#include <string>

#include "wsync/actors/node.hpp"

namespace wsync {

/// `wsync publisher --standalone`: no coordinator, no CAF. Publishes the versions into shared
/// memory, writes their manifests to `manifest_out` (one JSON per line, for an HTTP-driven
/// consumer), and holds them until SIGINT/SIGTERM. Returns the process exit code.
int publisher_standalone_run(const publisher_options& options, const std::string& manifest_out);

}  // namespace wsync
