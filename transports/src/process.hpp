#pragma once
// What tells a live process from a dead one, for the transports whose shared state names
// processes (shared-memory slot owners, file-mmap leases): its start time, and the PID
// namespace its pid means something in.

#include <cstdint>
#include <string>

namespace wsync::detail {

/// Start time of a process in clock ticks since boot (/proc/<pid>/stat field 22); 0 when it
/// does not exist or already exited (a zombie). Tells a live process from a pid reused by
/// another.
std::uint64_t process_start_time(int pid);

/// The inode of this process's PID namespace (/proc/self/ns/pid); 0 when unknown. Two processes
/// on one host see each other's pids only when it is the same: a pid recorded by a process in
/// another container cannot be checked here.
std::uint64_t pid_namespace();

/// This boot of this host (/proc/sys/kernel/random/boot_id); empty when unknown. Pids and
/// start times name a process only on the host that recorded them: a peer reached over a
/// network shares no pids with this one even where the PID namespaces' inodes agree (the
/// initial namespace has the same inode on every host).
const std::string& boot_id();

/// Whether a pid recorded by a process in namespace `recorded` (0: unknown, as older records
/// say) can be checked here.
inline bool pid_checkable(std::uint64_t recorded) {
  return recorded == 0 || recorded == pid_namespace();
}

}  // namespace wsync::detail
