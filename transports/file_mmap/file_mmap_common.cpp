// The file helpers, the leases and the state file of the file-mmap transport.

#include "file_mmap/file_mmap_common.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/json_read.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/json_bounded.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync::file_mmap_detail {

std::string errno_text(int err) {
  return std::string(std::strerror(err));
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown-host";
  return buf;
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
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
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
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return make_error(errc::io_error, "open " + path + ": " + errno_text(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return make_error(errc::io_error, "fsync " + path + ": " + errno_text(err));
  return {};
}

int write_fully(int fd, const void* data, std::size_t n, off_t offset) {
  const auto* p = static_cast<const char*>(data);
  for (std::size_t done = 0; done < n;) {
    ssize_t w = offset < 0 ? ::write(fd, p + done, n - done)
                           : ::pwrite(fd, p + done, n - done, offset + static_cast<off_t>(done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;
    done += static_cast<std::size_t>(w);
  }
  return 0;
}

// Writes `text` to path.tmp, makes it durable, renames it over `path` and makes the rename
// durable: readers see the old file or the new one, never a mix, also after a crash.
// `before_rename` runs between the two (the fault-injection point).
result<void> file_replace_durably(const std::string& path, const std::string& text,
                                  const std::function<void()>& before_rename, bool* renamed) {
  if (renamed) *renamed = false;
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return make_error(errc::io_error, "open " + tmp + ": " + errno_text(errno));
  // On every failure below the half-written file goes too: nothing else would remove it.
  if (int err = write_fully(fd, text.data(), text.size()); err != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return make_error(errc::io_error, "write " + tmp + ": " + errno_text(err));
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return make_error(errc::io_error, "fsync " + tmp + ": " + errno_text(err));
  }
  ::close(fd);
  if (before_rename) before_rename();
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return make_error(errc::io_error, "rename " + tmp + ": " + errno_text(err));
  }
  if (renamed) *renamed = true;
  return fsync_path(path.substr(0, path.rfind('/')));
}

result<void> dir_ensure(const std::string& path, bool inside, bool writer) {
  // Weights and manifests are the owner's alone, as in shared memory (0600 files, 0700 dirs).
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    return make_error(errc::io_error, "file-mmap: mkdir " + path + ": " + errno_text(errno));
  }
  // The folder the user named may be a link to where the files live; one of ours is not: a
  // link put there would send the weights (and CURRENT) wherever it points.
  struct stat st {};
  if ((inside ? ::lstat(path.c_str(), &st) : ::stat(path.c_str(), &st)) != 0 ||
      !S_ISDIR(st.st_mode)) {
    return make_error(errc::io_error, "file-mmap: " + path + " exists and is not a directory" +
                                          (inside ? " (a link is refused here)" : ""));
  }
  // Whoever else may write into it could replace CURRENT or a segment: readers would trust
  // their manifest and checksums. Never one anybody may write; for the writer, its user's
  // folder or root's. (Group write is let be: a umask of 002 gives it to folders a user makes,
  // for the user's own group. A reader follows its writer's folder, whoever owns it.)
  if ((writer && st.st_uid != ::geteuid() && st.st_uid != 0) || (st.st_mode & S_IWOTH) != 0) {
    return make_error(
        errc::io_error,
        "file-mmap: " + path + " is owned by uid " + std::to_string(st.st_uid) + " with mode " +
            [&] {
              char mode[8];
              std::snprintf(mode, sizeof mode, "%04o", st.st_mode & 07777);
              return std::string(mode);
            }() +
            ": another user could replace the files in it; use a folder only this user (uid " +
            std::to_string(::geteuid()) + ") and its group may write (field dir)");
  }
  return {};
}

// --- leases -------------------------------------------------------------------------------
// A reader holds buffer b while DIR/leases/buffer-<b>.<pid>.<nonce>.lease exists with a fresh
// mtime (its heartbeat). The writer ignores, and removes, a lease whose heartbeat is older than
// lease_timeout or whose process is gone from this host.

std::string lease_prefix(std::uint64_t b) {
  return "buffer-" + std::to_string(b) + ".";
}

namespace {

struct lease_view {
  std::string name;
  std::string who;  // for "held by"
  bool live = true;
  std::string why_dead;
  /// Dead by its heartbeat only, and its reader may be on this host: its process still runs
  /// here (frozen, or too slow to refresh), runs in another PID namespace of this host, or the
  /// lease cannot be read to tell. Such a reader may still read what it mapped.
  bool reader_lives = false;
};

lease_view lease_judge(const std::string& leases, const std::string& name, const std::string& host,
                       std::chrono::milliseconds timeout) {
  lease_view v{name, "an unreadable lease " + name, true, {}};
  std::string path = leases + "/" + name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    // Gone: released meanwhile. Any other failure cannot tell a live reader from a dead one,
    // and the buffer is only rewritten on proof that nobody reads it.
    if (errno == ENOENT) {
      v.live = false;
    } else {
      v.who = "a lease the writer cannot stat (leases/" + name + ": " + errno_text(errno) + ")";
    }
    return v;
  }
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  double age = static_cast<double>(now.tv_sec - st.st_mtim.tv_sec) +
               static_cast<double>(now.tv_nsec - st.st_mtim.tv_nsec) / 1e9;
  auto lease = lease_parse(file_read(path).value_or(""));
  v.reader_lives = !lease || lease->host == host;
  if (lease) {
    char age_text[32];
    std::snprintf(age_text, sizeof age_text, "%.1f", age);
    v.who = "rank " + std::to_string(lease->rank) + " (pid " + std::to_string(lease->pid) + " on " +
            lease->host + ", lease leases/" + name + ", heartbeat " + age_text + " s ago)";
    // The pid means something here only on this host, in this PID namespace (a reader in
    // another container on this node shares the hostname, not the pids): else the heartbeat
    // alone tells.
    if (lease->host == host && lease->pid > 0 && detail::pid_checkable(lease->pidns)) {
      std::uint64_t alive = process_start_time(lease->pid);
      if (alive == 0 || (lease->start != 0 && alive != lease->start)) {
        v.live = false;
        v.why_dead = "its process is gone";
        v.reader_lives = false;
        return v;
      }
    }
  }
  if (age * 1000.0 > static_cast<double>(timeout.count())) {
    v.live = false;
    v.why_dead = "its heartbeat is older than lease_timeout_ms=" + std::to_string(timeout.count());
    if (v.reader_lives) v.why_dead += ", though its reader may still run on this host";
  } else {
    v.reader_lives = false;
  }
  return v;
}

}  // namespace

std::string fresh_files_path(const std::string& dir, std::uint64_t b) {
  return buffer_dir(dir, b) + "/FRESH";
}

bool fresh_files_mark(const std::string& dir, std::uint64_t b, const std::string& who) {
  int fd = ::open(fresh_files_path(dir, b).c_str(),
                  O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return false;
  const std::string line = who + "\n";
  const int err = write_fully(fd, line.data(), line.size());
  ::close(fd);
  errno = err;
  return err == 0;
}

// Live leases on buffer b; removes the dead ones it finds (logged once, here).
std::vector<std::string> leases_live(const std::string& dir, std::uint64_t b,
                                     const std::string& host, std::chrono::milliseconds timeout) {
  std::vector<std::string> live;
  std::string leases = dir + "/leases";
  DIR* d = ::opendir(leases.c_str());
  if (!d) {
    // No folder: no reader ever came. Unreadable: whoever reads cannot be seen, so the buffer
    // counts as held (an unreadable folder must not look like an empty one).
    if (errno != ENOENT)
      live.push_back("readers the writer cannot list (" + leases + ": " + errno_text(errno) + ")");
    return live;
  }
  std::vector<std::string> names;
  auto prefix = lease_prefix(b);
  std::vector<std::string> temporaries;
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (!e) {
      if (errno != 0) {
        live.push_back("readers the writer cannot list (readdir " + leases + ": " +
                       errno_text(errno) + ")");
      }
      break;
    }
    std::string n = e->d_name;
    if (n.rfind(prefix, 0) == 0 && n.size() > 6 && n.compare(n.size() - 6, 6, ".lease") == 0) {
      names.push_back(n);
    } else if (n.size() > 5 && n[0] == '.' && n.compare(n.size() - 4, 4, ".tmp") == 0) {
      temporaries.push_back(n);
    }
  }
  ::closedir(d);
  // A lease is written to .<random>.tmp and renamed at once: one older than a lease's timeout
  // is what a consumer that died between the two left, and nothing else would remove it.
  for (const auto& n : temporaries) {
    const std::string path = leases + "/" + n;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) continue;
    const auto age = std::chrono::system_clock::now() -
                     std::chrono::system_clock::from_time_t(st.st_mtim.tv_sec);
    if (age > timeout + std::chrono::seconds(1)) ::unlink(path.c_str());
  }
  for (const auto& n : names) {
    auto v = lease_judge(leases, n, host, timeout);
    if (v.live) {
      live.push_back(v.who);
    } else if (!v.why_dead.empty()) {
      // Marked before the lease goes: a publisher that restarts in between still finds it.
      if (v.reader_lives && !fresh_files_mark(dir, b, v.who)) {
        live.push_back(v.who + " (its buffer cannot be marked for new files: " + errno_text(errno) +
                       ")");
        continue;
      }
      if (::unlink((leases + "/" + n).c_str()) != 0 && errno != ENOENT) {
        // Still there (EIO on a soft NFS mount, EACCES, EROFS): its reader's heartbeat goes on
        // finding it and its intact() passes, so the buffer must not be rewritten under it.
        live.push_back(v.who + " (its expired lease cannot be removed: " + errno_text(errno) + ")");
        continue;
      }
      log_warn("file-mmap: buffer-" + std::to_string(b) + " freed from the lease of " + v.who +
               ": " + v.why_dead);
    }
  }
  return live;
}

result<std::optional<current_state>> current_read(const std::string& dir) {
  std::string path = dir + "/CURRENT";
  auto text = file_read(path);
  if (!text) {
    if (errno == ENOENT) return std::optional<current_state>{};
    return make_error(errc::io_error, "file-mmap: cannot read " + path + ": " + errno_text(errno));
  }
  auto state = current_parse(*text, path);
  if (!state) return state.error();
  return std::optional<current_state>(std::move(*state));
}

// --- decoders ---------------------------------------------------------------------------------

result<current_state> current_parse(const std::string& text, const std::string& path) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: " + path + ": " + why);
  };
  auto j = json_parse_bounded(text);
  if (!j.is_object() || !j.contains("format") || j["format"] != state_format) {
    return bad(std::string("not a ") + state_format + " state file");
  }
  current_state state;
  if (!j.contains("buffer")) return bad("no buffer field");
  const auto& b = j["buffer"];
  if (!b.is_number_integer()) return bad("buffer: must be an integer");
  // -1 (none yet) or a buffer a handle may name: the publisher adds to it. Read unsigned as
  // unsigned: 2^64 - 1 must not pass as -1.
  if (b.is_number_unsigned() ? b.get<std::uint64_t>() >= 64
                             : b.get<std::int64_t>() < -1 || b.get<std::int64_t>() >= 64) {
    return bad("buffer: " + b.dump() + " is out of range (-1 to 63)");
  }
  state.buffer = b.get<std::int64_t>();
  if (!j.contains("manifest") || !j["manifest"].is_object()) return bad("no manifest field");
  auto m = manifest_from_json(j["manifest"].dump());
  if (!m) return bad(m.error().message);
  // The buffer a crash falls back to is the one the manifest's readers map: the two must agree,
  // or the publisher would rewrite what CURRENT serves.
  auto h = handle_parse(*m, -1);
  if (!h) return bad(h.error().message);
  if (state.buffer != static_cast<std::int64_t>(h->buffer)) {
    return bad("buffer: " + std::to_string(state.buffer) + " is not buffer-" +
               std::to_string(h->buffer) + ", which its manifest's handle names");
  }
  state.manifest = std::move(*m);
  return state;
}

result<handle> handle_parse(const weight_update_manifest& m, std::int32_t rank) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + why + " (" +
                                                  update_context(m.update_id, rank) + ")");
  };
  auto j = json_parse_bounded(m.transport_handle);
  if (!j.is_object()) return bad("not a file-mmap handle");
  handle h;
  try {
    h.dir = j.at("dir").get<std::string>();
    h.buffer = json_read::field<std::uint64_t>(j, "buffer");
    h.segments = json_read::field<std::size_t>(j, "segments");
    if (j.contains("lease_timeout_ms")) {
      h.lease_timeout_ms = json_read::field<std::uint64_t>(j, "lease_timeout_ms");
    }
  } catch (const std::exception& e) {
    return bad(std::string("file-mmap handle field: ") + e.what());
  }
  if (h.buffer >= 64) return bad("buffer " + std::to_string(h.buffer) + " is out of range");
  if (j.contains("lease_timeout_ms") &&
      (h.lease_timeout_ms < 10 || h.lease_timeout_ms > 86400000)) {
    return bad("lease_timeout_ms " + std::to_string(h.lease_timeout_ms) +
               " is not in [10, 86400000]");
  }
  if (h.segments != m.segments.size()) {
    return bad(std::to_string(h.segments) + " segment files for " +
               std::to_string(m.segments.size()) + " segments");
  }
  return h;
}

std::optional<lease_record> lease_parse(const std::string& text) {
  auto j = json_parse_bounded(text);
  if (!j.is_object()) return std::nullopt;
  lease_record r;
  try {
    if (j.contains("host")) r.host = j["host"].get<std::string>();
    if (j.contains("pid")) r.pid = json_read::field<int>(j, "pid");
    if (j.contains("start")) r.start = json_read::field<std::uint64_t>(j, "start");
    if (j.contains("rank")) r.rank = json_read::field<int>(j, "rank");
    if (j.contains("pidns")) r.pidns = json_read::field<std::uint64_t>(j, "pidns");
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return r;
}

std::string stamp_update_id(const std::string& text) {
  auto j = json_parse_bounded(text);
  if (!j.is_object() || !j.contains("update_id") || !j["update_id"].is_string()) return "";
  return j["update_id"].get<std::string>();
}

}  // namespace wsync::file_mmap_detail
