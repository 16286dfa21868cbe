// The consumer half of file-mmap: read-only mappings of a buffer's files, held by a lease whose
// heartbeat a background thread keeps fresh (README.md beside this file).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>
#include <utility>

#include "file_mmap/file_mmap_common.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::file_mmap_detail {
namespace {

class fm_consumer final : public consumer_transport {
 public:
  explicit fm_consumer(fm_config cfg)
      : cfg_(std::move(cfg)), host_(host_name()), start_(process_start_time(::getpid())) {}

  ~fm_consumer() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
      cv_.notify_all();
    }
    if (heartbeat_.joinable()) heartbeat_.join();
    for (auto& [id, h] : held_) drop(h);
  }

  void rank_set(std::int32_t rank) override { rank_ = rank; }

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
    auto h = handle_parse(m, rank_);
    if (!h) return h.error();
    // The writer judges leases by its own timeout: the heartbeat keeps to the shorter one.
    if (h->lease_timeout_ms > 0) {
      auto ms = static_cast<std::int64_t>(h->lease_timeout_ms);
      auto now = lease_timeout_ms_.load();
      while (ms < now && !lease_timeout_ms_.compare_exchange_weak(now, ms)) {
      }
    }
    // Our own dir, not the handle's: on a shared filesystem each host may mount it elsewhere.
    held entry;
    entry.lease = cfg_.dir + "/leases/" + lease_prefix(h->buffer) + std::to_string(::getpid()) +
                  "." + random_hex(6) + ".lease";
    {
      std::lock_guard lock(mutex_);
      if (held_.count(m.update_id)) {
        return make_error(errc::invalid_argument, "file-mmap: update_id " + m.update_id +
                                                      " imported twice (" + ctx(m) + ")");
      }
      // Listed before its lease exists, so that the heartbeat keeps it fresh from the start:
      // the lock is not held while the files are mapped (MAP_POPULATE of a large update on a
      // network filesystem takes seconds), and the other leases stay fresh meanwhile too.
      held_.emplace(m.update_id, held{entry.lease, {}, false});
      if (!heartbeat_.joinable()) heartbeat_ = std::thread([this] { heartbeat_run(); });
    }
    auto spans = map_buffer(m, *h, entry);
    std::lock_guard lock(mutex_);
    if (!spans) {
      drop(entry);
      held_.erase(m.update_id);
      return spans.error();
    }
    entry.ready = true;
    held_[m.update_id] = std::move(entry);
    return spans;
  }

  // A lease the writer removed means it judged this reader dead and may have rewritten the
  // buffer since (the heartbeat stalled past lease_timeout_ms: a frozen process, a hung network
  // filesystem). While the lease is there the writer leaves the buffer alone.
  result<void> intact(const update_id& id) const override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end() || !it->second.ready) {
      return make_error(errc::unknown_update, "unknown update_id: " + id +
                                                  " is not imported from file-mmap (" +
                                                  update_context(id, rank_) + ")");
    }
    // What the heartbeat found stands: on NFS a stat here may be answered from the attribute
    // cache after the writer removed the lease.
    struct stat st {};
    if (!it->second.lost && ::stat(it->second.lease.c_str(), &st) == 0) return {};
    if (it->second.lost || errno == ENOENT) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + ": the writer removed this reader's lease " +
                            it->second.lease + " (its heartbeat stalled beyond lease_timeout_ms=" +
                            std::to_string(lease_timeout_ms_.load()) +
                            "), so the buffer may hold newer bytes (" + update_context(id, rank_) +
                            ")");
    }
    // Cannot tell whether the lease is still there: the bytes cannot be vouched for.
    return make_error(errc::io_error, "file-mmap: cannot check this reader's lease " +
                                          it->second.lease + ": " + errno_text(errno) + " (" +
                                          update_context(id, rank_) + ")");
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end() || !it->second.ready) return;
    drop(it->second);
    held_.erase(it);
  }

 private:
  struct held {
    std::string lease;
    std::vector<std::pair<void*, std::size_t>> maps;
    bool ready = false;  ///< false while import_segments maps it
    bool lost = false;   ///< the heartbeat found the lease gone: the writer judged it dead
  };

  std::string ctx(const weight_update_manifest& m) const {
    return update_context(m.update_id, rank_);
  }

  // Writes the lease, checks STAMP, and maps the buffer's files into `entry` (without the lock).
  result<std::vector<std::span<const std::byte>>> map_buffer(const weight_update_manifest& m,
                                                             const handle& h, held& entry) {
    std::string bdir = buffer_dir(cfg_.dir, h.buffer);
    if (auto ok = dir_ensure(cfg_.dir + "/leases", true, false); !ok) {
      return make_error(ok.error().code, ok.error().message + " (" + ctx(m) + ")");
    }
    nlohmann::json who = {{"host", host_},
                          {"pid", ::getpid()},
                          {"pidns", pid_namespace()},
                          {"start", start_},
                          {"rank", rank_},
                          {"buffer", h.buffer},
                          {"update_id", m.update_id},
                          {"weight_version", m.weight_version}};
    // Written whole, then renamed: the writer never reads half a lease.
    std::string tmp = cfg_.dir + "/leases/." + random_hex(6) + ".tmp";
    {
      const std::string text = who.dump();
      int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      int err = fd < 0 ? errno : write_fully(fd, text.data(), text.size());
      if (fd >= 0 && ::close(fd) != 0 && err == 0) err = errno;
      if (err != 0) {
        ::unlink(tmp.c_str());
        return make_error(errc::io_error, "file-mmap: cannot write lease " + tmp + ": " +
                                              errno_text(err) + " (" + ctx(m) + ", field dir)");
      }
    }
    if (::rename(tmp.c_str(), entry.lease.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      entry.lease.clear();  // not ours to remove
      return make_error(errc::io_error,
                        "file-mmap: rename " + tmp + ": " + errno_text(err) + " (" + ctx(m) + ")");
    }
    // With the lease visible, STAMP tells whether the buffer still holds this update (the
    // writer removes STAMP before it looks at leases, see fm_publisher::acquire).
    auto stamp = file_read(bdir + "/STAMP");
    if (stamp_update_id(stamp.value_or("")) != m.update_id) {
      struct stat st {};
      if (::stat(bdir.c_str(), &st) != 0) {
        return make_error(errc::unknown_update,
                          "unknown update_id: " + m.update_id + ": no " + bdir +
                              " (field transport_handle: this consumer's dir=" + cfg_.dir +
                              ", the publisher writes dir=" + h.dir + ") (" + ctx(m) + ")");
      }
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id + " is no longer in " + bdir +
                            ": the publisher is reusing it for a newer update (field "
                            "transport_handle) (" +
                            ctx(m) + ")");
    }
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < h.segments; ++i) {
      std::uint64_t n = m.segments[i].nbytes;
      if (n == 0) {
        spans.emplace_back();
        continue;
      }
      std::string path = segment_path(cfg_.dir, h.buffer, i);
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
      if (fd < 0) {
        return make_error(errc::invalid_manifest,
                          "invalid manifest: segments[" + std::to_string(i) + "].nbytes: " + path +
                              " cannot be opened: " + errno_text(errno) + " (" + ctx(m) + ")");
      }
      struct stat st {};
      if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        return make_error(errc::io_error, "file-mmap: fstat " + path + ": " + errno_text(err) +
                                              " (" + ctx(m) + ")");
      }
      if (static_cast<std::uint64_t>(st.st_size) < n) {
        ::close(fd);
        return make_error(errc::invalid_manifest,
                          "invalid manifest: segments[" + std::to_string(i) + "].nbytes: " + path +
                              " holds fewer than " + std::to_string(n) + " bytes (" + ctx(m) + ")");
      }
      // Read-only and shared: the page cache's pages, no copy (on NFS, the client's cache).
      void* p = ::mmap(nullptr, n, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
      int err = errno;
      ::close(fd);
      if (p == MAP_FAILED) {
        return make_error(errc::io_error,
                          "file-mmap: mmap " + path + ": " + errno_text(err) + " (" + ctx(m) + ")");
      }
      entry.maps.emplace_back(p, n);
      spans.emplace_back(static_cast<const std::byte*>(p), n);
    }
    return spans;
  }

  // Unmaps first, then gives the lease back: the writer may resize the files once it is gone.
  static void drop(held& h) {
    for (auto [p, n] : h.maps) ::munmap(p, n);
    h.maps.clear();
    if (!h.lease.empty()) ::unlink(h.lease.c_str());
  }

  // Refreshes the mtime of every lease this consumer holds, so the writer sees it alive. The
  // touching happens outside the lock: an import mapping a large buffer must not stop it.
  void heartbeat_run() {
    std::unique_lock lock(mutex_);
    while (!stop_) {
      // Read each round: an import from a writer with a shorter timeout shortens it.
      auto period = std::max(std::chrono::milliseconds(lease_timeout_ms_.load() / 4),
                             std::chrono::milliseconds(5));
      cv_.wait_for(lock, period, [&] { return stop_; });
      if (stop_) break;
      std::vector<std::pair<update_id, std::string>> leases, gone;
      for (const auto& [id, h] : held_) leases.emplace_back(id, h.lease);
      lock.unlock();
      for (const auto& [id, lease] : leases) {
        if (::utimensat(AT_FDCWD, lease.c_str(), nullptr, 0) != 0 && errno == ENOENT) {
          gone.emplace_back(id, lease);
        }
      }
      lock.lock();
      for (const auto& [id, lease] : gone) {
        // Not an import whose lease is not written yet, nor one released meanwhile.
        auto it = held_.find(id);
        if (it == held_.end() || !it->second.ready || it->second.lease != lease) continue;
        if (it->second.lost) continue;  // said once
        it->second.lost = true;
        log_warn("file-mmap: the lease on update_id " + id +
                 " was removed by the writer (this reader's heartbeat stalled beyond "
                 "lease_timeout_ms=" +
                 std::to_string(lease_timeout_ms_.load()) +
                 "); its bytes are no longer trusted; rank " + std::to_string(rank_));
      }
    }
  }

  fm_config cfg_;
  std::atomic<std::int64_t> lease_timeout_ms_{cfg_.lease_timeout.count()};
  std::string host_;
  std::uint64_t start_;
  std::int32_t rank_ = -1;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::unordered_map<update_id, held> held_;
  std::thread heartbeat_;
};

}  // namespace

std::unique_ptr<consumer_transport> make_fm_consumer(fm_config cfg) {
  return std::make_unique<fm_consumer>(std::move(cfg));
}

}  // namespace wsync::file_mmap_detail
