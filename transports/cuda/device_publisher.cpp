// The publisher half of cuda-ipc and cuda-vmm: a ring of device slots, each exported once, and
// (cuda-vmm) the socket that hands their descriptors to consumers.

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <condition_variable>
#include <cstring>
#include <thread>
#include <vector>

#include "cuda/device_common.hpp"
#include "src/fd_passing.hpp"
#include "src/slot_ring.hpp"

namespace wsync::device_pool::detail {
namespace {

struct slot {
  std::string id;  // empty: not allocated
  std::byte* base = nullptr;
  std::uint64_t capacity = 0;  // bytes allocated (granularity-aligned)
  update_id holder;
  std::vector<std::uint64_t> offsets;
  std::string memory;  // ipc handle, hex
  CUmemGenericAllocationHandle vmm = 0;
  int vmm_fd = -1;
  cudaEvent_t event = nullptr;
  std::string event_handle;
};

class publisher final : public publisher_transport {
 public:
  static result<std::unique_ptr<publisher>> make(const pool_config& cfg) {
    auto p = std::unique_ptr<publisher>(new publisher(cfg));
    if (auto ok = p->open(); !ok) return ok.error();
    return p;
  }

  ~publisher() override {
    stop_server();
    gpu::on_device on(cfg_.device);
    for (auto& s : slots_) free_slot(*s);
    for (auto [base, event] : retired_) {
      if (event) cudaEventDestroy(event);
      if (base) cudaFree(base);
    }
    if (control_) ::munmap(control_, control_bytes);
    if (!control_name_.empty()) ::shm_unlink(("/" + control_name_).c_str());
    if (stream_) cudaStreamDestroy(stream_);
  }

  memory_location memory() const override { return {cfg_.device}; }

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds wait) override {
    std::uint64_t need = 0;
    auto offsets = slot_ring::layout(sizes, segment_alignment, need);
    std::unique_lock lock(mutex_);
    for (const auto& s : slots_) {
      if (s->holder == id) {
        return make_error(errc::invalid_argument, std::string(kind_name(cfg_.kind)) +
                                                      ": update_id " + id +
                                                      " acquired twice (field update_id)");
      }
    }
    auto picked = slot_ring::choose(slots_, need, cfg_.slots, lock, cv_, wait, kind_name(cfg_.kind),
                                    id, [&](slot& s) -> result<void> {
                                      free_slot(s, true);
                                      if (auto ok = control_open(); !ok) return ok;
                                      return allocate(s, need + need / 8);
                                    });
    if (!picked) return picked.error();
    slot* chosen = *picked;
    chosen->holder = id;
    chosen->offsets = offsets;
    // About to be rewritten: a consumer holding the previous handle is refused from now on.
    generation(*chosen).fetch_add(1, std::memory_order_acq_rel);
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      spans.emplace_back(chosen->base + offsets[i], sizes[i]);
    }
    return spans;
  }

  result<std::string> expose(const update_id& id) override {
    std::lock_guard lock(mutex_);
    slot* s = find(id);
    if (!s) {
      return make_error(errc::unknown_update, "unknown update_id: " + id +
                                                  " was not acquired from " + kind_name(cfg_.kind));
    }
    // The caller's copies into the slot completed before expose (publisher_transport::expose
    // asks that: weight_publisher synchronizes its stream when it takes the digests). This
    // record, on a stream of our own, orders nothing more; consumers' streams wait on it as on
    // a marker that the slot was sealed.
    gpu::on_device on(cfg_.device);
    if (auto e = cudaEventRecord(s->event, stream_); e != cudaSuccess) {
      return make_error(errc::io_error, std::string(kind_name(cfg_.kind)) +
                                            ": cudaEventRecord failed (" + cuda_text(e) +
                                            ") for update_id=" + id);
    }
    handle h;
    h.pool = pool_id_;
    h.slot = index_of(*s);
    h.id = s->id;
    h.control = control_name_;
    h.generation = generation(*s).fetch_add(1, std::memory_order_acq_rel) + 1;
    h.capacity = s->capacity;
    h.pid = ::getpid();
    h.device = cfg_.device;
    h.memory = s->memory;
    h.socket = socket_name_;
    h.event = s->event_handle;
    h.offsets = s->offsets;
    return handle_encode(h);
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    if (slot* s = find(id)) {
      s->holder.clear();
      cv_.notify_all();
    }
  }

 private:
  explicit publisher(pool_config cfg) : cfg_(cfg), pool_id_(random_hex(8)) {}

  result<void> open() {
    const std::string who = kind_name(cfg_.kind);
    gpu::on_device on(cfg_.device);
    if (auto e = static_cast<cudaError_t>(on.status()); e != cudaSuccess) {
      return make_error(errc::blocked, "blocked: " + who + ": device " +
                                           std::to_string(cfg_.device) + " (" + cuda_text(e) + ")");
    }
    if (auto e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess) {
      return make_error(errc::io_error, who + ": cudaStreamCreate failed (" + cuda_text(e) + ")");
    }
    if (cfg_.kind == sharing::vmm) return start_server();
    return {};
  }

  // The pool's generation page, made with the first slot (mutex_ held).
  result<void> control_open() {
    if (control_) return {};
    const std::string who = kind_name(cfg_.kind);
    control_name_ = "wsync-" + std::to_string(::getpid()) + "-gpu-" + random_hex(16);
    int fd = ::shm_open(("/" + control_name_).c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      auto err = std::string(std::strerror(errno));
      control_name_.clear();
      return make_error(errc::io_error, who + ": shm_open of the generation page failed: " + err);
    }
    bool sized = ::ftruncate(fd, control_bytes) == 0;
    void* p = sized ? ::mmap(nullptr, control_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                    : MAP_FAILED;
    ::close(fd);
    if (p == MAP_FAILED) {
      return make_error(errc::io_error,
                        who + ": the generation page cannot be mapped: " + std::strerror(errno));
    }
    control_ = static_cast<control_header*>(p);
    std::memcpy(control_->magic, control_magic, sizeof control_magic);
    control_->layout = 1;
    control_->owner_pid = ::getpid();
    return {};
  }

  std::atomic<std::uint64_t>& generation(const slot& s) {
    return control_->generation[index_of(s)];
  }

  std::size_t index_of(const slot& s) const {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].get() == &s) return i;
    }
    return 0;
  }

  slot* find(const update_id& id) {
    for (auto& s : slots_) {
      if (s->holder == id) return s.get();
    }
    return nullptr;
  }

  // Allocates `bytes` (rounded up) of device memory for `s` and exports it once.
  result<void> allocate(slot& s, std::uint64_t bytes) {
    const std::string who = kind_name(cfg_.kind);
    gpu::on_device on(cfg_.device);
    auto fail = [&](const std::string& what) -> result<void> {
      free_slot(s);
      return make_error(errc::io_error, who + ": " + what + " for a slot of " +
                                            std::to_string(bytes) +
                                            " bytes on cuda:" + std::to_string(cfg_.device));
    };
    if (cfg_.kind == sharing::ipc) {
      s.capacity = align_up(bytes, std::uint64_t{2} << 20);
      void* p = nullptr;
      if (auto e = cudaMalloc(&p, s.capacity); e != cudaSuccess) {
        s.capacity = 0;
        return fail("cudaMalloc failed (" + cuda_text(e) + ")");
      }
      s.base = static_cast<std::byte*>(p);
      cudaIpcMemHandle_t mh{};
      if (auto e = cudaIpcGetMemHandle(&mh, p); e != cudaSuccess) {
        return fail("cudaIpcGetMemHandle failed (" + cuda_text(e) + ")");
      }
      s.memory = hex_of(&mh, sizeof mh);
    } else {
      auto d = driver();
      if (!d) return d.error();
      const auto props = vmm_props(cfg_.device);
      std::size_t grain = 0;
      if (auto r = (*d)->granularity(&grain, &props, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
          r != CUDA_SUCCESS || grain == 0) {
        return fail("cuMemGetAllocationGranularity failed (" + driver_text(r) + ")");
      }
      s.capacity = align_up(bytes, grain);
      if (auto r = (*d)->create(&s.vmm, s.capacity, &props, 0); r != CUDA_SUCCESS) {
        s.vmm = 0;
        s.capacity = 0;
        return fail("cuMemCreate failed (" + driver_text(r) + ")");
      }
      auto va = vmm_map(**d, s.vmm, s.capacity, cfg_.device);
      if (!va) return fail(va.error().message);
      s.base = reinterpret_cast<std::byte*>(*va);
      if (auto r =
              (*d)->export_handle(&s.vmm_fd, s.vmm, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
          r != CUDA_SUCCESS) {
        s.vmm_fd = -1;
        return fail("cuMemExportToShareableHandle failed (" + driver_text(r) + ")");
      }
      ::fcntl(s.vmm_fd, F_SETFD, FD_CLOEXEC);
    }
    if (auto e = cudaEventCreateWithFlags(&s.event, cudaEventDisableTiming | cudaEventInterprocess);
        e != cudaSuccess) {
      s.event = nullptr;
      return fail("cudaEventCreate(interprocess) failed (" + cuda_text(e) + ")");
    }
    cudaIpcEventHandle_t eh{};
    if (auto e = cudaIpcGetEventHandle(&eh, s.event); e != cudaSuccess) {
      return fail("cudaIpcGetEventHandle failed (" + cuda_text(e) + ")");
    }
    s.event_handle = hex_of(&eh, sizeof eh);
    s.id = random_hex(16);
    std::lock_guard lock(local_slots::get().mu);
    local_slots::get().by_id[s.id] = {s.base, s.event};
    return {};
  }

  // `retire`: a slot re-made for a larger update while the publisher runs. Consumers cache each
  // slot's cuda-ipc mapping and close it only at their next import of that slot; freeing an
  // exported allocation before its importers close it is undefined (cudaIpcOpenMemHandle's
  // documentation), so the old one is kept until the publisher exits, where every slot goes
  // (a publisher exiting under its importers is the case tested). cuda-vmm allocations are
  // counted by the driver, and go at once.
  void free_slot(slot& s, bool retire = false) {
    gpu::on_device on(cfg_.device);  // a re-made slot's caller (acquire) may have no context
    if (!s.id.empty()) {
      // Gone from here on: a consumer holding a handle of it (one that cached the slot
      // included) is refused, and a reader's intact() fails, instead of reading freed memory.
      if (control_) generation(s).fetch_add(1, std::memory_order_acq_rel);
      std::lock_guard lock(local_slots::get().mu);
      local_slots::get().by_id.erase(s.id);
    }
    if (retire && (s.base || s.event)) {
      // The event too, for either kind: a consumer of this process borrows it, and may be about
      // to wait on it (its generation check came just before this re-make).
      retired_.emplace_back(cfg_.kind == sharing::ipc ? s.base : nullptr, s.event);
    } else if (s.event) {
      cudaEventDestroy(s.event);
    }
    if (cfg_.kind == sharing::ipc) {
      if (s.base && !retire) cudaFree(s.base);
    } else if (auto d = driver()) {
      if (s.base) vmm_unmap(**d, reinterpret_cast<CUdeviceptr>(s.base), s.capacity);
      if (s.vmm) (*d)->release(s.vmm);
    }
    if (s.vmm_fd >= 0) ::close(s.vmm_fd);
    s = slot{};
  }

  // --- cuda-vmm: hands a slot's descriptor to a consumer process of the same user -------------

  result<void> start_server() {
    socket_name_ = socket_prefix() + std::to_string(::getpid()) + "-" + pool_id_;
    listen_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    auto len = fd_passing::abstract_address(socket_name_, a);
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (listen_fd_ < 0 || wake_fd_ < 0 ||
        ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), len) != 0 ||
        ::listen(listen_fd_, 64) != 0) {
      return make_error(errc::io_error, "cuda-vmm: cannot listen on the abstract socket " +
                                            socket_name_ + ": " + std::strerror(errno));
    }
    server_ = std::thread(
        [this] { fd_passing::serve(listen_fd_, wake_fd_, [this](int c) { answer(c); }); });
    return {};
  }

  void stop_server() {
    if (server_.joinable()) {
      std::uint64_t one = 1;
      (void)!::write(wake_fd_, &one, sizeof one);
      server_.join();
    }
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  // One request: the slot id (32 hex digits). The answer: "ok" with the descriptor, or why not.
  void answer(int c) {
    fd_passing::set_timeouts(c, 2000);
    if (!fd_passing::same_user(c)) {
      const char no[] = "refused: another user";
      (void)fd_passing::send_with_fd(c, no, sizeof no - 1, -1);
      return;
    }
    char id[33] = {};
    int ignored = -1;
    ssize_t n = fd_passing::receive_with_fd(c, id, 32, &ignored);
    if (ignored >= 0) ::close(ignored);
    if (n != 32) return;
    int fd = -1;
    {
      // A copy of the descriptor: once the lock is dropped the slot may be freed (its fd
      // closed, the number reused by the next allocation's), and the answer must still be this
      // slot's memory.
      std::lock_guard lock(mutex_);
      for (const auto& s : slots_) {
        if (s->id == std::string(id, 32) && s->vmm_fd >= 0)
          fd = ::fcntl(s->vmm_fd, F_DUPFD_CLOEXEC, 0);
      }
    }
    if (fd < 0) {
      const char no[] = "unknown slot (the publisher replaced or freed it)";
      (void)fd_passing::send_with_fd(c, no, sizeof no - 1, -1);
      return;
    }
    (void)fd_passing::send_with_fd(c, "ok", 2, fd);
    ::close(fd);
  }

  pool_config cfg_;
  std::string pool_id_;
  std::string control_name_;
  control_header* control_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<slot>> slots_;
  std::vector<std::pair<std::byte*, cudaEvent_t>> retired_;  // re-made slots': see free_slot
  std::string socket_name_;                                  // cuda-vmm
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread server_;
};

}  // namespace

result<std::unique_ptr<publisher_transport>> make_publisher(const pool_config& cfg) {
  auto p = publisher::make(cfg);
  if (!p) return p.error();
  return std::unique_ptr<publisher_transport>(std::move(*p));
}

}  // namespace wsync::device_pool::detail
