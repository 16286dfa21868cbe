// join_endpoint (wsync/transports/nccl_receiver.hpp): the receiving member of vLLM's NCCL group,
// over wsync::nccl::communicator and device memory. Receives and copies run on the
// communicator's stream, so they run in the order they were queued.

#include <algorithm>

#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl_receiver.hpp"

#if WSYNC_HAVE_NCCL
#include "nccl/device_memory.hpp"
#endif

namespace wsync::nccl {

#if WSYNC_HAVE_NCCL

namespace {

class nccl_endpoint final : public broadcast_endpoint {
 public:
  explicit nccl_endpoint(communicator comm) : comm_(std::move(comm)) {}

  memory_location memory() const override { return {comm_.device()}; }

  result<block> allocate(std::uint64_t nbytes) override {
    return device_block(comm_.device(), nbytes, describe());
  }

  result<void> receive(std::span<std::byte> into,
                       std::chrono::steady_clock::time_point deadline) override {
    return comm_.broadcast(into.data(), into.size(), 0, deadline);
  }

  result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) override {
    if (nbytes == 0) return {};
    gpu::on_device on(comm_.device());
    auto* stream = static_cast<cudaStream_t>(comm_.stream());
    if (auto e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, stream);
        e != cudaSuccess) {
      const auto why = describe() + ": cudaMemcpyAsync failed (" + cuda_text(e) + ")";
      comm_.abort(why);  // the receives queued before it must not land in freed memory
      return make_error(errc::io_error, why);
    }
    return {};
  }

  result<void> wait(std::chrono::steady_clock::time_point deadline) override {
    return comm_.wait(deadline);
  }

  result<std::vector<std::uint64_t>> checksums(std::span<const std::span<const std::byte>> ranges,
                                               const checksum_method& method) override {
    std::vector<gpu::device_range> on_device;
    for (const auto& r : ranges) on_device.push_back({r.data(), r.size()});
    gpu::on_device on(comm_.device());
    return gpu::checksums(on_device, method, comm_.stream());
  }

  void abort(const std::string& why) override { comm_.abort(why); }

  std::string broken() const override { return comm_.aborted(); }

  std::string describe() const override {
    return "NCCL rank " + std::to_string(comm_.rank()) + " of " + std::to_string(comm_.size()) +
           " on cuda:" + std::to_string(comm_.device());
  }

 private:
  communicator comm_;
};

}  // namespace

result<std::unique_ptr<broadcast_endpoint>> join_endpoint(const unique_id& id, int world, int rank,
                                                          int device,
                                                          std::chrono::milliseconds timeout,
                                                          const std::atomic<bool>* cancel) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto comm = communicator::join(id, world, rank, device, timeout, cancel);
  if (!comm) return comm.error();
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  // A failed warm-up aborted the communicator itself (rank 0 may be inside its all_reduce).
  if (auto w = comm->warm_up(std::max(left, std::chrono::milliseconds(1))); !w) return w.error();
  return std::unique_ptr<broadcast_endpoint>(std::make_unique<nccl_endpoint>(std::move(*comm)));
}

#else

result<std::unique_ptr<broadcast_endpoint>> join_endpoint(const unique_id&, int, int, int,
                                                          std::chrono::milliseconds,
                                                          const std::atomic<bool>*) {
  return ready().error();
}

#endif

}  // namespace wsync::nccl
