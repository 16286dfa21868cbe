#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace wsync {

struct cluster_bench_options {
  std::string self_exe = "/proc/self/exe";
  std::vector<int> consumers = {1, 8, 64};  ///< consumer ranks per run
  /// Consumer processes the ranks of a run are spread over (at most one per rank). Above 1 each
  /// count runs twice: without node leaders (the baseline), then with them.
  int processes = 1;
  unsigned repeat = 5;  ///< timed updates per count (wsync bench --repeat)
  bool smoke = false;   ///< said in every row: a quick run's figures are not the machine's
  std::string layout = "synthetic:65536:4";  ///< small, so the data plane does not dominate
};

/// `wsync bench --mode cluster`: control-plane overhead per update — commit time at the
/// publisher minus its publish time minus the slowest consumer's own import-to-answer time —
/// for each consumer count, over real CAF networking on loopback. One JSON row per count; the
/// baseline is the overhead with one consumer, measured in the same run.
int cluster_bench_run(const cluster_bench_options& options, std::ostream& out);

}  // namespace wsync
