// The consumer half of cuda-ipc and cuda-vmm: opens each slot once per process (memory and
// event), checks the pool's generation page on every import, closes what its pool left behind.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstring>
#include <map>
#include <vector>

#include "cuda/device_common.hpp"
#include "src/fd_passing.hpp"
#include "src/slot_ring.hpp"

namespace wsync::device_pool::detail {
namespace {

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
    gpu::on_device on(device_);
    // Reads queued on the legacy stream of a slot still held end before it is unmapped.
    if (!held_.empty()) (void)cudaStreamSynchronize(cudaStreamLegacy);
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
    gpu::on_device on(device_);
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
    // the publisher's expose() record; the copies before it completed before expose (see
    // publisher_transport::expose). The host does not wait.
    if (auto e = cudaStreamWaitEvent(cudaStreamLegacy, mp.event, 0); e != cudaSuccess) {
      return make_error(errc::io_error, who + ": cudaStreamWaitEvent failed (" + cuda_text(e) +
                                            ") (" + update_context(m) + ")");
    }
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < h->offsets.size(); ++i) {
      spans.emplace_back(mp.base + h->offsets[i], m.segments[i].nbytes);
    }
    ++mp.holds;
    held_[m.update_id] = {key, mp.id, *control, h->slot, h->generation};
    return spans;
  }

  // The slot's generation, as the shared-memory ring checks it: the publisher bumps it before
  // it rewrites the slot, so unchanged after the reads ended means none read a rewritten byte.
  result<void> intact(const update_id& id) const override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end()) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + " is not imported from " + kind_name(kind_));
    }
    const auto& h = it->second;
    std::atomic_thread_fence(std::memory_order_acquire);
    return slot_ring::unchanged(id, kind_name(kind_),
                                h.control->page->generation[h.slot].load(std::memory_order_acquire),
                                h.generation);
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    auto key = it->second.key;
    auto slot_id = it->second.slot_id;
    held_.erase(it);
    // Reads queued on the legacy stream finish before the publisher may rewrite the slot.
    gpu::on_device on(device_);
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
      // DESIGN's text for a handle CUDA cannot reopen, behind the "blocked:" the issue asks for.
      return {errc::blocked, "blocked: CUDA IPC handle reconstruction failed: " + who + ": " +
                                 what + " (" + cuda_text(e) + ") (" + update_context(m) + ")"};
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
      // "blocked:" first, as every blocked text starts.
      return {code, std::string(code == errc::blocked ? "blocked: " : "") + "cuda-vmm: " + why +
                        " (" + update_context(m) + ")"};
    };
    auto d = driver();
    if (!d) return d.error();
    int sock = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) return fail(errc::io_error, std::string("socket: ") + std::strerror(errno));
    fd_passing::set_timeouts(sock, 5000);
    sockaddr_un a{};
    auto len = fd_passing::abstract_address(h.socket, a);
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
      return fail(errc::blocked, "cuMemImportFromShareableHandle failed (" + driver_text(r) + ")");
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
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<control_map>> controls_;  // pool -> its page
  std::unordered_map<std::string, mapping> maps_;                 // "<pool>/<slot>" -> opened
  std::vector<mapping> retired_;
  struct held_import {
    std::string key;      // "<pool>/<slot>"
    std::string slot_id;  // which allocation of that slot
    std::shared_ptr<control_map> control;
    std::uint64_t slot = 0;
    std::uint64_t generation = 0;
  };
  std::unordered_map<update_id, held_import> held_;
};

}  // namespace

std::unique_ptr<consumer_transport> make_consumer(sharing kind, int device) {
  return std::make_unique<consumer>(kind, device);
}

}  // namespace wsync::device_pool::detail
