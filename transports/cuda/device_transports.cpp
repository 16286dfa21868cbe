// The cuda-ipc and cuda-vmm transports (device_pool.hpp says how they work). Built with CUDA
// only; gpu_transports.cpp registers them.

#include <cuda.h>  // driver types only: the functions come from cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <unordered_map>

#include "cuda/device_pool.hpp"
#include "cuda/gpu_transports.hpp"
#include "src/fd_passing.hpp"
#include "src/slot_ring.hpp"
#include "wsync/transports/gpu.hpp"

namespace wsync::device_pool {
namespace {

constexpr std::uint64_t segment_alignment = 4096;
constexpr std::uint64_t control_bytes = 4096;
constexpr char control_magic[8] = {'W', 'S', 'Y', 'N', 'C', 'G', 'P', 'U'};

std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

std::string driver_text(CUresult r) {
  return "CUresult " + std::to_string(static_cast<int>(r));
}

const char* kind_name(sharing k) {
  return k == sharing::ipc ? "cuda-ipc" : "cuda-vmm";
}

std::string hex_of(const void* data, std::size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) s += digits[p[i] >> 4], s += digits[p[i] & 15];
  return s;
}

void hex_to(const std::string& hex, void* out) {  // the handle parser checked the digits
  auto* p = static_cast<unsigned char*>(out);
  auto v = [](char c) {
    return c <= '9' ? c - '0' : c - 'a' + 10;
  };
  for (std::size_t i = 0; i < hex.size() / 2; ++i) {
    p[i] = static_cast<unsigned char>(v(hex[2 * i]) << 4 | v(hex[2 * i + 1]));
  }
}

// --- the driver's virtual memory functions, found through the runtime (no link to libcuda) ---

struct driver_api {
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
};

result<const driver_api*> driver() {
  static const result<driver_api> api = []() -> result<driver_api> {
    driver_api a;
    std::string missing;
    auto get = [&](auto& fn, const char* name) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
          p == nullptr) {
        missing += (missing.empty() ? "" : ", ") + std::string(name);
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
    };
    get(a.create, "cuMemCreate");
    get(a.release, "cuMemRelease");
    get(a.reserve, "cuMemAddressReserve");
    get(a.address_free, "cuMemAddressFree");
    get(a.map, "cuMemMap");
    get(a.unmap, "cuMemUnmap");
    get(a.set_access, "cuMemSetAccess");
    get(a.granularity, "cuMemGetAllocationGranularity");
    get(a.export_handle, "cuMemExportToShareableHandle");
    get(a.import_handle, "cuMemImportFromShareableHandle");
    get(a.attribute, "cuDeviceGetAttribute");
    if (!missing.empty()) {
      return make_error(errc::blocked, "blocked: the CUDA driver does not provide " + missing);
    }
    return a;
  }();
  if (!api) return api.error();
  return &*api;
}

CUmemAllocationProp vmm_props(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

// Reserves an address range for `handle`, maps it and makes it readable and writable by
// `device`; the address, or an error naming the step.
result<CUdeviceptr> vmm_map(const driver_api& d, CUmemGenericAllocationHandle handle,
                            std::uint64_t bytes, int device) {
  CUdeviceptr va = 0;
  if (auto r = d.reserve(&va, bytes, 0, 0, 0); r != CUDA_SUCCESS) {
    return make_error(errc::io_error, "cuMemAddressReserve failed (" + driver_text(r) + ")");
  }
  if (auto r = d.map(va, bytes, 0, handle, 0); r != CUDA_SUCCESS) {
    d.address_free(va, bytes);
    return make_error(errc::io_error, "cuMemMap failed (" + driver_text(r) + ")");
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (auto r = d.set_access(va, bytes, &access, 1); r != CUDA_SUCCESS) {
    d.unmap(va, bytes);
    d.address_free(va, bytes);
    return make_error(errc::io_error, "cuMemSetAccess failed (" + driver_text(r) + ")");
  }
  return va;
}

void vmm_unmap(const driver_api& d, CUdeviceptr va, std::uint64_t bytes) {
  d.unmap(va, bytes);
  d.address_free(va, bytes);
}

// --- the pool's generation page: host shared memory, one counter per slot ----------------------

struct control_header {
  char magic[8];
  std::uint32_t layout;
  std::int32_t owner_pid;
  std::atomic<std::uint64_t> generation[max_slots];
};
static_assert(sizeof(control_header) <= control_bytes);

// --- cuda-ipc slots made by this process, for consumers in the same process (CUDA cannot open
// its own IPC handles; cuda-vmm imports its own descriptors like any other) --------------------

struct local_slot {
  std::byte* base = nullptr;
  cudaEvent_t event = nullptr;
};

struct local_slots {
  std::mutex mu;
  std::unordered_map<std::string, local_slot> by_id;
  static local_slots& get() {
    static auto* s = new local_slots;  // never destroyed: consumers may outlive static dtors
    return *s;
  }
};

std::string socket_prefix() {
  return "wsync-vmm-" + std::to_string(::getuid()) + "-";
}

socklen_t address_of(const std::string& name, sockaddr_un& a) {
  std::memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
}

// ================================ publisher ====================================================

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

struct pool_config {
  sharing kind = sharing::ipc;
  int device = 0;
  std::uint64_t slots = 2;
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
    cudaSetDevice(cfg_.device);
    for (auto& s : slots_) free_slot(*s);
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
                                      free_slot(s);
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
    // The copies into the slot were queued (and waited for) before expose; a consumer's stream
    // waits on this record before it reads.
    cudaSetDevice(cfg_.device);
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
    if (auto e = cudaSetDevice(cfg_.device); e != cudaSuccess) {
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
    cudaSetDevice(cfg_.device);
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

  void free_slot(slot& s) {
    if (!s.id.empty()) {
      std::lock_guard lock(local_slots::get().mu);
      local_slots::get().by_id.erase(s.id);
    }
    if (s.event) cudaEventDestroy(s.event);
    if (cfg_.kind == sharing::ipc) {
      if (s.base) cudaFree(s.base);
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
    auto len = address_of(socket_name_, a);
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
      std::lock_guard lock(mutex_);
      for (const auto& s : slots_) {
        if (s->id == std::string(id, 32)) fd = s->vmm_fd;
      }
    }
    if (fd < 0) {
      const char no[] = "unknown slot (the publisher replaced or freed it)";
      (void)fd_passing::send_with_fd(c, no, sizeof no - 1, -1);
      return;
    }
    (void)fd_passing::send_with_fd(c, "ok", 2, fd);
  }

  pool_config cfg_;
  std::string pool_id_;
  std::string control_name_;
  control_header* control_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<slot>> slots_;
  std::string socket_name_;  // cuda-vmm
  int listen_fd_ = -1;
  int wake_fd_ = -1;
  std::thread server_;
};

// ================================ consumer =====================================================

// A slot opened in this process; cached while its pool's generation page exists.
struct mapping {
  std::string id;
  const std::byte* base = nullptr;
  std::uint64_t capacity = 0;
  int holds = 0;
  bool local = false;  // made by a publisher of this process: its event is that publisher's
  cudaEvent_t event = nullptr;
  CUmemGenericAllocationHandle vmm = 0;
};

struct control_map {
  std::string name;
  const control_header* page = nullptr;
  ~control_map() {
    if (page) ::munmap(const_cast<control_header*>(page), control_bytes);
  }
};

class consumer final : public consumer_transport {
 public:
  consumer(sharing kind, int device) : kind_(kind), device_(device) {}

  ~consumer() override {
    cudaSetDevice(device_);
    for (auto& [key, m] : maps_) close(m);
    for (auto& m : retired_) close(m);
  }

  memory_location memory() const override { return {device_}; }

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    auto h = handle_parse(m, kind_);
    if (!h) return h.error();
    const std::string who = kind_name(kind_);
    if (h->device != device_) {
      return make_error(
          errc::invalid_manifest,
          "invalid manifest: transport_handle: the update is on cuda:" + std::to_string(h->device) +
              ", this consumer reads cuda:" + std::to_string(device_) + " (option device) (" +
              update_context(m) + ")");
    }
    std::lock_guard lock(mutex_);
    cudaSetDevice(device_);
    auto control = control_of(*h, m);
    if (!control) return control.error();
    auto key = h->pool + "/" + std::to_string(h->slot);
    auto it = maps_.find(key);
    if (it != maps_.end() && it->second.id != h->id) {
      retire(it);  // the publisher replaced this slot with a larger one
      it = maps_.end();
    }
    if (it == maps_.end()) {
      forget_vanished_locked();
      auto opened = open(*h, m);
      if (!opened) return opened.error();
      it = maps_.emplace(key, *opened).first;
    }
    auto& mp = it->second;
    if (h->capacity > mp.capacity) {
      return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: capacity " +
                                                    std::to_string(h->capacity) +
                                                    " exceeds the opened slot (" +
                                                    update_context(m) + ")");
    }
    std::uint64_t gen = (*control)->page->generation[h->slot].load(std::memory_order_acquire);
    if (gen != h->generation) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id + " is no longer in " + who +
                            " memory: its slot now holds generation " + std::to_string(gen) +
                            ", the handle names " + std::to_string(h->generation) + " (" +
                            update_context(m) + ")");
    }
    // Reads on the legacy default stream (and the streams that synchronise with it) wait for
    // the publisher's copies; the host does not.
    if (auto e = cudaStreamWaitEvent(cudaStreamLegacy, mp.event, 0); e != cudaSuccess) {
      return make_error(errc::io_error, who + ": cudaStreamWaitEvent failed (" + cuda_text(e) +
                                            ") (" + update_context(m) + ")");
    }
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < h->offsets.size(); ++i) {
      spans.emplace_back(mp.base + h->offsets[i], m.segments[i].nbytes);
    }
    ++mp.holds;
    held_[m.update_id] = {key, mp.id};
    return spans;
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    auto [key, slot_id] = it->second;
    held_.erase(it);
    // Reads queued on the legacy stream finish before the publisher may rewrite the slot.
    cudaSetDevice(device_);
    cudaStreamSynchronize(cudaStreamLegacy);
    if (auto m = maps_.find(key); m != maps_.end() && m->second.id == slot_id) {
      --m->second.holds;
      return;
    }
    for (auto r = retired_.begin(); r != retired_.end(); ++r) {
      if (r->id != slot_id) continue;
      if (--r->holds == 0) {
        close(*r);
        retired_.erase(r);
      }
      return;
    }
  }

 private:
  result<std::shared_ptr<control_map>> control_of(const handle& h,
                                                  const weight_update_manifest& m) {
    if (auto it = controls_.find(h.pool); it != controls_.end()) return it->second;
    int fd = ::shm_open(("/" + h.control).c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id + ": the " + kind_name(kind_) +
                            " pool's generation page " + h.control +
                            " no longer exists (its publisher exited) (" + update_context(m) + ")");
    }
    void* p = ::mmap(nullptr, control_bytes, PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
      return make_error(errc::io_error, std::string(kind_name(kind_)) + ": mmap of " + h.control +
                                            " failed: " + std::strerror(errno));
    }
    auto c = std::make_shared<control_map>();
    c->name = h.control;
    c->page = static_cast<const control_header*>(p);
    if (std::memcmp(c->page->magic, control_magic, sizeof control_magic) != 0) {
      return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + h.control +
                                                    " is not a wsync GPU pool page (" +
                                                    update_context(m) + ")");
    }
    controls_[h.pool] = c;
    return c;
  }

  // Opens a slot once: its memory and its event. A handle CUDA refuses is "blocked" with the
  // error (some runtimes cannot rebuild legacy IPC handles: invalid resource handle).
  result<mapping> open(const handle& h, const weight_update_manifest& m) {
    const std::string who = kind_name(kind_);
    mapping mp;
    mp.id = h.id;
    mp.capacity = h.capacity;
    if (h.pid == ::getpid()) {
      // A slot of this very process: its event (and, for cuda-ipc, its memory) cannot be opened
      // through an IPC handle here, CUDA refuses it and leaves the context unusable.
      std::lock_guard lock(local_slots::get().mu);
      auto it = local_slots::get().by_id.find(h.id);
      if (it == local_slots::get().by_id.end()) {
        return make_error(errc::unknown_update, "unknown update_id: " + m.update_id + ": its " +
                                                    who + " slot was freed by its publisher (" +
                                                    update_context(m) + ")");
      }
      mp.event = it->second.event;
      mp.local = true;
      if (kind_ == sharing::ipc) {
        mp.base = it->second.base;
        return mp;
      }
    }
    auto blocked = [&](const std::string& what, cudaError_t e) -> error {
      (void)cudaGetLastError();  // reported here; later launch checks must not see it again
      return {errc::blocked, "blocked: " + who + ": " + what + " failed (" + cuda_text(e) + ") (" +
                                 update_context(m) + ")"};
    };
    cudaIpcEventHandle_t eh{};
    hex_to(h.event, &eh);
    if (!mp.local) {
      if (auto e = cudaIpcOpenEventHandle(&mp.event, eh); e != cudaSuccess) {
        return blocked("cudaIpcOpenEventHandle", e);
      }
    }
    if (kind_ == sharing::ipc) {
      cudaIpcMemHandle_t mh{};
      hex_to(h.memory, &mh);
      void* p = nullptr;
      if (auto e = cudaIpcOpenMemHandle(&p, mh, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess) {
        cudaEventDestroy(mp.event);
        return blocked("cudaIpcOpenMemHandle", e);
      }
      mp.base = static_cast<const std::byte*>(p);
      return mp;
    }
    auto mapped = vmm_open(h, m);
    if (!mapped) {
      if (!mp.local) cudaEventDestroy(mp.event);
      return mapped.error();
    }
    mp.base = mapped->first;
    mp.vmm = mapped->second;
    return mp;
  }

  // cuda-vmm: asks the publisher's socket for the slot's descriptor, imports and maps it.
  result<std::pair<const std::byte*, CUmemGenericAllocationHandle>> vmm_open(
      const handle& h, const weight_update_manifest& m) {
    auto fail = [&](errc code, const std::string& why) -> error {
      return {code, "cuda-vmm: " + why + " (" + update_context(m) + ")"};
    };
    auto d = driver();
    if (!d) return d.error();
    int sock = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) return fail(errc::io_error, std::string("socket: ") + std::strerror(errno));
    fd_passing::set_timeouts(sock, 5000);
    sockaddr_un a{};
    auto len = address_of(h.socket, a);
    int fd = -1;
    char reply[128] = {};
    ssize_t n = -1;
    if (::connect(sock, reinterpret_cast<sockaddr*>(&a), len) != 0) {
      int err = errno;
      ::close(sock);
      return fail(errc::unknown_update,
                  "unknown update_id: " + m.update_id + ": its publisher's socket " + h.socket +
                      " does not answer (" + std::strerror(err) + "; the publisher exited?)");
    }
    if (!fd_passing::same_user(sock)) {
      ::close(sock);
      return fail(errc::io_error, "the socket " + h.socket + " belongs to another user");
    }
    if (fd_passing::send_with_fd(sock, h.id.data(), h.id.size(), -1) ==
        static_cast<ssize_t>(h.id.size())) {
      n = fd_passing::receive_with_fd(sock, reply, sizeof reply - 1, &fd);
    }
    ::close(sock);
    if (n != 2 || std::string(reply, 2) != "ok" || fd < 0) {
      if (fd >= 0) ::close(fd);
      return fail(errc::unknown_update, "unknown update_id: " + m.update_id +
                                            ": the publisher did not give slot " + h.id + " (" +
                                            (n > 0 ? std::string(reply, n) : "no answer") + ")");
    }
    CUmemGenericAllocationHandle vmm = 0;
    auto r = (*d)->import_handle(&vmm, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    ::close(fd);  // the allocation handle keeps the memory
    if (r != CUDA_SUCCESS) {
      return fail(errc::blocked,
                  "blocked: cuMemImportFromShareableHandle failed (" + driver_text(r) + ")");
    }
    auto va = vmm_map(**d, vmm, h.capacity, device_);
    if (!va) {
      (*d)->release(vmm);
      return fail(errc::io_error, va.error().message);
    }
    return std::pair{reinterpret_cast<const std::byte*>(*va), vmm};
  }

  void close(mapping& m) {
    if (m.event && !m.local) cudaEventDestroy(m.event);  // a local event is its publisher's
    if (kind_ == sharing::ipc) {
      if (m.base && !m.local) cudaIpcCloseMemHandle(const_cast<std::byte*>(m.base));
    } else if (auto d = driver()) {
      if (m.base) vmm_unmap(**d, reinterpret_cast<CUdeviceptr>(m.base), m.capacity);
      if (m.vmm) (*d)->release(m.vmm);
    }
    m = mapping{};
  }

  void retire(std::unordered_map<std::string, mapping>::iterator it) {
    if (it->second.holds == 0) {
      close(it->second);
    } else {
      retired_.push_back(it->second);
    }
    maps_.erase(it);
  }

  // Closes the cached slots nobody holds whose pool is gone (its generation page was unlinked:
  // the publisher exited), so a restarted publisher's pool does not add to them forever.
  void forget_vanished_locked() {
    for (auto c = controls_.begin(); c != controls_.end();) {
      if (::access(("/dev/shm/" + c->second->name).c_str(), F_OK) == 0) {
        ++c;
        continue;
      }
      bool held = false;
      const std::string prefix = c->first + "/";
      for (auto it = maps_.begin(); it != maps_.end();) {
        if (it->first.rfind(prefix, 0) != 0) {
          ++it;
        } else if (it->second.holds > 0) {
          held = true;
          ++it;
        } else {
          close(it->second);
          it = maps_.erase(it);
        }
      }
      c = held ? std::next(c) : controls_.erase(c);
    }
  }

  sharing kind_;
  int device_;
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<control_map>> controls_;  // pool -> its page
  std::unordered_map<std::string, mapping> maps_;                 // "<pool>/<slot>" -> opened
  std::vector<mapping> retired_;
  std::unordered_map<update_id, std::pair<std::string, std::string>> held_;  // -> key, slot id
};

constexpr transport_caps same_node_gpu{.cpu_memory = false,
                                       .gpu_memory = true,
                                       .cross_process = true,
                                       .cross_node = false,
                                       .zero_copy_import = true};

class device_transport final : public transport {
 public:
  explicit device_transport(pool_config cfg) : cfg_(cfg) {}
  std::string_view name() const override { return kind_name(cfg_.kind); }
  transport_caps caps() const override { return same_node_gpu; }
  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    auto p = publisher::make(cfg_);
    if (!p) return p.error();
    return std::unique_ptr<publisher_transport>(std::move(*p));
  }
  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return std::unique_ptr<consumer_transport>(std::make_unique<consumer>(cfg_.kind, cfg_.device));
  }

 private:
  pool_config cfg_;
};

// Why `kind` cannot run on `device` here, or nothing.
result<void> usable(sharing kind, int device) {
  const std::string who = kind_name(kind);
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (device >= devices) {
    return make_error(errc::blocked, "blocked: " + who + ": no CUDA device " +
                                         std::to_string(device) + " (this machine has " +
                                         std::to_string(devices) + ")");
  }
  if (kind == sharing::vmm) {
    auto d = driver();
    if (!d) return make_error(errc::blocked, d.error().message + " (transport cuda-vmm)");
    int fd_ok = 0;
    (*d)->attribute(&fd_ok, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                    device);
    if (!fd_ok) {
      return make_error(errc::blocked, "blocked: cuda-vmm: device " + std::to_string(device) +
                                           " cannot export memory as POSIX file descriptors");
    }
  }
  return {};
}

}  // namespace

result<std::unique_ptr<transport>> make_device_transport(sharing kind,
                                                         const transport_options& options) {
  options_reader reader(kind_name(kind), options);
  pool_config cfg;
  cfg.kind = kind;
  auto slots = reader.get_uint("slots", 2, 1, max_slots);
  if (!slots) return slots.error();
  auto device = reader.get_uint("device", 0, 0, 1023);
  if (!device) return device.error();
  if (auto ok = reader.finish(); !ok) return ok.error();
  cfg.slots = *slots;
  cfg.device = static_cast<int>(*device);
  if (auto ok = usable(kind, cfg.device); !ok) return ok.error();
  return std::unique_ptr<transport>(std::make_unique<device_transport>(cfg));
}

}  // namespace wsync::device_pool
