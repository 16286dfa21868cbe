#include "shared_memory/slot.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <optional>
#include <sstream>

#include "shared_memory/shared_memory.hpp"
#include "src/process.hpp"

namespace wsync {
namespace shared_memory_detail {
using detail::pid_namespace;

std::string errno_text(int err) {
  return std::string(std::strerror(err));
}

void* map_aligned(int fd, std::uint64_t bytes, int prot, int flags) {
  std::uint64_t span = align_up(bytes, page) + huge_page;
  void* reserved =
      ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (reserved == MAP_FAILED) return MAP_FAILED;
  auto lo = reinterpret_cast<std::uintptr_t>(reserved);
  auto at = align_up(lo, huge_page);
  void* p = ::mmap(reinterpret_cast<void*>(at), bytes, prot, flags | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    ::munmap(reserved, span);
    errno = err;
    return MAP_FAILED;
  }
  // Give back what the alignment did not use, on both sides.
  if (at > lo) ::munmap(reserved, at - lo);
  std::uintptr_t end = at + align_up(bytes, page);
  if (end < lo + span) ::munmap(reinterpret_cast<void*>(end), lo + span - end);
  return p;
}

namespace {

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; glibc 2.36's <sys/mman.h> does not name it yet
#endif

// Why slots are made of 2 MiB pages and read once at creation (measured on these VMs, whose
// hypervisor shadows the guest's page tables; see docs/benchmark.md): MAP_POPULATE and
// MADV_POPULATE_* fill a process's page-table entries but not the hypervisor's shadow of them, so
// the first access through each new 4 KiB entry still costs ~2 us, in every process that maps
// the slot: a consumer's first verify of a 1 GB slot ran at ~5 GB/s instead of ~40. For a 2 MiB
// entry the shadow is kept per page and access kind, whichever process built it: once one
// process read the slot through a read-only mapping, a consumer's first read costs no more than
// its later ones.

// Turns the slot's memory into 2 MiB pages where the kernel can (MADV_COLLAPSE works on shmem
// whatever /sys/kernel/mm/transparent_hugepage/shmem_enabled says). True when every whole 2 MiB
// of it is one now; false leaves 4 KiB pages (kernel before 6.1, no huge page free), which work
// as before.
bool slot_collapse(int fd, void* base, std::uint64_t bytes) {
  std::uint64_t whole = bytes / huge_page * huge_page;
  if (whole == 0) return false;
  // MADV_COLLAPSE refuses a range holding no page at all: give each 2 MiB one. pwrite, not a
  // store through the mapping: a full /dev/shm is then an error here rather than a SIGBUS. The
  // first has the header's page already (and a byte written there would be the header's).
  for (std::uint64_t off = huge_page; off < whole; off += huge_page) {
    const char zero = 0;
    if (::pwrite(fd, &zero, 1, static_cast<off_t>(off)) != 1) return false;
  }
  // EAGAIN: a page was briefly locked or off the LRU; ranges already collapsed are skipped.
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (::madvise(base, whole, MADV_COLLAPSE) == 0) return true;
    if (errno != EAGAIN) return false;
  }
  return false;
}

// Why allocating a slot's pages failed, in words a user can act on: a full /dev/shm (a
// container's default is 64 MiB) makes the fault that allocates a page fail, which
// MADV_POPULATE_WRITE reports as EFAULT and posix_fallocate as ENOSPC.
std::string allocation_failure_text(int err, std::uint64_t bytes) {
  if (err != EFAULT && err != ENOSPC && err != ENOMEM) return errno_text(err);
  constexpr std::uint64_t mib = 1 << 20;
  std::string text = errno_text(err) + ": no room for " + std::to_string((bytes + mib - 1) / mib) +
                     " MiB in /dev/shm";
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) == 0) {
    text += " (" + std::to_string(std::uint64_t{fs.f_bavail} * fs.f_frsize / mib) +
            " MiB free of " + std::to_string(std::uint64_t{fs.f_blocks} * fs.f_frsize / mib) +
            " MiB)";
  }
  return text + "; give /dev/shm more room (a container's --shm-size) or publish less";
}

// Reads one byte of every 4 KiB page through a read-only mapping like a consumer's, so that the
// shadow entries consumers will use exist before the first of them maps the slot (see above).
void slot_warm_read_only(int fd, std::uint64_t bytes) {
  void* p = map_aligned(fd, bytes, PROT_READ, MAP_SHARED | MAP_POPULATE);
  if (p == MAP_FAILED) return;
  const auto* b = static_cast<const volatile std::byte*>(p);
  for (std::uint64_t off = 0; off < bytes; off += page) (void)b[off];
  ::munmap(p, bytes);
}

}  // namespace

void slot_destroy(slot& s) {
  if (s.base) ::munmap(s.base, s.map_bytes);
  if (s.fd >= 0) ::close(s.fd);
  s.fd = -1;
  if (!s.name.empty()) ::shm_unlink(("/" + s.name).c_str());
  s.base = nullptr;
  s.name.clear();
  s.capacity = 0;
}

result<void> slot_create(slot& s, std::uint64_t capacity, std::uint64_t owner_start) {
  auto secret = random_hex(16);
  if (secret.empty()) {
    return make_error(errc::io_error, "shared-memory: getrandom failed: " + errno_text(errno));
  }
  s.name = name_prefix + std::to_string(::getpid()) + "-" + secret;
  s.capacity = capacity;
  s.map_bytes = header_bytes + capacity;
  int fd = ::shm_open(("/" + s.name).c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    int err = errno;
    s.name.clear();
    s.capacity = s.map_bytes = 0;  // no slot: not one a later acquire may pick
    return make_error(errc::io_error, "shared-memory: shm_open failed: " + errno_text(err));
  }
  // `allocating`: the call gave the slot its pages, and failed for want of room.
  auto fail = [&](const char* what, bool allocating = false) -> result<void> {
    int err = errno;
    ::close(fd);
    slot_destroy(s);
    return make_error(
        errc::io_error,
        std::string("shared-memory: ") + what + " failed for a slot of " +
            std::to_string(capacity) + " bytes: " +
            (allocating ? allocation_failure_text(err, s.map_bytes) : errno_text(err)));
  };
  if (::fchmod(fd, 0600) != 0) return fail("fchmod");
  if (::ftruncate(fd, static_cast<off_t>(s.map_bytes)) != 0) return fail("ftruncate");
  void* p = map_aligned(fd, s.map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED);
  if (p == MAP_FAILED) return fail("mmap");
  s.base = static_cast<std::byte*>(p);
  // The owner is on record before the long part: making huge pages and populating a large slot
  // take seconds to minutes, and a sweep by a process in another PID namespace keeps a slot
  // whose header names a namespace it cannot check, but removes an old one with no header. The
  // header's page is allocated first (a full /dev/shm is an error here, not a SIGBUS at the
  // store), and the magic goes in last, so a sweep never reads a header without its owner.
  if (int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(header_bytes)); rc != 0) {
    errno = rc;
    return fail("fallocate", true);
  }
  auto* h = new (s.base) slot_header{};
  h->layout = 1;
  h->owner_pid = ::getpid();
  h->owner_start = owner_start;
  h->owner_pidns = pid_namespace();
  h->capacity = capacity;
  h->generation.store(0, std::memory_order_relaxed);
#if !defined(__SANITIZE_THREAD__)  // TSan refuses fences; the sweeper is another process anyway
  std::atomic_thread_fence(std::memory_order_release);
#endif
  std::memcpy(h->magic, magic, sizeof magic);
  const bool huge = slot_collapse(fd, p, s.map_bytes);  // keeps what the pages hold
  // Allocate every page now (after a collapse, only what it left small); tmpfs reports a full
  // /dev/shm here rather than with SIGBUS later. Both ways keep what the pages hold.
  if (::madvise(p, s.map_bytes, MADV_POPULATE_WRITE) != 0) {
    if (errno != EINVAL) return fail("madvise(MADV_POPULATE_WRITE)", true);
    if (int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(s.map_bytes)); rc != 0) {
      errno = rc;  // posix_fallocate returns its error instead of setting errno
      return fail("fallocate", true);
    }
    auto* bytes = static_cast<volatile std::byte*>(p);
    for (std::uint64_t off = 0; off < s.map_bytes; off += page) bytes[off] = bytes[off];
  }
  // With 4 KiB pages each consumer builds its own shadow entries: warming would not help them.
  if (huge) slot_warm_read_only(fd, s.map_bytes);
  s.fd = fd;
  return {};
}

bool slot_claim(const slot& s) {
  return ::flock(s.fd, LOCK_EX | LOCK_NB) == 0;
}

void slot_unclaim(const slot& s) {
  ::flock(s.fd, LOCK_UN);
}

std::string slot_readers(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "an unknown process";
  // /proc/locks names a file "MAJOR:MINOR:INODE", the device numbers in hex.
  char file[64];
  std::snprintf(file, sizeof file, "%02x:%02x:%llu", ::major(st.st_dev), ::minor(st.st_dev),
                static_cast<unsigned long long>(st.st_ino));
  std::ifstream in("/proc/locks");
  std::string line, found;
  while (std::getline(in, line)) {
    // "3: FLOCK  ADVISORY  READ  812 00:1a:5137 0 EOF"; a waiter's line has "->" after the
    // number and holds nothing.
    std::istringstream fields(line);
    std::string number, kind, advisory, mode, pid, where;
    fields >> number >> kind >> advisory >> mode >> pid >> where;
    if (kind != "FLOCK" || mode != "READ" || where != file) continue;
    found += (found.empty() ? "pid " : ", pid ") + pid;
  }
  return found.empty() ? "an unknown process" : found;
}

}  // namespace shared_memory_detail

using detail::pid_checkable;
using detail::process_start_time;
using shared_memory_detail::header_bytes;
using shared_memory_detail::magic;
using shared_memory_detail::name_prefix;
using shared_memory_detail::slot_header;

std::vector<std::string> shm_segments_of(const std::vector<int>& pids) {
  std::vector<std::string> found;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      for (int pid : pids) {
        if (std::string(e->d_name).rfind(name_prefix + std::to_string(pid) + "-", 0) == 0) {
          found.emplace_back(e->d_name);
        }
      }
    }
    ::closedir(d);
  }
  return found;
}

std::vector<std::string> shm_sweep_orphans() {
  std::vector<std::string> removed;
  DIR* d = ::opendir("/dev/shm");
  if (!d) return removed;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind(name_prefix, 0) != 0) continue;
    int pid = std::atoi(name.c_str() + sizeof name_prefix - 1);
    if (pid <= 0 || pid == ::getpid()) continue;
    const std::uint64_t alive_start = process_start_time(pid);
    // What the header says of its owner; nullopt when it cannot be read (being created: a live
    // owner may be between shm_open and ftruncate, and reading an empty object's header would
    // raise SIGBUS) or is not a wsync slot.
    struct owner {
      std::uint64_t start, pidns;
    };
    std::optional<owner> made_by;
    bool foreign = false;  // a header, not a slot's: another kind of wsync object
    bool young = false;    // changed within the last minute
    // Not blocking: a FIFO someone made under the prefix would hold the open forever.
    if (int fd = ::shm_open(("/" + name).c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK, 0); fd >= 0) {
      struct stat st {};
      void* p = MAP_FAILED;
      // Only this user's plain files: another user's (root sweeps them too) is not ours to
      // judge, and one that user shrinks while it is mapped here would be a SIGBUS.
      if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
        ::close(fd);
        continue;
      }
      young = std::time(nullptr) - st.st_mtim.tv_sec < 60;
      if (static_cast<std::uint64_t>(st.st_size) >= header_bytes) {
        p = ::mmap(nullptr, header_bytes, PROT_READ, MAP_SHARED, fd, 0);
      }
      ::close(fd);
      if (p != MAP_FAILED) {
        const auto* h = static_cast<const slot_header*>(p);
        constexpr char none[sizeof magic] = {};
        if (std::memcmp(h->magic, magic, sizeof magic) == 0) {
          made_by = owner{h->owner_start, h->owner_pidns};
        } else if (std::memcmp(h->magic, none, sizeof none) != 0) {
          foreign = true;
        }
        ::munmap(p, header_bytes);
      }
    }
    // Another kind of object under the prefix (cuda-ipc/cuda-vmm's generation page, "WSYNCGPU"):
    // its header does not say which PID namespace made it, and one made in a container sharing
    // /dev/shm has a pid that names no process here though it lives. Not ours to judge: such a
    // page left by a crash stays (4 KiB) rather than a live one being removed.
    if (foreign) continue;
    // Made in another PID namespace (a container sharing /dev/shm): its pid means nothing here.
    if (made_by && !pid_checkable(made_by->pidns)) continue;
    // No header yet and just made: a slot being created (its header comes once it is sized and
    // its huge pages are made, before its pages are populated), maybe by a process whose pid
    // means nothing here.
    if (!made_by && young) continue;
    // The pid is in use: keep the slot unless its header proves another process made it.
    if (alive_start != 0 && (!made_by || made_by->start == 0 || made_by->start == alive_start)) {
      continue;
    }
    if (::shm_unlink(("/" + name).c_str()) == 0) removed.push_back(name);
  }
  ::closedir(d);
  return removed;
}

}  // namespace wsync
