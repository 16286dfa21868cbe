// The file-mmap transport: its options, its capabilities and how it builds its halves
// (publisher.cpp, consumer.cpp; what they share is in file_mmap_common.hpp).

#include "file_mmap/file_mmap.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "file_mmap/file_mmap_common.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {
namespace {

using namespace file_mmap_detail;

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
    if (auto ok = dir_ensure(cfg_.dir, false, true); !ok) return ok.error();
    if (auto ok = dir_ensure(cfg_.dir + "/leases", true, true); !ok) return ok.error();
    // One writer per directory: two would rename CURRENT under each other.
    std::string lock_path = cfg_.dir + "/publisher.lock";
    int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
      return make_error(errc::io_error,
                        "file-mmap: open " + lock_path + ": " + errno_text(errno) + " (field dir)");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) {  // ENOLCK (NFS without lockd), EINTR, ...: not a publisher
        auto err = errno_text(errno);
        ::close(fd);
        return make_error(errc::io_error, "file-mmap: flock " + lock_path + ": " + err +
                                              " (field dir: one publisher per dir is enforced "
                                              "with flock, which this filesystem refuses)");
      }
      auto holder = file_read(lock_path).value_or("");
      ::close(fd);
      return make_error(errc::blocked, "blocked: file-mmap dir=" + cfg_.dir +
                                           " already has a publisher (" + holder +
                                           "); give each publisher its own dir (field dir)");
    }
    std::string me = "pid " + std::to_string(::getpid()) + " on " + host_name();
    if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, me.data(), me.size(), 0);
    std::int64_t current = -1;
    auto cur = current_read(cfg_.dir);
    if (!cur) {
      ::close(fd);
      return cur.error();
    }
    if (*cur) {
      current = (*cur)->buffer;
      log_info("file-mmap: " + cfg_.dir + "/CURRENT names weight_version " +
               std::to_string((*cur)->manifest.weight_version) + " in buffer-" +
               std::to_string(current) + "; it stays readable until a newer version replaces it");
    }
    bool use_pwrite = cfg_.write == "pwrite";
    if (cfg_.write == "auto") {
      struct statfs sf {};
      use_pwrite = !(::statfs(cfg_.dir.c_str(), &sf) == 0 && sf.f_type == TMPFS_MAGIC);
    }
    return make_fm_publisher(cfg_, fd, current, use_pwrite);
  }

  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return make_fm_consumer(cfg_);
  }

 private:
  fm_config cfg_;
};

}  // namespace

result<std::optional<weight_update_manifest>> file_mmap_current(const std::string& dir) {
  auto cur = file_mmap_detail::current_read(dir);
  if (!cur) return cur.error();
  if (!*cur) return std::optional<weight_update_manifest>{};
  return std::optional<weight_update_manifest>(std::move((*cur)->manifest));
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
