#pragma once
// A rollout rank without a coordinator that pulls: it follows the state file of a file-mmap
// directory and installs every new version it finds there.

#include <chrono>
#include <cstdint>
#include <string>

#include "wsync/transports/transport.hpp"

namespace wsync {

struct follow_options {
  std::int32_t rank = 0;
  std::string transport = "file-mmap";   ///< the only transport with a state file to follow
  transport_options transport_settings;  ///< must name dir
  std::string model_id;                  ///< empty: whatever model the directory holds
  std::chrono::milliseconds poll{100};   ///< how often CURRENT is read
  bool verify = true;                    ///< recompute checksums before installing
};

/// `wsync consumer --standalone --transport file-mmap`: no coordinator, no CAF, no HTTP. Reads
/// DIR/CURRENT every `poll`, imports each version it has not seen (zero-copy, holding a lease),
/// verifies, installs it into the reference runtime and logs "active version V"; the version
/// rule is WeightConsumer's (a lower or repeated version is rejected and the active one kept).
/// Runs until SIGINT/SIGTERM/SIGHUP; returns the process exit code.
int consumer_follow_run(const follow_options& options);

}  // namespace wsync
