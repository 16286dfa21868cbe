#include "cuda/gpu_transports.hpp"

#include "cuda/device_pool.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl_transport.hpp"

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
                                     .zero_copy_import = false,
                                     .collective = true};

// nccl: the transport where NCCL can run (a CUDA build, a device, a loadable libnccl.so.2),
// blocked with the cause elsewhere.
transport_entry nccl_entry() {
  auto make = [](const transport_options& options) -> result<std::unique_ptr<transport>> {
    if (auto r = nccl::ready(); !r) {
      return make_error(errc::blocked, r.error().message + " (transport nccl)");
    }
    return nccl::make_transport(options, nccl::cuda_fabric);
  };
  return {"nccl", "cluster, GPU memory: bucketed broadcast over one NCCL communicator", cluster_gpu,
          std::move(make)};
}

// cuda-ipc and cuda-vmm: the transports where this build has CUDA, blocked with the cause where
// the machine cannot run them.
transport_entry device_entry(device_pool::sharing kind, std::string name, std::string summary) {
#if WSYNC_HAVE_CUDA
  auto make = [kind, name](const transport_options& options) -> result<std::unique_ptr<transport>> {
    if (auto r = gpu::ready(); !r) {
      return make_error(errc::blocked, r.error().message + " (transport " + name + ")");
    }
    return device_pool::make_device_transport(kind, options);
  };
  return {std::move(name), std::move(summary), same_node_gpu, std::move(make)};
#else
  // No CUDA in this build: building it answers why (gpu::ready()'s cause).
  (void)kind;
  auto make = [name](const transport_options&) -> result<std::unique_ptr<transport>> {
    return make_error(errc::blocked, gpu::ready().error().message + " (transport " + name + ")");
  };
  return {std::move(name), std::move(summary), same_node_gpu, std::move(make)};
#endif
}

}  // namespace

std::vector<transport_entry> gpu_transport_entries() {
  return {
      device_entry(device_pool::sharing::ipc, "cuda-ipc",
                   "one node, GPU memory: pooled device segments, one cudaIpcMemHandle each"),
      device_entry(device_pool::sharing::vmm, "cuda-vmm",
                   "one node, GPU memory: cuMemCreate segments shared as POSIX fds (SCM_RIGHTS)"),
      nccl_entry(),
  };
}

}  // namespace wsync
