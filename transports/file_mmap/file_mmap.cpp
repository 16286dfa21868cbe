#include "file_mmap/file_mmap.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {
namespace {

constexpr char state_format[] = "wsync-file-mmap/1";
constexpr auto lease_poll = std::chrono::milliseconds(20);

struct fm_config {
  std::string dir;
  std::uint64_t buffers = 2;
  std::chrono::milliseconds lease_timeout{10000};
  bool crash_before_rename = false;  // fault injection for tests: WSYNC_FILE_MMAP_CRASH
  std::string write = "auto";        // how the publisher writes: mmap, pwrite, auto
};

std::string errno_text(int err) {
  return std::string(std::strerror(err));
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
}

// Start time of a process in clock ticks since boot (/proc/<pid>/stat field 22); 0 when it does
// not exist or already exited (a zombie). Tells a live reader from a pid reused by another.
std::uint64_t process_start_time(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 > text.size()) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && (fields >> field); ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return 0;
    if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
  }
  return 0;
}

std::string buffer_dir(const std::string& dir, std::uint64_t b) {
  return dir + "/buffer-" + std::to_string(b);
}

std::string segment_path(const std::string& dir, std::uint64_t b, std::size_t i) {
  char name[32];
  std::snprintf(name, sizeof name, "/segment-%04zu", i);
  return buffer_dir(dir, b) + name;
}

std::optional<std::string> file_read(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

result<void> fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return make_error(errc::io_error, "open " + path + ": " + errno_text(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return make_error(errc::io_error, "fsync " + path + ": " + errno_text(err));
  return {};
}

// Writes `text` to path.tmp, makes it durable, renames it over `path` and makes the rename
// durable: readers see the old file or the new one, never a mix, also after a crash.
// `before_rename` runs between the two (the fault-injection point).
result<void> file_replace_durably(const std::string& path, const std::string& text,
                                  const std::function<void()>& before_rename = {}) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return make_error(errc::io_error, "open " + tmp + ": " + errno_text(errno));
  std::size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      return make_error(errc::io_error, "write " + tmp + ": " + errno_text(err));
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    return make_error(errc::io_error, "fsync " + tmp + ": " + errno_text(err));
  }
  ::close(fd);
  if (before_rename) before_rename();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return make_error(errc::io_error, "rename " + tmp + ": " + errno_text(errno));
  }
  return fsync_path(path.substr(0, path.rfind('/')));
}

result<void> dir_ensure(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) == 0 || errno == EEXIST) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return {};
    return make_error(errc::io_error, "file-mmap: " + path + " exists and is not a directory");
  }
  return make_error(errc::io_error, "file-mmap: mkdir " + path + ": " + errno_text(errno));
}

// --- leases -------------------------------------------------------------------------------
// A reader holds buffer b while DIR/leases/buffer-<b>.<pid>.<nonce>.lease exists with a fresh
// mtime (its heartbeat). The writer ignores, and removes, a lease whose heartbeat is older than
// lease_timeout or whose process is gone from this host.

std::string lease_prefix(std::uint64_t b) {
  return "buffer-" + std::to_string(b) + ".";
}

struct lease_view {
  std::string name;
  std::string who;  // for "held by"
  bool live = true;
  std::string why_dead;
};

lease_view lease_judge(const std::string& leases, const std::string& name, const std::string& host,
                       std::chrono::milliseconds timeout) {
  lease_view v{name, "an unreadable lease " + name, true, {}};
  std::string path = leases + "/" + name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    v.live = false;  // released meanwhile
    return v;
  }
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  double age = static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) +
               static_cast<double>(now.tv_nsec - st.st_mtim.tv_nsec) / 1e9;
  auto text = file_read(path);
  auto j = nlohmann::json::parse(text.value_or(""), nullptr, false);
  if (j.is_object()) {
    std::string lhost = j.value("host", "");
    int pid = j.value("pid", 0);
    std::uint64_t start = j.value("start", std::uint64_t{0});
    char age_text[32];
    std::snprintf(age_text, sizeof age_text, "%.1f", age);
    v.who = "rank " + std::to_string(j.value("rank", -1)) + " (pid " + std::to_string(pid) +
            " on " + lhost + ", lease leases/" + name + ", heartbeat " + age_text + " s ago)";
    if (lhost == host && pid > 0) {
      std::uint64_t alive = process_start_time(pid);
      if (alive == 0 || (start != 0 && alive != start)) {
        v.live = false;
        v.why_dead = "its process is gone";
        return v;
      }
    }
  }
  if (age * 1000.0 > static_cast<double>(timeout.count())) {
    v.live = false;
    v.why_dead = "its heartbeat is older than lease_timeout_ms=" + std::to_string(timeout.count());
  }
  return v;
}

// Live leases on buffer b; removes the dead ones it finds (logged once, here).
std::vector<std::string> leases_live(const std::string& dir, std::uint64_t b,
                                     const std::string& host, std::chrono::milliseconds timeout) {
  std::vector<std::string> live;
  std::string leases = dir + "/leases";
  DIR* d = ::opendir(leases.c_str());
  if (!d) return live;
  std::vector<std::string> names;
  auto prefix = lease_prefix(b);
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n.rfind(prefix, 0) == 0 && n.size() > 6 && n.compare(n.size() - 6, 6, ".lease") == 0) {
      names.push_back(n);
    }
  }
  ::closedir(d);
  for (const auto& n : names) {
    auto v = lease_judge(leases, n, host, timeout);
    if (v.live) {
      live.push_back(v.who);
    } else if (!v.why_dead.empty() && ::unlink((leases + "/" + n).c_str()) == 0) {
      log_warn("file-mmap: buffer-" + std::to_string(b) + " freed from the lease of " + v.who +
               ": " + v.why_dead);
    }
  }
  return live;
}

// --- publisher ----------------------------------------------------------------------------

struct seg_file {
  int fd = -1;
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
    if (auto ok = buffer_size(static_cast<std::uint64_t>(chosen), buf, sizes); !ok) {
      return make_error(ok.error().code, ok.error().message + " (update_id=" + id + ")");
    }
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
    // Data first: STAMP and CURRENT must never name bytes that a crash could lose.
    for (std::size_t i = 0; i < buf.used; ++i) {
      auto& f = buf.files[i];
      for (std::uint64_t done = 0; pwrite_ && done < f.size;) {
        ssize_t n =
            ::pwrite(f.fd, f.staging.data() + done, f.size - done, static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          return make_error(errc::io_error, "file-mmap: pwrite " + segment_path(cfg_.dir, b, i) +
                                                ": " + errno_text(errno) + " (update_id=" + id +
                                                ")");
        }
        done += static_cast<std::uint64_t>(n);
      }
      if (f.size > 0 && ::fdatasync(f.fd) != 0) {
        return make_error(errc::io_error, "file-mmap: fdatasync " + segment_path(cfg_.dir, b, i) +
                                              ": " + errno_text(errno) + " (update_id=" + id + ")");
      }
    }
    nlohmann::json stamp = {{"update_id", id}};
    if (auto ok = file_replace_durably(buffer_dir(cfg_.dir, b) + "/STAMP", stamp.dump()); !ok) {
      return make_error(ok.error().code,
                        "file-mmap: " + ok.error().message + " (update_id=" + id + ")");
    }
    nlohmann::json h = {{"dir", cfg_.dir}, {"buffer", b}, {"segments", buf.used}};
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
    if (auto ok = file_replace_durably(cfg_.dir + "/CURRENT", state.dump(), hook); !ok) {
      return make_error(ok.error().code, "file-mmap: " + ok.error().message + " (" +
                                             update_context(m) + ", field CURRENT)");
    }
    current_ = b;
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
  // size keeps its inode, its blocks and its mapping, so a steady model writes in place.
  result<void> buffer_size(std::uint64_t b, buffer& buf, std::span<const std::uint64_t> sizes) {
    if (auto ok = dir_ensure(buffer_dir(cfg_.dir, b)); !ok) return ok;
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
      if (f.fd < 0) {
        f.fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (f.fd < 0) return fail("open");
        struct stat st {};
        if (::fstat(f.fd, &st) != 0) return fail("fstat");
        f.size = static_cast<std::uint64_t>(st.st_size);
      }
      if (f.size != sizes[i]) {
        if (f.mapped && f.size > 0) ::munmap(f.base, f.size);
        f.mapped = f.ready = false;
        f.base = nullptr;
        if (::ftruncate(f.fd, static_cast<off_t>(sizes[i])) != 0) return fail("ftruncate");
        f.size = sizes[i];
        // Reserve the blocks now: a full disk is an error here, not a SIGBUS while copying.
        if (sizes[i] > 0) {
          if (int rc = ::posix_fallocate(f.fd, 0, static_cast<off_t>(sizes[i]));
              rc != 0 && rc != EOPNOTSUPP && rc != EINVAL) {
            errno = rc;
            return fail("fallocate");
          }
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

// --- consumer -----------------------------------------------------------------------------

struct handle {
  std::string dir;
  std::uint64_t buffer = 0;
  std::size_t segments = 0;
};

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
    auto ctx = [&] {
      return update_context(m.update_id, rank_);
    };
    auto h = handle_parse(m);
    if (!h) return h.error();
    std::lock_guard lock(mutex_);
    if (held_.count(m.update_id)) {
      return make_error(errc::invalid_argument,
                        "file-mmap: update_id " + m.update_id + " imported twice (" + ctx() + ")");
    }
    // Our own dir, not the handle's: on a shared filesystem each host may mount it elsewhere.
    std::string bdir = buffer_dir(cfg_.dir, h->buffer);
    held entry;
    if (auto ok = dir_ensure(cfg_.dir + "/leases"); !ok) {
      return make_error(ok.error().code, ok.error().message + " (" + ctx() + ")");
    }
    auto nonce = random_hex(6);
    entry.lease = cfg_.dir + "/leases/" + lease_prefix(h->buffer) + std::to_string(::getpid()) +
                  "." + nonce + ".lease";
    nlohmann::json who = {{"host", host_},
                          {"pid", ::getpid()},
                          {"start", start_},
                          {"rank", rank_},
                          {"buffer", h->buffer},
                          {"update_id", m.update_id},
                          {"weight_version", m.weight_version}};
    // Written whole, then renamed: the writer never reads half a lease.
    std::string tmp = cfg_.dir + "/leases/." + nonce + ".tmp";
    {
      std::ofstream out(tmp);
      out << who.dump();
      if (!out) {
        return make_error(errc::io_error,
                          "file-mmap: cannot write lease " + tmp + " (" + ctx() + ", field dir)");
      }
    }
    if (::rename(tmp.c_str(), entry.lease.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      return make_error(errc::io_error,
                        "file-mmap: rename " + tmp + ": " + errno_text(err) + " (" + ctx() + ")");
    }
    // With the lease visible, STAMP tells whether the buffer still holds this update (the
    // writer removes STAMP before it looks at leases, see fm_publisher::acquire).
    auto stamp = file_read(bdir + "/STAMP");
    auto sj = nlohmann::json::parse(stamp.value_or(""), nullptr, false);
    if (!sj.is_object() || sj.value("update_id", "") != m.update_id) {
      ::unlink(entry.lease.c_str());
      struct stat st {};
      if (::stat(bdir.c_str(), &st) != 0) {
        return make_error(errc::unknown_update,
                          "unknown update_id: " + m.update_id + ": no " + bdir +
                              " (field transport_handle: this consumer's dir=" + cfg_.dir +
                              ", the publisher writes dir=" + h->dir + ") (" + ctx() + ")");
      }
      return make_error(errc::unknown_update,
                        "unknown update_id: " + m.update_id + " is no longer in " + bdir +
                            ": the publisher is reusing it for a newer update (field "
                            "transport_handle) (" +
                            ctx() + ")");
    }
    std::vector<std::span<const std::byte>> spans;
    for (std::size_t i = 0; i < h->segments; ++i) {
      std::uint64_t n = m.segments[i].nbytes;
      if (n == 0) {
        spans.emplace_back();
        continue;
      }
      std::string path = segment_path(cfg_.dir, h->buffer, i);
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      struct stat st {};
      if (fd < 0 || ::fstat(fd, &st) != 0 || static_cast<std::uint64_t>(st.st_size) < n) {
        int err = errno;
        if (fd >= 0) ::close(fd);
        drop(entry);
        return make_error(errc::invalid_manifest,
                          "invalid manifest: segments[" + std::to_string(i) + "].nbytes: " + path +
                              (fd < 0 ? " cannot be opened: " + errno_text(err)
                                      : " holds fewer than " + std::to_string(n) + " bytes") +
                              " (" + ctx() + ")");
      }
      // Read-only and shared: the page cache's pages, no copy (on NFS, the client's cache).
      void* p = ::mmap(nullptr, n, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
      int err = errno;
      ::close(fd);
      if (p == MAP_FAILED) {
        drop(entry);
        return make_error(errc::io_error,
                          "file-mmap: mmap " + path + ": " + errno_text(err) + " (" + ctx() + ")");
      }
      entry.maps.emplace_back(p, n);
      spans.emplace_back(static_cast<const std::byte*>(p), n);
    }
    held_.emplace(m.update_id, std::move(entry));
    if (!heartbeat_.joinable()) heartbeat_ = std::thread([this] { heartbeat_run(); });
    return spans;
  }

  void release(const update_id& id) override {
    std::lock_guard lock(mutex_);
    auto it = held_.find(id);
    if (it == held_.end()) return;
    drop(it->second);
    held_.erase(it);
  }

 private:
  struct held {
    std::string lease;
    std::vector<std::pair<void*, std::size_t>> maps;
  };

  // Unmaps first, then gives the lease back: the writer may resize the files once it is gone.
  static void drop(held& h) {
    for (auto [p, n] : h.maps) ::munmap(p, n);
    h.maps.clear();
    if (!h.lease.empty()) ::unlink(h.lease.c_str());
  }

  result<handle> handle_parse(const weight_update_manifest& m) const {
    auto bad = [&](const std::string& why) -> error {
      return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + why +
                                                    " (" + update_context(m.update_id, rank_) +
                                                    ")");
    };
    auto j = nlohmann::json::parse(m.transport_handle, nullptr, false);
    if (!j.is_object()) return bad("not a file-mmap handle");
    handle h;
    try {
      h.dir = j.at("dir").get<std::string>();
      h.buffer = j.at("buffer").get<std::uint64_t>();
      h.segments = j.at("segments").get<std::size_t>();
    } catch (const nlohmann::json::exception& e) {
      return bad(std::string("file-mmap handle field: ") + e.what());
    }
    if (h.buffer >= 64) return bad("buffer " + std::to_string(h.buffer) + " is out of range");
    if (h.segments != m.segments.size()) {
      return bad(std::to_string(h.segments) + " segment files for " +
                 std::to_string(m.segments.size()) + " segments");
    }
    return h;
  }

  // Refreshes the mtime of every lease this consumer holds, so the writer sees it alive.
  void heartbeat_run() {
    auto period = std::max(cfg_.lease_timeout / 4, std::chrono::milliseconds(5));
    std::unique_lock lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, period, [&] { return stop_; });
      if (stop_) break;
      for (const auto& [id, h] : held_) {
        if (::utimensat(AT_FDCWD, h.lease.c_str(), nullptr, 0) != 0 && errno == ENOENT) {
          log_warn("file-mmap: the lease on update_id " + id +
                   " was removed by the writer (this reader's heartbeat stalled beyond "
                   "lease_timeout_ms=" +
                   std::to_string(cfg_.lease_timeout.count()) + "); rank " + std::to_string(rank_));
        }
      }
    }
  }

  fm_config cfg_;
  std::string host_;
  std::uint64_t start_;
  std::int32_t rank_ = -1;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::unordered_map<update_id, held> held_;
  std::thread heartbeat_;
};

constexpr transport_caps fm_caps{.cpu_memory = true,
                                 .gpu_memory = false,
                                 .cross_process = true,
                                 .cross_node = true,  // over a filesystem both hosts mount
                                 .zero_copy_import = true};

class file_mmap_transport final : public transport {
 public:
  explicit file_mmap_transport(fm_config cfg) : cfg_(std::move(cfg)) {}
  std::string_view name() const override { return "file-mmap"; }
  transport_caps caps() const override { return fm_caps; }

  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    for (const auto& d : {cfg_.dir, cfg_.dir + "/leases"}) {
      if (auto ok = dir_ensure(d); !ok) return ok.error();
    }
    // One writer per directory: two would rename CURRENT under each other.
    std::string lock_path = cfg_.dir + "/publisher.lock";
    int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return make_error(errc::io_error,
                        "file-mmap: open " + lock_path + ": " + errno_text(errno) + " (field dir)");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      auto holder = file_read(lock_path).value_or("");
      ::close(fd);
      return make_error(errc::blocked, "blocked: file-mmap dir=" + cfg_.dir +
                                           " already has a publisher (" + holder +
                                           "); give each publisher its own dir (field dir)");
    }
    std::string me = "pid " + std::to_string(::getpid()) + " on " + host_name();
    if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, me.data(), me.size(), 0);
    std::int64_t current = -1;
    auto cur = file_mmap_current(cfg_.dir);
    if (!cur) {
      ::close(fd);
      return cur.error();
    }
    if (*cur) {
      auto state = nlohmann::json::parse(*file_read(cfg_.dir + "/CURRENT"), nullptr, false);
      current = state.value("buffer", std::int64_t{-1});
      log_info("file-mmap: " + cfg_.dir + "/CURRENT names weight_version " +
               std::to_string((*cur)->weight_version) + " in buffer-" + std::to_string(current) +
               "; it stays readable until a newer version replaces it");
    }
    bool use_pwrite = cfg_.write == "pwrite";
    if (cfg_.write == "auto") {
      struct statfs sf {};
      use_pwrite = !(::statfs(cfg_.dir.c_str(), &sf) == 0 && sf.f_type == TMPFS_MAGIC);
    }
    return std::unique_ptr<publisher_transport>(
        std::make_unique<fm_publisher>(cfg_, fd, current, use_pwrite));
  }

  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return std::unique_ptr<consumer_transport>(std::make_unique<fm_consumer>(cfg_));
  }

 private:
  fm_config cfg_;
};

}  // namespace

result<std::optional<weight_update_manifest>> file_mmap_current(const std::string& dir) {
  std::string path = dir + "/CURRENT";
  auto text = file_read(path);
  if (!text) {
    if (errno == ENOENT) return std::optional<weight_update_manifest>{};
    return make_error(errc::io_error, "file-mmap: cannot read " + path + ": " + errno_text(errno));
  }
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: " + path + ": " + why);
  };
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (!j.is_object() || j.value("format", "") != state_format) {
    return bad(std::string("not a ") + state_format + " state file");
  }
  if (!j.contains("manifest") || !j["manifest"].is_object()) return bad("no manifest field");
  auto m = manifest_from_json(j["manifest"].dump());
  if (!m) return bad(m.error().message);
  return std::optional<weight_update_manifest>(std::move(*m));
}

transport_entry file_mmap_entry() {
  return {"file-mmap",
          "a directory both sides mount (disk, tmpfs, NFS); double-buffered files, mmap import",
          fm_caps, [](const transport_options& options) -> result<std::unique_ptr<transport>> {
            options_reader reader("file-mmap", options);
            fm_config cfg;
            cfg.dir = reader.get_string("dir", "");
            auto buffers = reader.get_uint("buffers", 2, 2, 64);
            if (!buffers) return buffers.error();
            cfg.buffers = *buffers;
            auto timeout = reader.get_uint("lease_timeout_ms", 10000, 10, 86400000);
            if (!timeout) return timeout.error();
            cfg.lease_timeout = std::chrono::milliseconds(*timeout);
            cfg.write = reader.get_string("write", "auto");
            if (cfg.write != "auto" && cfg.write != "mmap" && cfg.write != "pwrite") {
              return make_error(errc::invalid_argument, "file-mmap option write: \"" + cfg.write +
                                                            "\" is not one of auto, mmap, pwrite");
            }
            if (auto ok = reader.finish(); !ok) return ok.error();
            if (cfg.dir.empty()) {
              return make_error(errc::invalid_argument,
                                "file-mmap option dir: required (the directory both sides reach, "
                                "e.g. --transport-option dir=/mnt/shared/weights)");
            }
            while (cfg.dir.size() > 1 && cfg.dir.back() == '/') cfg.dir.pop_back();
            // Fault injection for the crash tests (docs/transports.md); read once, here.
            if (const char* crash = std::getenv("WSYNC_FILE_MMAP_CRASH")) {
              if (std::string(crash) != "before-rename") {
                return make_error(errc::invalid_argument,
                                  "WSYNC_FILE_MMAP_CRASH: unknown fault point \"" +
                                      std::string(crash) + "\" (known: before-rename)");
              }
              cfg.crash_before_rename = true;
            }
            return std::unique_ptr<transport>(std::make_unique<file_mmap_transport>(cfg));
          }};
}

}  // namespace wsync
