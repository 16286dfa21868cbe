// The publisher half of file-mmap: buffers of pre-sized files, written and made durable in order
// (README.md beside this file).

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "file_mmap/file_mmap_common.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::file_mmap_detail {
namespace {

// --- publisher ----------------------------------------------------------------------------

struct seg_file {
  int fd = -1;                // open only while buffer_size works on the file
  std::byte* base = nullptr;  // where the caller writes: the file's mapping, or staging
  std::uint64_t size = 0;
  bool mapped = false;             // base is a mapping of the file
  bool ready = false;              // base is valid for size bytes
  std::vector<std::byte> staging;  // write=pwrite: the bytes expose() writes into the file
};

struct buffer {
  std::vector<seg_file> files;
  update_id holder;  // acquired here and not yet released; empty when free
  std::size_t used = 0;
};

void seg_close(seg_file& f) {
  if (f.mapped && f.size > 0) ::munmap(f.base, f.size);
  if (f.fd >= 0) ::close(f.fd);
  f = seg_file{};
}

class fm_publisher final : public publisher_transport {
 public:
  fm_publisher(fm_config cfg, int lock_fd, std::int64_t current, bool use_pwrite)
      : cfg_(std::move(cfg)),
        pwrite_(use_pwrite),
        host_(host_name()),
        lock_fd_(lock_fd),
        current_(current),
        buffers_(cfg_.buffers) {}

  ~fm_publisher() override {
    for (auto& b : buffers_) {
      for (auto& f : b.files) seg_close(f);
    }
    ::close(lock_fd_);  // drops the flock: another publisher may take the directory
  }

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds wait) override {
    std::unique_lock lock(mutex_);
    for (const auto& b : buffers_) {
      if (b.holder == id) {
        return make_error(errc::invalid_argument,
                          "file-mmap: update_id " + id + " acquired twice (field update_id)");
      }
    }
    auto deadline = std::chrono::steady_clock::now() + wait;
    std::int64_t chosen = -1;
    std::string who;
    for (;;) {
      who.clear();
      for (std::uint64_t k = 0; k < buffers_.size() && chosen < 0; ++k) {
        auto b = static_cast<std::uint64_t>(current_ + 1 + static_cast<std::int64_t>(k)) %
                 buffers_.size();
        auto note = [&](const std::string& text) {
          who += (who.empty() ? "" : "; ") + text + " on buffer-" + std::to_string(b);
        };
        if (static_cast<std::int64_t>(b) == current_)
          continue;  // never overwritten: it is
                     // what a crash falls back to
        if (!buffers_[b].holder.empty()) {
          note("update_id " + buffers_[b].holder + " (not yet released by every consumer)");
          continue;
        }
        // Invalidate the buffer before looking at its leases: a reader writes its lease before
        // it checks STAMP, so either we see its lease or it sees STAMP gone.
        std::string stamp = buffer_dir(cfg_.dir, b) + "/STAMP";
        if (::unlink(stamp.c_str()) != 0 && errno != ENOENT) {
          return make_error(errc::io_error, "file-mmap: unlink " + stamp + ": " +
                                                errno_text(errno) + " (update_id=" + id + ")");
        }
        auto live = leases_live(cfg_.dir, b, host_, cfg_.lease_timeout);
        if (!live.empty()) {
          std::string all;
          for (const auto& l : live) all += (all.empty() ? "" : ", ") + l;
          note(all);
          continue;
        }
        chosen = static_cast<std::int64_t>(b);
      }
      if (chosen >= 0) break;
      auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        return make_error(
            errc::timeout,
            "file-mmap: no free buffer: held by " + who +
                (current_ >= 0
                     ? "; buffer-" + std::to_string(current_) + " holds the CURRENT version"
                     : std::string()) +
                " (update_id=" + id + ", field buffers: waited " + std::to_string(wait.count()) +
                " ms; dir=" + cfg_.dir + " buffers=" + std::to_string(cfg_.buffers) +
                " lease_timeout_ms=" + std::to_string(cfg_.lease_timeout.count()) + ")");
      }
      // Leases expire with time, not only on release(): look again every lease_poll.
      cv_.wait_until(lock, std::min(deadline, now + lease_poll));
    }
    auto& buf = buffers_[static_cast<std::size_t>(chosen)];
    // A reader whose lease expired while it may still run on this host (frozen past
    // lease_timeout_ms) may still serve views of these files: they are left to it, and this
    // update goes to new files renamed over them (its mapping keeps the old ones). The buffer's
    // FRESH mark names such readers, for this publisher or one that restarted since.
    const auto mark = fresh_files_path(cfg_.dir, static_cast<std::uint64_t>(chosen));
    const auto readers = file_read(mark);
    if (readers) {
      std::string all;
      std::istringstream lines(*readers);
      for (std::string r; std::getline(lines, r);) all += (all.empty() ? "" : ", ") + r;
      log_warn("file-mmap: buffer-" + std::to_string(chosen) + " may still be mapped by " +
               (all.empty() ? std::string("a reader whose lease expired") : all) +
               ", whose lease expired while it may run on this host: its files are left to it, "
               "the update goes to new files (update_id=" +
               id + ")");
    }
    if (auto ok = buffer_size(static_cast<std::uint64_t>(chosen), buf, sizes, readers.has_value());
        !ok) {
      return make_error(ok.error().code, ok.error().message + " (update_id=" + id + ")");
    }
    ::unlink(mark.c_str());
    buf.holder = id;
    buf.used = sizes.size();
    std::vector<std::span<std::byte>> spans;
    for (std::size_t i = 0; i < sizes.size(); ++i) spans.emplace_back(buf.files[i].base, sizes[i]);
    return spans;
  }

  result<std::string> expose(const update_id& id) override {
    std::lock_guard lock(mutex_);
    auto b = find(id);
    if (b < 0) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + " was not acquired from file-mmap");
    }
    auto& buf = buffers_[static_cast<std::size_t>(b)];
    // Data first: STAMP and CURRENT must never name bytes that a crash could lose. Each file is
    // opened for this only: a descriptor per segment and buffer held for good would pass the
    // common limit of 1,024 with a large model in many segments.
    for (std::size_t i = 0; i < buf.used; ++i) {
      auto& f = buf.files[i];
      if (f.size == 0) continue;
      const std::string path = segment_path(cfg_.dir, b, i);
      auto fail = [&](const std::string& what) -> error {
        return make_error(errc::io_error,
                          "file-mmap: " + what + " " + path + " (update_id=" + id + ")");
      };
      int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
      if (fd < 0) return fail("open: " + errno_text(errno) + ":");
      if (int err = pwrite_ ? write_fully(fd, f.staging.data(), f.size, 0) : 0; err != 0) {
        ::close(fd);
        return fail("pwrite: " + errno_text(err) + ":");
      }
      if (::fdatasync(fd) != 0) {
        const std::string why = errno_text(errno);
        ::close(fd);
        return fail("fdatasync: " + why + ":");
      }
      ::close(fd);
    }
    nlohmann::json stamp = {{"update_id", id}};
    if (auto ok = file_replace_durably(buffer_dir(cfg_.dir, b) + "/STAMP", stamp.dump()); !ok) {
      return make_error(ok.error().code,
                        "file-mmap: " + ok.error().message + " (update_id=" + id + ")");
    }
    nlohmann::json h = {{"dir", cfg_.dir},
                        {"buffer", b},
                        {"segments", buf.used},
                        {"lease_timeout_ms", cfg_.lease_timeout.count()}};
    return h.dump();
  }

  result<void> announce(const weight_update_manifest& m) override {
    std::lock_guard lock(mutex_);
    auto b = find(m.update_id);
    if (b < 0) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id + " was not acquired from file-mmap");
    }
    nlohmann::json state = {{"format", state_format},
                            {"buffer", b},
                            {"update_id", m.update_id},
                            {"weight_version", m.weight_version},
                            {"manifest", nlohmann::json::parse(manifest_to_json(m))}};
    std::function<void()> hook;
    if (cfg_.crash_before_rename) {
      hook = [&] {
        log_error("file-mmap: WSYNC_FILE_MMAP_CRASH=before-rename: exiting after the data and " +
                  cfg_.dir +
                  "/CURRENT.tmp are durable, before the rename (update_id=" + m.update_id + ")");
        ::_exit(86);
      };
    }
    bool renamed = false;
    auto ok = file_replace_durably(cfg_.dir + "/CURRENT", state.dump(), hook, &renamed);
    // Once renamed, CURRENT names buffer b whatever failed after: it must not be written next.
    if (renamed) current_ = b;
    if (!ok) {
      return make_error(ok.error().code, "file-mmap: " + ok.error().message + " (" +
                                             update_context(m) + ", field CURRENT)");
    }
    return {};
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    if (auto b = find(id); b >= 0) {
      buffers_[static_cast<std::size_t>(b)].holder.clear();
      cv_.notify_all();
    }
  }

 private:
  std::int64_t find(const update_id& id) const {
    for (std::size_t b = 0; b < buffers_.size(); ++b) {
      if (buffers_[b].holder == id) return static_cast<std::int64_t>(b);
    }
    return -1;
  }

  // Opens (or creates) one file per segment and sizes it; a file that already has the right
  // size (or grows) keeps its inode, its blocks and its mapping, so a steady model writes in
  // place. `fresh`: every file is new instead, renamed over the old (a reader may map it).
  result<void> buffer_size(std::uint64_t b, buffer& buf, std::span<const std::uint64_t> sizes,
                           bool fresh) {
    if (auto ok = dir_ensure(buffer_dir(cfg_.dir, b), true, true); !ok) return ok;
    if (buf.files.size() < sizes.size()) buf.files.resize(sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto& f = buf.files[i];
      std::string path = segment_path(cfg_.dir, b, i);
      auto fail = [&](const char* what) -> result<void> {
        int err = errno;
        seg_close(f);
        return make_error(errc::io_error, std::string("file-mmap: ") + what + " " + path + " (" +
                                              std::to_string(sizes[i]) +
                                              " bytes): " + errno_text(err));
      };
      // A file this process did not size itself may have no blocks behind its size (a
      // publisher killed, or a reservation that failed, after its ftruncate): reserved again.
      bool unreserved = false;
      if (f.fd < 0) {
        f.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (f.fd < 0) return fail("open");
        struct stat st {};
        if (::fstat(f.fd, &st) != 0) return fail("fstat");
        // Opened afresh for each update: a file that is not the size last left (a first open,
        // or someone else's hand) loses the mapping made for that size.
        if (static_cast<std::uint64_t>(st.st_size) != f.size) {
          if (f.mapped && f.size > 0) ::munmap(f.base, f.size);
          f.mapped = f.ready = false;
          f.base = nullptr;
          f.size = static_cast<std::uint64_t>(st.st_size);
          unreserved = true;
        }
      }
      const bool replace = sizes[i] < f.size || (fresh && f.size > 0);
      if (f.size != sizes[i] || replace) {
        if (f.mapped && f.size > 0) ::munmap(f.base, f.size);
        f.mapped = f.ready = false;
        f.base = nullptr;
        // A reader may still map this file (its lease expired under it, or NFS hid a fresh
        // one): shrunk in place, its reads past the new end would be a SIGBUS, not an error.
        // A smaller segment goes to a new file renamed over the old; old mappings keep theirs.
        // So does every segment of a buffer a reader still maps (`fresh`).
        if (replace) {
          const std::string next = path + ".new";
          ::unlink(next.c_str());  // a crash's leftover
          int fd = ::open(next.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
          if (fd < 0) return fail("open");
          if (::rename(next.c_str(), path.c_str()) != 0) {
            int err = errno;
            ::close(fd);
            ::unlink(next.c_str());
            errno = err;
            return fail("rename");
          }
          ::close(f.fd);
          f.fd = fd;
        }
        if (::ftruncate(f.fd, static_cast<off_t>(sizes[i])) != 0) return fail("ftruncate");
        f.size = sizes[i];
        unreserved = true;
      }
      // Reserve the blocks now: a full disk is an error here, not a SIGBUS while copying.
      if (unreserved && sizes[i] > 0) {
        if (int rc = ::posix_fallocate(f.fd, 0, static_cast<off_t>(sizes[i]));
            rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
          errno = rc;
          return fail("fallocate");  // closes it: the next try finds it unreserved again
        }
      }
      if (!f.ready && pwrite_) {
        f.staging.resize(f.size);
        f.base = f.staging.data();
      } else if (!f.ready && f.size > 0) {
        void* p = ::mmap(nullptr, f.size, PROT_READ | PROT_WRITE, MAP_SHARED, f.fd, 0);
        if (p == MAP_FAILED) return fail("mmap");
        f.base = static_cast<std::byte*>(p);
        f.mapped = true;
      }
      f.ready = true;
      ::close(f.fd);  // the mapping (or staging) is what is written; expose opens it again
      f.fd = -1;
    }
    if (fresh) {
      // Files past this update's last segment: the reader may map those too. Unlinked (its
      // mapping keeps them), so that a later update needing them makes new ones rather than
      // writing into them in place once the mark is gone.
      for (std::size_t i = sizes.size();; ++i) {
        if (i < buf.files.size()) seg_close(buf.files[i]);
        if (::unlink(segment_path(cfg_.dir, b, i).c_str()) != 0 && i >= buf.files.size()) break;
      }
    }
    return {};
  }

  fm_config cfg_;
  // Copy into staging memory and pwrite() it at expose(), instead of writing through the
  // file's mapping: on a disk filesystem every page written through a mapping faults again
  // after each writeback (page_mkwrite); on tmpfs the mapping is the memory itself and pwrite
  // would only add a copy. See README.md for the figures.
  bool pwrite_;
  std::string host_;
  int lock_fd_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::int64_t current_;  // buffer CURRENT names; -1 before the first version
  std::vector<buffer> buffers_;
};

}  // namespace

std::unique_ptr<publisher_transport> make_fm_publisher(fm_config cfg, int lock_fd,
                                                       std::int64_t current, bool use_pwrite) {
  return std::make_unique<fm_publisher>(std::move(cfg), lock_fd, current, use_pwrite);
}

}  // namespace wsync::file_mmap_detail
