// cuda_fabric (wsync/transports/nccl_transport.hpp): the nccl transport's groups as NCCL
// communicators on one CUDA device, its memory cudaMalloc'd there. Every collective of a member
// runs on its communicator's stream, in the order it was queued; copies on a stream of their own
// (nccl_member says how the two stay in order).

#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl_transport.hpp"

#include <algorithm>
#include <vector>

#if WSYNC_HAVE_NCCL
#include "nccl/device_memory.hpp"
#endif

namespace wsync::nccl {

#if WSYNC_HAVE_NCCL

result<block> device_block(int device, std::uint64_t nbytes, const std::string& who) {
  gpu::on_device on(device);
  void* p = nullptr;
  if (auto e = cudaMalloc(&p, nbytes); e != cudaSuccess) {
    return make_error(errc::io_error, who + ": cudaMalloc(" + std::to_string(nbytes) +
                                          " bytes) on cuda:" + std::to_string(device) +
                                          " failed (" + cuda_text(e) + ")");
  }
  std::shared_ptr<void> owner(p, [device](void* q) {
    gpu::on_device freeing(device);  // the freeing thread's context comes back
    (void)cudaFree(q);
  });
  return block{static_cast<std::byte*>(p), nbytes, std::move(owner)};
}

namespace {

// Broadcasts run on the communicator's stream; copies (the sender packing lent tensors into its
// bucket buffers) on a copy stream of their own, so packing bucket k + 1 overlaps the broadcast
// of bucket k. Events keep the order the interface promises: a broadcast waits for the copies
// queued before it, and a copy into a buffer waits for the last broadcast that read it.
class nccl_member final : public group_member {
 public:
  explicit nccl_member(communicator comm) : comm_(std::move(comm)) {}
  ~nccl_member() override {
    gpu::on_device on(comm_.device());
    for (auto& r : reads_) (void)cudaEventDestroy(r.done);
    if (copied_) (void)cudaEventDestroy(copied_);
    if (copy_stream_) (void)cudaStreamDestroy(copy_stream_);
  }
  nccl_member(const nccl_member&) = delete;
  nccl_member& operator=(const nccl_member&) = delete;

  result<void> broadcast(std::byte* data, std::uint64_t nbytes, int root,
                         std::chrono::steady_clock::time_point deadline) override {
    auto* stream = static_cast<cudaStream_t>(comm_.stream());
    gpu::on_device on(comm_.device());
    if (copies_queued_) {  // the broadcast waits for what was packed before it
      auto e = cudaEventRecord(copied_, copy_stream_);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, copied_, 0);
      if (e != cudaSuccess) return failure("ordering a broadcast after its copies", e);
      copies_queued_ = false;
    }
    if (auto r = comm_.broadcast(data, nbytes, root, deadline); !r) {
      drain_copies();  // the communicator aborted itself
      return r;
    }
    if (!copy_stream_) return {};  // nothing is packed here: no buffer to guard
    // Remember that this range is read until the broadcast is done; forget ranges whose
    // broadcasts are done.
    std::erase_if(reads_, [&](const read& r) {
      if (r.data == data || cudaEventQuery(r.done) != cudaSuccess) return false;
      (void)cudaEventDestroy(r.done);
      return true;
    });
    auto it =
        std::find_if(reads_.begin(), reads_.end(), [&](const read& r) { return r.data == data; });
    if (it == reads_.end()) {
      cudaEvent_t ev = nullptr;
      if (auto e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess) {
        return failure("cudaEventCreateWithFlags", e);
      }
      it = reads_.insert(reads_.end(), {data, nbytes, ev});
    }
    it->nbytes = std::max(it->nbytes, nbytes);
    if (auto e = cudaEventRecord(it->done, stream); e != cudaSuccess) {
      return failure("cudaEventRecord after a broadcast", e);
    }
    return {};
  }

  result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) override {
    if (nbytes == 0) return {};
    gpu::on_device on(comm_.device());
    if (!copy_stream_) {
      if (auto e = cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking);
          e != cudaSuccess) {
        return failure("cudaStreamCreateWithFlags", e);
      }
      if (auto e = cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming); e != cudaSuccess) {
        return failure("cudaEventCreateWithFlags", e);
      }
    }
    for (const auto& r : reads_) {  // a buffer is written only after its last broadcast
      if (dst < r.data + r.nbytes && r.data < dst + nbytes) {
        if (auto e = cudaStreamWaitEvent(copy_stream_, r.done, 0); e != cudaSuccess) {
          return failure("ordering a copy after a broadcast", e);
        }
      }
    }
    if (auto e = cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, copy_stream_);
        e != cudaSuccess) {
      return failure("cudaMemcpyAsync of " + std::to_string(nbytes) + " bytes", e);
    }
    copies_queued_ = true;
    return {};
  }

  result<void> wait(std::chrono::steady_clock::time_point deadline) override {
    // Every copy is followed by the broadcast that waits for it, so the communicator's stream
    // covers the copies, except when it failed.
    auto r = comm_.wait(deadline);
    if (!r) drain_copies();  // the communicator aborted itself
    return r;
  }
  void abort(const std::string& why) override {
    comm_.abort(why);
    drain_copies();
  }
  std::string broken() const override { return comm_.aborted(); }

 private:
  struct read {
    std::byte* data;
    std::uint64_t nbytes;
    cudaEvent_t done;
  };

  // Once the communicator is aborted (its kernels end, so the events copies wait on complete):
  // waits for the queued copies, so none still reads a source the caller may then free.
  void drain_copies() {
    if (!copy_stream_) return;
    gpu::on_device on(comm_.device());
    (void)cudaStreamSynchronize(copy_stream_);
  }

  error failure(const std::string& what, cudaError_t e) {
    return {errc::io_error, "nccl: " + what + " failed (" + cuda_text(e) + ")"};
  }

  communicator comm_;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t copied_ = nullptr;
  bool copies_queued_ = false;
  /// Once this member packs: the ranges broadcasts still read, each with the event recorded
  /// after the last broadcast of it.
  std::vector<read> reads_;
};

// Headers move between host and device on a stream of the fabric's own that does not
// synchronise with the legacy default stream: a trainer's or an engine's kernels queued there
// (torch's default stream) never hold up a broadcast.
class cuda_nccl_fabric final : public group_fabric {
 public:
  cuda_nccl_fabric(int device, cudaStream_t io) : device_(device), io_(io) {}
  ~cuda_nccl_fabric() override {
    gpu::on_device on(device_);
    (void)cudaStreamDestroy(io_);
  }
  cuda_nccl_fabric(const cuda_nccl_fabric&) = delete;
  cuda_nccl_fabric& operator=(const cuda_nccl_fabric&) = delete;

  memory_location memory() const override { return {device_}; }

  result<unique_id> make_id() override { return make_unique_id(); }

  result<std::unique_ptr<group_member>> join(const unique_id& id, int world, int rank,
                                             std::chrono::milliseconds timeout,
                                             const std::atomic<bool>* cancel) override {
    auto comm = communicator::join(id, world, rank, device_, timeout, cancel);
    if (!comm) return comm.error();
    return std::unique_ptr<group_member>(std::make_unique<nccl_member>(std::move(*comm)));
  }

  result<block> allocate(std::uint64_t nbytes) override {
    return device_block(device_, nbytes, "nccl");
  }

  result<void> write(std::byte* dst, const void* src, std::uint64_t nbytes) override {
    return copy(dst, src, nbytes, cudaMemcpyHostToDevice, "to");
  }

  result<void> read(void* dst, const std::byte* src, std::uint64_t nbytes) override {
    return copy(dst, src, nbytes, cudaMemcpyDeviceToHost, "from");
  }

  void reads_done() override {
    gpu::on_device on(device_);  // the caller's thread keeps its context (none included)
    (void)cudaStreamSynchronize(cudaStreamLegacy);
  }

 private:
  // Done when the stream is: then every stream launched after sees the bytes.
  result<void> copy(void* dst, const void* src, std::uint64_t nbytes, cudaMemcpyKind kind,
                    const char* direction) {
    gpu::on_device on(device_);
    auto e = cudaMemcpyAsync(dst, src, nbytes, kind, io_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(io_);
    if (e != cudaSuccess) {
      return make_error(errc::io_error, std::string("nccl: copying ") + direction +
                                            " cuda:" + std::to_string(device_) + " failed (" +
                                            cuda_text(e) + ")");
    }
    return {};
  }

  int device_;
  cudaStream_t io_;
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
  gpu::on_device on(device);
  cudaStream_t io = nullptr;
  if (auto e = cudaStreamCreateWithFlags(&io, cudaStreamNonBlocking); e != cudaSuccess) {
    return make_error(errc::io_error,
                      "nccl: cudaStreamCreateWithFlags on cuda:" + std::to_string(device) +
                          " failed (" + cuda_text(e) + ")");
  }
  return std::shared_ptr<group_fabric>(std::make_shared<cuda_nccl_fabric>(device, io));
}

#else

result<std::shared_ptr<group_fabric>> cuda_fabric(int) {
  return ready().error();
}

#endif

}  // namespace wsync::nccl
