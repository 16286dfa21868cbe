// cuda_fabric (wsync/transports/nccl_transport.hpp): the nccl transport's groups as NCCL
// communicators on one CUDA device, its memory cudaMalloc'd there. Every collective of a member
// runs on its communicator's stream, in the order it was queued.

#include "wsync/transports/nccl_transport.hpp"

#if WSYNC_HAVE_NCCL
#include "nccl/device_memory.hpp"
#endif

namespace wsync::nccl {

#if WSYNC_HAVE_NCCL

result<block> device_block(int device, std::uint64_t nbytes, const std::string& who) {
  (void)cudaSetDevice(device);
  void* p = nullptr;
  if (auto e = cudaMalloc(&p, nbytes); e != cudaSuccess) {
    return make_error(errc::io_error, who + ": cudaMalloc(" + std::to_string(nbytes) +
                                          " bytes) on cuda:" + std::to_string(device) +
                                          " failed (" + cuda_text(e) + ")");
  }
  std::shared_ptr<void> owner(p, [device](void* q) {
    (void)cudaSetDevice(device);
    (void)cudaFree(q);
  });
  return block{static_cast<std::byte*>(p), nbytes, std::move(owner)};
}

namespace {

class nccl_member final : public group_member {
 public:
  explicit nccl_member(communicator comm) : comm_(std::move(comm)) {}
  result<void> broadcast(std::byte* data, std::uint64_t nbytes, int root) override {
    return comm_.broadcast(data, nbytes, root);
  }
  result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) override {
    if (nbytes == 0) return {};
    (void)cudaSetDevice(comm_.device());
    if (auto e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault,
                                 static_cast<cudaStream_t>(comm_.stream()));
        e != cudaSuccess) {
      return make_error(errc::io_error, "nccl: cudaMemcpyAsync of " + std::to_string(nbytes) +
                                            " bytes failed (" + cuda_text(e) + ")");
    }
    return {};
  }
  result<void> wait(std::chrono::steady_clock::time_point deadline) override {
    return comm_.wait(deadline);
  }
  void abort(const std::string& why) override { comm_.abort(why); }
  std::string broken() const override { return comm_.aborted(); }

 private:
  communicator comm_;
};

class cuda_nccl_fabric final : public group_fabric {
 public:
  explicit cuda_nccl_fabric(int device) : device_(device) {}

  memory_location memory() const override { return {device_}; }

  result<unique_id> make_id() override { return make_unique_id(); }

  result<std::unique_ptr<group_member>> join(const unique_id& id, int world, int rank,
                                             std::chrono::milliseconds timeout) override {
    auto comm = communicator::join(id, world, rank, device_, timeout);
    if (!comm) return comm.error();
    return std::unique_ptr<group_member>(std::make_unique<nccl_member>(std::move(*comm)));
  }

  result<block> allocate(std::uint64_t nbytes) override {
    return device_block(device_, nbytes, "nccl");
  }

  result<void> write(std::byte* dst, const void* src, std::uint64_t nbytes) override {
    (void)cudaSetDevice(device_);
    // From pageable memory cudaMemcpy may return before the DMA lands; the communicator's
    // stream does not wait on the legacy stream, so wait for it here.
    auto e = cudaMemcpy(dst, src, nbytes, cudaMemcpyHostToDevice);
    if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
    if (e != cudaSuccess) {
      return make_error(errc::io_error, "nccl: copying to cuda:" + std::to_string(device_) +
                                            " failed (" + cuda_text(e) + ")");
    }
    return {};
  }

  result<void> read(void* dst, const std::byte* src, std::uint64_t nbytes) override {
    (void)cudaSetDevice(device_);
    if (auto e = cudaMemcpy(dst, src, nbytes, cudaMemcpyDeviceToHost); e != cudaSuccess) {
      return make_error(errc::io_error, "nccl: copying from cuda:" + std::to_string(device_) +
                                            " failed (" + cuda_text(e) + ")");
    }
    return {};
  }

 private:
  int device_;
};

}  // namespace

result<std::shared_ptr<group_fabric>> cuda_fabric(int device) {
  if (auto r = ready(); !r) return r.error();
  int devices = 0;
  (void)cudaGetDeviceCount(&devices);
  if (device >= devices) {
    return make_error(errc::blocked, "blocked: nccl: no CUDA device " + std::to_string(device) +
                                         " (this machine has " + std::to_string(devices) + ")");
  }
  return std::shared_ptr<group_fabric>(std::make_shared<cuda_nccl_fabric>(device));
}

#else

result<std::shared_ptr<group_fabric>> cuda_fabric(int) {
  return ready().error();
}

#endif

}  // namespace wsync::nccl
