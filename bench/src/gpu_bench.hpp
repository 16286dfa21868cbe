#pragma once

#include <ostream>
#include <string>

#include "wsync/bench/bench.hpp"

namespace wsync {

/// True for the GPU modes: cuda-ipc, cuda-vmm, nccl and gpu-checksum.
bool gpu_mode(const std::string& mode);

/// Runs a GPU mode; prints one JSON row (status blocked where no GPU work can run here).
int gpu_bench_run(const bench_options& opt, std::ostream& out);

}  // namespace wsync
