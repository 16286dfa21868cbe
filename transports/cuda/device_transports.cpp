// The cuda-ipc and cuda-vmm transports (device_pool.hpp says how they work): the driver's
// virtual-memory functions, the check that this machine can run them, and the transport that
// makes the two halves (device_publisher.cpp, device_consumer.cpp). Built with CUDA only;
// gpu_transports.cpp registers them.

#include <memory>
#include <type_traits>

#include "cuda/device_common.hpp"

namespace wsync::device_pool {
namespace detail {

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
    get(a.error_name, "cuGetErrorName");
    if (!missing.empty()) {
      return make_error(errc::blocked, "blocked: the CUDA driver does not provide " + missing);
    }
    return a;
  }();
  if (!api) return api.error();
  return &*api;
}

std::string driver_text(CUresult r) {
  const std::string number = "CUresult " + std::to_string(static_cast<int>(r));
  const char* name = nullptr;
  auto d = driver();
  if (d && (*d)->error_name(r, &name) == CUDA_SUCCESS && name) {
    return std::string(name) + " (" + number + ")";
  }
  return number;
}

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

}  // namespace detail

namespace {

using namespace detail;

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
    return detail::make_publisher(cfg_);
  }
  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return detail::make_consumer(cfg_.kind, cfg_.device);
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
