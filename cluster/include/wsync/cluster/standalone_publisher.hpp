#pragma once
// A trainer rank without a coordinator, for consumers driven over HTTP or polling a directory.

#include <string>

#include "wsync/actors/node.hpp"

namespace wsync {

/// `wsync publisher --standalone`: no coordinator, no CAF. Over shared memory: publishes the
/// versions, writes their manifests to `manifest_out` (one JSON per line, for an HTTP-driven
/// consumer), and holds them until SIGINT/SIGTERM/SIGHUP. Over file-mmap (options.transport):
/// publishes them, `interval` apart, into the directory its `dir` option names, where polling
/// consumers find them (DIR/CURRENT); `manifest_out` is optional, and it returns after the last
/// version. Returns the process exit code.
int publisher_standalone_run(const publisher_options& options, const std::string& manifest_out);

}  // namespace wsync
