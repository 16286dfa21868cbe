#pragma once
// What the cuda-ipc and cuda-vmm halves share (device_pool.hpp says how they work): small
// helpers, the driver's virtual-memory functions, the pool's generation page, the slots a
// publisher of this process made, and the factories of the two halves. Built with CUDA only.

#include <cuda.h>  // driver types only: the functions come from cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "cuda/device_pool.hpp"
#include "wsync/transports/gpu.hpp"

namespace wsync::device_pool::detail {

constexpr std::uint64_t segment_alignment = 4096;
constexpr std::uint64_t control_bytes = 4096;
constexpr char control_magic[8] = {'W', 'S', 'Y', 'N', 'C', 'G', 'P', 'U'};

inline std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

inline std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

inline const char* kind_name(sharing k) {
  return k == sharing::ipc ? "cuda-ipc" : "cuda-vmm";
}

inline std::string hex_of(const void* data, std::size_t n) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) s += digits[p[i] >> 4], s += digits[p[i] & 15];
  return s;
}

inline void hex_to(const std::string& hex, void* out) {  // the handle parser checked the digits
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
  decltype(&cuGetErrorName) error_name = nullptr;
};

/// The functions, looked up once; errc::blocked naming those the driver lacks.
result<const driver_api*> driver();

/// A driver error as its name and number: "CUDA_ERROR_OUT_OF_MEMORY (CUresult 2)".
std::string driver_text(CUresult r);

inline CUmemAllocationProp vmm_props(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

// Reserves an address range for `handle`, maps it and makes it readable and writable by
// `device`; the address, or an error naming the step.

/// Reserves an address range for `handle`, maps it and makes it readable and writable by
/// `device`; the address, or an error naming the step.
result<CUdeviceptr> vmm_map(const driver_api& d, CUmemGenericAllocationHandle handle,
                            std::uint64_t bytes, int device);
void vmm_unmap(const driver_api& d, CUdeviceptr va, std::uint64_t bytes);

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

inline std::string socket_prefix() {
  return "wsync-vmm-" + std::to_string(::getuid()) + "-";
}

struct pool_config {
  sharing kind = sharing::ipc;
  int device = 0;
  std::uint64_t slots = 2;
};

/// The publisher half (device_publisher.cpp): errc::blocked or io_error when its device, stream
/// or (cuda-vmm) socket cannot be set up.
result<std::unique_ptr<publisher_transport>> make_publisher(const pool_config& cfg);
/// The consumer half (device_consumer.cpp).
std::unique_ptr<consumer_transport> make_consumer(sharing kind, int device);

}  // namespace wsync::device_pool::detail
