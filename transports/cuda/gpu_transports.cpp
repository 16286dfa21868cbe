#include "cuda/gpu_transports.hpp"

#include "wsync/transports/gpu.hpp"

namespace wsync {
namespace {

constexpr transport_caps same_node_gpu{.cpu_memory = false,
                                       .gpu_memory = true,
                                       .cross_process = true,
                                       .cross_node = false,
                                       .zero_copy_import = true};
constexpr transport_caps cluster_gpu{.cpu_memory = false,
                                     .gpu_memory = true,
                                     .cross_process = true,
                                     .cross_node = true,
                                     .zero_copy_import = false};

// What building `name` answers: why no GPU work can run here, or, on a machine where it could,
// that the transport itself is not in this build yet (docs/transports.md says what is).
transport_entry blocked_entry(std::string name, std::string summary, transport_caps caps) {
  auto make = [name](const transport_options&) -> result<std::unique_ptr<transport>> {
    if (auto r = gpu::ready(); !r) {
      return make_error(errc::blocked, r.error().message + " (transport " + name + ")");
    }
    return make_error(errc::blocked, "blocked: the " + name +
                                         " transport is not in this build yet; the GPU checksum "
                                         "kernels are (docs/transports.md, GPU data plane)");
  };
  return {std::move(name), std::move(summary), caps, std::move(make)};
}

}  // namespace

std::vector<transport_entry> gpu_transport_entries() {
  return {
      blocked_entry("cuda-ipc", "one node, GPU memory: cudaIpcGetMemHandle per pooled segment",
                    same_node_gpu),
      blocked_entry("cuda-vmm",
                    "one node, GPU memory: cuMemCreate segments shared as POSIX fds (SCM_RIGHTS)",
                    same_node_gpu),
      blocked_entry("nccl", "cluster, GPU memory: bucketed broadcast over one NCCL communicator",
                    cluster_gpu),
  };
}

}  // namespace wsync
