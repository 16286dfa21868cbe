// wsync::nccl (wsync/transports/nccl.hpp): NCCL loaded at run time, and one rank's membership in a
// communicator in NCCL's non-blocking mode. Built everywhere; without NCCL in the build every
// call answers why.

#include <thread>
#include <utility>

#include "wsync/transports/gpu.hpp"
#include "wsync/transports/nccl.hpp"

#if WSYNC_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#endif

namespace wsync::nccl {
namespace {

// A rank outside the group is the caller's mistake, whatever this build can run.
result<void> rank_check(int nranks, int rank) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return make_error(errc::invalid_argument, "NCCL: rank " + std::to_string(rank) +
                                                  " is not in a communicator of " +
                                                  std::to_string(nranks));
  }
  return {};
}

}  // namespace

#if WSYNC_HAVE_NCCL

namespace {

// The entry points wsync calls, resolved once from the library.
struct library {
  std::string error;  ///< why it could not be loaded; empty when it was
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&::ncclCommGetAsyncError) async_error = nullptr;
  decltype(&::ncclCommFinalize) finalize = nullptr;
  decltype(&::ncclCommDestroy) destroy = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclAllReduce) all_reduce = nullptr;
  decltype(&::ncclGetErrorString) error_string = nullptr;
  decltype(&::ncclGetLastError) last_error = nullptr;
};

const library& nccl_library() {
  static const library lib = [] {
    library l;
    const char* env = std::getenv("WSYNC_NCCL_LIBRARY");
    const std::string path = env && *env ? env : "libnccl.so.2";
    void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* why = ::dlerror();
      l.error = "blocked: NCCL library not loadable (" + std::string(why ? why : path) +
                "); set WSYNC_NCCL_LIBRARY to libnccl.so.2's path";
      return l;
    }
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
      if (!fn && l.error.empty()) {
        l.error = "blocked: NCCL library " + path + " lacks " + name + " (NCCL 2.14 or newer)";
      }
    };
    bind(l.get_version, "ncclGetVersion");
    bind(l.get_unique_id, "ncclGetUniqueId");
    bind(l.init_rank_config, "ncclCommInitRankConfig");
    bind(l.async_error, "ncclCommGetAsyncError");
    bind(l.finalize, "ncclCommFinalize");
    bind(l.destroy, "ncclCommDestroy");
    bind(l.comm_abort, "ncclCommAbort");
    bind(l.broadcast, "ncclBroadcast");
    bind(l.all_reduce, "ncclAllReduce");
    bind(l.error_string, "ncclGetErrorString");
    bind(l.last_error, "ncclGetLastError");
    return l;  // the library stays loaded for the process's life
  }();
  return lib;
}

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// "ncclSystemError: <NCCL's text> (<its last error>)".
std::string nccl_text(ncclResult_t r, ncclComm_t comm) {
  const auto& lib = nccl_library();
  std::string text = lib.error_string(r);
  const char* last = lib.last_error(comm);
  if (last && *last) text += " (" + std::string(last) + ")";
  return text;
}

using clock = std::chrono::steady_clock;

}  // namespace

struct communicator::state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int rank = -1;
  int size = 0;
  int device = -1;
  std::string aborted;
  const std::atomic<bool>* cancel = nullptr;  ///< set by another thread: stop waiting

  bool cancelled() const { return cancel && cancel->load(std::memory_order_relaxed); }

  ~state() {
    if (!comm && !stream) return;
    gpu::on_device on(device);  // the caller's context comes back, once the stream is gone too
    if (comm) {
      // Flush what this member sent (a root's last bytes may still be in NCCL's proxy), then
      // free; a finalize that cannot complete (a peer is gone) aborts instead.
      const auto& lib = nccl_library();
      const auto f = lib.finalize(comm);
      bool clean = f == ncclSuccess || f == ncclInProgress;
      const auto deadline = clock::now() + std::chrono::seconds(10);
      while (clean) {
        ncclResult_t st = ncclSuccess;
        if (lib.async_error(comm, &st) != ncclSuccess) st = ncclInternalError;
        if (st == ncclSuccess) break;
        if (st != ncclInProgress || clock::now() > deadline) {
          clean = false;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (clean) {
        lib.destroy(comm);
      } else {
        lib.comm_abort(comm);
      }
    }
    if (stream) (void)cudaStreamDestroy(stream);
  }

  error fail(errc code, const std::string& why) {
    abort(why);
    return {code, why};
  }

  void abort(const std::string& why) {
    if (comm) {
      gpu::on_device on(device);
      nccl_library().comm_abort(comm);
      comm = nullptr;
    }
    if (aborted.empty()) aborted = why;
  }

  std::string who() const {
    return "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size);
  }

  result<void> usable() const {
    if (!aborted.empty()) return make_error(errc::io_error, "communicator aborted: " + aborted);
    if (!comm) return make_error(errc::invalid_argument, "no NCCL communicator");
    return {};
  }

  // Non-blocking mode: after a call answers ncclInProgress, poll until the communicator
  // settles.
  result<void> settle(clock::time_point deadline, const std::string& what) {
    const auto& lib = nccl_library();
    for (;;) {
      ncclResult_t st = ncclSuccess;
      if (auto r = lib.async_error(comm, &st); r != ncclSuccess) st = r;
      if (st == ncclSuccess) return {};
      if (st != ncclInProgress) {
        return fail(errc::io_error, who() + ": " + what + " failed (" + nccl_text(st, comm) + ")");
      }
      if (clock::now() > deadline) {
        return fail(errc::timeout, who() + ": " + what + " did not complete by its deadline");
      }
      if (cancelled()) {
        return fail(errc::io_error, who() + ": " + what + " cancelled: the transport is closing");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  result<void> call(ncclResult_t r, clock::time_point deadline, const std::string& what) {
    if (r == ncclSuccess) return {};
    if (r == ncclInProgress) return settle(deadline, what);
    return fail(errc::io_error, who() + ": " + what + " failed (" + nccl_text(r, comm) + ")");
  }
};

result<void> ready() {
  if (auto r = gpu::ready(); !r) return r;
  if (const auto& lib = nccl_library(); !lib.error.empty()) {
    return make_error(errc::blocked, lib.error);
  }
  return {};
}

result<std::string> version() {
  if (auto r = ready(); !r) return r.error();
  int v = 0;
  if (nccl_library().get_version(&v) != ncclSuccess) {
    return make_error(errc::io_error, "NCCL: ncclGetVersion failed");
  }
  // NCCL_VERSION(X, Y, Z): X * 10000 + Y * 100 + Z since 2.9.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

result<unique_id> make_unique_id() {
  if (auto r = ready(); !r) return r.error();
  ncclUniqueId raw{};
  if (auto r = nccl_library().get_unique_id(&raw); r != ncclSuccess) {
    return make_error(errc::io_error, "NCCL: ncclGetUniqueId failed (" +
                                          std::string(nccl_library().error_string(r)) + ")");
  }
  static_assert(sizeof(raw) == unique_id_bytes);
  unique_id id{};
  std::memcpy(id.data(), &raw, id.size());
  return id;
}

result<communicator> communicator::join(const unique_id& id, int nranks, int rank, int device,
                                        std::chrono::milliseconds timeout,
                                        const std::atomic<bool>* cancel) {
  if (auto r = rank_check(nranks, rank); !r) return r.error();
  if (auto r = ready(); !r) return r.error();
  const auto deadline = clock::now() + timeout;
  if (cancel && cancel->load()) {
    return make_error(errc::io_error, "NCCL rank " + std::to_string(rank) + " of " +
                                          std::to_string(nranks) +
                                          ": joining cancelled: the transport is closing");
  }
  gpu::device_kept kept;  // the caller's context comes back, after `c` on a failure too
  communicator c;
  auto& s = *c.state_;
  s.cancel = cancel;
  s.rank = rank;
  s.size = nranks;
  s.device = device;
  if (auto e = cudaSetDevice(device); e != cudaSuccess) {
    return make_error(errc::io_error, s.who() + ": cudaSetDevice(" + std::to_string(device) +
                                          ") failed (" + cuda_text(e) + ")");
  }
  if (auto e = cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return make_error(errc::io_error,
                      s.who() + ": cudaStreamCreateWithFlags failed (" + cuda_text(e) + ")");
  }
  ncclUniqueId raw{};
  std::memcpy(&raw, id.data(), id.size());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto r = nccl_library().init_rank_config(&s.comm, nranks, raw, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    return s.fail(errc::io_error,
                  s.who() + ": ncclCommInitRankConfig failed (" + nccl_text(r, s.comm) + ")");
  }
  if (auto j = s.settle(deadline, "joining (ncclCommInitRankConfig)"); !j) {
    if (j.error().code == errc::timeout) {
      return make_error(errc::timeout, s.who() + ": the other members did not join within " +
                                           std::to_string(timeout.count()) + " ms");
    }
    return j.error();
  }
  return c;
}

communicator::communicator() : state_(std::make_unique<state>()) {}
communicator::communicator(communicator&& other) noexcept = default;
communicator& communicator::operator=(communicator&& other) noexcept = default;
communicator::~communicator() = default;

int communicator::rank() const {
  return state_ ? state_->rank : -1;
}
int communicator::size() const {
  return state_ ? state_->size : 0;
}
int communicator::device() const {
  return state_ ? state_->device : -1;
}
void* communicator::stream() const {
  return state_ ? state_->stream : nullptr;
}

result<void> communicator::warm_up(std::chrono::milliseconds timeout) {
  if (!state_) return make_error(errc::invalid_argument, "no NCCL communicator");
  auto& s = *state_;
  if (auto u = s.usable(); !u) return u;
  const auto deadline = clock::now() + timeout;
  gpu::on_device on_member(s.device);
  float* one = nullptr;
  // A failure before the all_reduce is queued aborts too: rank 0 is already inside its own.
  if (auto e = cudaMalloc(&one, sizeof(float)); e != cudaSuccess) {
    return s.fail(errc::io_error, s.who() + ": cudaMalloc failed (" + cuda_text(e) + ")");
  }
  struct freer {
    float* p;
    ~freer() { (void)cudaFree(p); }
  } hold{one};
  if (auto e = cudaMemsetAsync(one, 0, sizeof(float), s.stream); e != cudaSuccess) {
    return s.fail(errc::io_error, s.who() + ": cudaMemsetAsync failed (" + cuda_text(e) + ")");
  }
  const auto r = nccl_library().all_reduce(one, one, 1, ncclFloat32, ncclSum, s.comm, s.stream);
  if (auto c = s.call(r, deadline, "the warm-up all_reduce"); !c) return c;
  return wait(deadline);
}

result<void> communicator::broadcast(void* data, std::uint64_t nbytes, int root,
                                     clock::time_point deadline, void* stream) {
  if (!state_) return make_error(errc::invalid_argument, "no NCCL communicator");
  auto& s = *state_;
  if (auto u = s.usable(); !u) return u;
  if (root < 0 || root >= s.size) {
    return make_error(errc::invalid_argument,
                      s.who() + ": broadcast root " + std::to_string(root) + " is not a member");
  }
  gpu::on_device on_member(s.device);
  auto* on = stream ? static_cast<cudaStream_t>(stream) : s.stream;
  const auto r = nccl_library().broadcast(data, data, nbytes, ncclUint8, root, s.comm, on);
  // Enqueuing may wait for the peers' connections (NCCL connects at the first collective).
  return s.call(
      r, deadline,
      "ncclBroadcast of " + std::to_string(nbytes) + " bytes from rank " + std::to_string(root));
}

result<void> communicator::wait(std::chrono::steady_clock::time_point deadline, void* stream) {
  if (!state_) return make_error(errc::invalid_argument, "no NCCL communicator");
  auto& s = *state_;
  if (auto u = s.usable(); !u) return u;
  gpu::on_device on_member(s.device);
  auto* on = stream ? static_cast<cudaStream_t>(stream) : s.stream;
  for (;;) {
    const auto q = cudaStreamQuery(on);
    if (q != cudaSuccess && q != cudaErrorNotReady) {
      return s.fail(errc::io_error, s.who() + ": the stream failed (" + cuda_text(q) + ")");
    }
    ncclResult_t st = ncclSuccess;
    if (auto r = nccl_library().async_error(s.comm, &st); r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress) {
      return s.fail(errc::io_error, s.who() + ": a member failed (" + nccl_text(st, s.comm) + ")");
    }
    if (q == cudaSuccess) return {};
    if (clock::now() > deadline) {
      return s.fail(errc::timeout,
                    s.who() + ": the collectives did not complete by the deadline; aborted");
    }
    if (s.cancelled()) {
      return s.fail(errc::io_error, s.who() + ": cancelled: the transport is closing; aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void communicator::abort(const std::string& why) {
  if (state_) state_->abort(why);
}

const std::string& communicator::aborted() const {
  static const std::string none;
  return state_ ? state_->aborted : none;
}

#else  // built without NCCL

struct communicator::state {
  std::string aborted;
};

namespace {
error no_nccl() {
  if (auto r = gpu::ready(); !r) return r.error();
  return {errc::blocked,
          "blocked: built without NCCL (no nccl.h and libnccl found beside the CUDA toolkit or in "
          "the system at configure time)"};
}
}  // namespace

result<void> ready() {
  return no_nccl();
}
result<std::string> version() {
  return no_nccl();
}
result<unique_id> make_unique_id() {
  return no_nccl();
}
result<communicator> communicator::join(const unique_id&, int nranks, int rank, int,
                                        std::chrono::milliseconds, const std::atomic<bool>*) {
  if (auto r = rank_check(nranks, rank); !r) return r.error();
  return no_nccl();
}
communicator::communicator() : state_(std::make_unique<state>()) {}
communicator::communicator(communicator&& other) noexcept = default;
communicator& communicator::operator=(communicator&& other) noexcept = default;
communicator::~communicator() = default;
int communicator::rank() const {
  return -1;
}
int communicator::size() const {
  return 0;
}
int communicator::device() const {
  return -1;
}
void* communicator::stream() const {
  return nullptr;
}
result<void> communicator::warm_up(std::chrono::milliseconds) {
  return no_nccl();
}
result<void> communicator::broadcast(void*, std::uint64_t, int,
                                     std::chrono::steady_clock::time_point, void*) {
  return no_nccl();
}
result<void> communicator::wait(std::chrono::steady_clock::time_point, void*) {
  return no_nccl();
}
void communicator::abort(const std::string& why) {
  if (state_ && state_->aborted.empty()) state_->aborted = why;
}
const std::string& communicator::aborted() const {
  static const std::string none;
  return state_ ? state_->aborted : none;
}

#endif

}  // namespace wsync::nccl
