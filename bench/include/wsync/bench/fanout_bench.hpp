#pragma once
// `wsync bench --mode fanout`: one publisher node and N consumer nodes of R ranks each, as real
// processes in network namespaces whose links tc rate-limits (root only), moving updates over
// the ucx transport along the fan-out planner's routes. Reports the time from publish to commit
// (every rank acknowledged) for each plan against the same for a single consumer, measured in
// the same run.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace wsync {

struct fanout_bench_options {
  unsigned nodes = 4;  ///< consumer nodes; the publisher has a node of its own
  unsigned ranks_per_node = 4;
  /// One row each; naive (every rank from the publisher) first, as the others' baseline.
  std::vector<std::string> plans = {"tree", "chain", "star", "naive"};
  unsigned degree = 2;                            ///< children per leader (tree)
  std::uint64_t bytes = std::uint64_t{16} << 20;  ///< update size
  unsigned repeat = 5;                            ///< timed updates per plan (wsync bench --repeat)
  bool smoke = false;  ///< said in every row: a quick run's figures are not the machine's
  /// Each node's link, each way. 200 Mbit/s keeps the network the bottleneck with 4 x 4 ranks on
  /// two cores; at 1 Gbit/s the ranks' own TCP copies there take the cores first.
  std::uint64_t rate_mbit = 200;
  std::uint64_t chunk_bytes = std::uint64_t{256} << 10;  ///< relay pipeline granularity
  bool kill_leader = false;  ///< last: one update during which a top leader is SIGKILLed
};

/// Prints one JSON row per plan (and one for the kill), the last row the run's result; returns
/// 0 pass, 1 fail, 2 blocked (not root, no iproute2, no UCX).
int fanout_bench_run(const fanout_bench_options& options, std::ostream& out);

}  // namespace wsync
