#pragma once
// Device memory for the NCCL code (endpoint.cpp: vLLM's receiving side; fabric.cpp: the nccl
// transport). Included only where the build has NCCL.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "wsync/transports/nccl_receiver.hpp"

namespace wsync::nccl {

inline std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

/// `nbytes` of cudaMalloc'd memory on `device`, freed when the block's last owner goes; an
/// error begins with `who`.
result<block> device_block(int device, std::uint64_t nbytes, const std::string& who);

}  // namespace wsync::nccl
