#pragma once

#include <vector>

#include "wsync/transports/registry.hpp"

namespace wsync {

/// Registry entries of the GPU transports: "cuda-ipc", "cuda-vmm" and "nccl". They are always
/// listed, so that a manifest or a flag naming one gets the precise reason it cannot run here
/// (errc::blocked) rather than "unknown transport".
std::vector<transport_entry> gpu_transport_entries();

}  // namespace wsync
