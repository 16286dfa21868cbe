#pragma once
// cuda-ipc and cuda-vmm: pooled device segments shared with consumer processes on the same node.
//
// Both keep a ring of slots, each one device allocation made once and reused (like the
// shared-memory ring), and differ only in how a slot is shared:
//   - cuda-ipc: cudaMalloc, one cudaIpcMemHandle per slot, opened once per consumer process;
//   - cuda-vmm: cuMemCreate with a POSIX file-descriptor handle, granularity-aligned; the
//     descriptor goes once per slot and consumer over a Unix socket (SCM_RIGHTS, peer checked
//     with SO_PEERCRED) and is imported with cuMemImportFromShareableHandle + cuMemMap.
// Each slot has an interprocess event the publisher records at expose() (after the caller's
// copies completed); an import makes the consumer's legacy default stream wait on it (no host
// synchronisation). A small host
// shared-memory page per pool carries each slot's generation, so a consumer never imports a
// slot that was already rewritten for a newer update.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync::device_pool {

enum class sharing { ipc, vmm };

/// What a consumer needs to find an update's slot; the transport handle is its JSON form.
struct handle {
  std::string pool;  ///< 16 hex digits, random per publisher
  std::uint64_t slot = 0;
  std::string id;       ///< 32 hex digits, random per allocation
  std::string control;  ///< the pool's generation page in /dev/shm
  std::uint64_t generation = 0;
  std::uint64_t capacity = 0;
  std::int32_t pid = 0;  ///< the publisher's
  std::int32_t device = 0;
  std::string memory;  ///< cuda-ipc: the cudaIpcMemHandle_t in hex
  std::string socket;  ///< cuda-vmm: the publisher's abstract socket name
  std::string event;   ///< the slot's cudaIpcEventHandle_t in hex
  std::vector<std::uint64_t> offsets;
};

/// Slots a pool may hold.
inline constexpr std::uint64_t max_slots = 64;

std::string handle_encode(const handle& h);
/// Parses and checks a handle against the manifest (offsets inside the slot, one per segment).
result<handle> handle_parse(const weight_update_manifest& m, sharing kind);

/// The transport (options: slots 1-64, default 2; device, default 0), or errc::blocked naming
/// why it cannot run on this machine. Built with CUDA only (device_transports.cpp).
result<std::unique_ptr<transport>> make_device_transport(sharing kind,
                                                         const transport_options& options);

}  // namespace wsync::device_pool
