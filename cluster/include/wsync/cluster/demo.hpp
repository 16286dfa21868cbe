#pragma once

#include <cstdint>
#include <ostream>
#include <string>

namespace wsync {

struct demo_options {
  std::string self_exe = "/proc/self/exe";  ///< the wsync binary to launch ranks with
  int publishers = 2;
  int consumers = 4;
  std::uint64_t versions = 5;
  std::string layout = "qwen2.5-0.5b";
  bool json = false;
};

/// `wsync demo`: a coordinator, publisher ranks and consumer ranks as separate local processes
/// on loopback, `versions` updates over shared memory, then the per-rank table. Ends with the
/// status object (docs/cluster.md) when `json`. Returns 0 when every consumer acknowledged every
/// version and nothing was left behind.
int demo_run(const demo_options& options, std::ostream& out);

}  // namespace wsync
