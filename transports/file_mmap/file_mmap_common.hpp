#pragma once
// What the halves of the file-mmap transport share (README.md beside this file): its settings,
// the handle, the file helpers, the leases and the state file. Private to the transport.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/process.hpp"
#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync::file_mmap_detail {

inline constexpr char state_format[] = "wsync-file-mmap/1";
inline constexpr auto lease_poll = std::chrono::milliseconds(20);

struct fm_config {
  std::string dir;
  std::uint64_t buffers = 2;
  std::chrono::milliseconds lease_timeout{10000};
  bool crash_before_rename = false;  // fault injection for tests: WSYNC_FILE_MMAP_CRASH
  std::string write = "auto";        // how the publisher writes: mmap, pwrite, auto
};

/// What a consumer reads from a manifest's transport_handle.
struct handle {
  std::string dir;
  std::uint64_t buffer = 0;
  std::size_t segments = 0;
  /// The writer's lease_timeout_ms (0: a writer that did not say): a reader's heartbeat must
  /// come well within it, whatever the reader's own setting.
  std::uint64_t lease_timeout_ms = 0;
};

// --- decoders of what other processes wrote (fuzzed: fuzz/targets/file_mmap_files.cpp) ------
// They never throw: a malformed input is an error naming the field, or "no such record".

/// The handle of `m`, checked against its segments; errors name `rank`.
result<handle> handle_parse(const weight_update_manifest& m, std::int32_t rank);

/// Who wrote a lease file (DIR/leases/*.lease): absent fields keep their defaults; nullopt when
/// the text is not a JSON object or a field has the wrong type.
struct lease_record {
  std::string host;
  int pid = 0;
  std::uint64_t start = 0;  // process_start_time of pid, 0 if unknown
  int rank = -1;
  std::uint64_t pidns = 0;  // the PID namespace `pid` belongs to, 0 if unknown
};
std::optional<lease_record> lease_parse(const std::string& text);

/// The update_id a buffer's STAMP file names; "" when it names none.
std::string stamp_update_id(const std::string& text);

std::string errno_text(int err);
std::string host_name();
using detail::pid_namespace;
using detail::process_start_time;
std::string buffer_dir(const std::string& dir, std::uint64_t b);
std::string segment_path(const std::string& dir, std::uint64_t b, std::size_t i);
std::optional<std::string> file_read(const std::string& path);
result<void> fsync_path(const std::string& path);
/// Writes all `n` bytes of `data` to `fd` (at `offset` with pwrite when it is not negative),
/// across short writes and EINTR: 0, or the errno that stopped it (EIO for a write that made no
/// progress).
int write_fully(int fd, const void* data, std::size_t n, off_t offset = -1);
/// path.tmp, fsync, `before_rename`, rename over path, fsync of the folder. `*renamed` (when
/// given) says whether the rename happened: an error after it leaves the new file in place.
result<void> file_replace_durably(const std::string& path, const std::string& text,
                                  const std::function<void()>& before_rename = {},
                                  bool* renamed = nullptr);
/// Makes `path` (0700) or checks it: a directory others may not write, owned by this user (or
/// root) when `writer`. `inside`: one of the transport's own folders in the dir, where a link is
/// refused.
result<void> dir_ensure(const std::string& path, bool inside, bool writer);

/// "buffer-<b>.": how the leases on buffer b begin.
std::string lease_prefix(std::uint64_t b);
/// DIR/buffer-b/FRESH: a reader may still map the buffer's files though its lease is gone, so
/// the buffer's next update goes to new files. Holds one line per such reader ("rank R (pid P on
/// HOST, ...)"). Appended to before such a lease is removed (false with errno when it cannot
/// be), removed once the new files exist.
std::string fresh_files_path(const std::string& dir, std::uint64_t b);
bool fresh_files_mark(const std::string& dir, std::uint64_t b, const std::string& who);

/// Who holds buffer b: one "rank R (pid P on HOST, ...)" per live lease; dead ones are removed.
std::vector<std::string> leases_live(const std::string& dir, std::uint64_t b,
                                     const std::string& host, std::chrono::milliseconds timeout);

/// DIR/CURRENT: the buffer it names and the manifest of the version there; nullopt when absent.
struct current_state {
  std::int64_t buffer = -1;
  weight_update_manifest manifest;
};
result<std::optional<current_state>> current_read(const std::string& dir);
/// The text of DIR/CURRENT (`path`, for errors) decoded.
result<current_state> current_parse(const std::string& text, const std::string& path);

/// The halves (publisher.cpp, consumer.cpp). `lock_fd` holds DIR/publisher.lock; `current` is
/// the buffer CURRENT names (-1: none).
std::unique_ptr<publisher_transport> make_fm_publisher(fm_config cfg, int lock_fd,
                                                       std::int64_t current, bool use_pwrite);
std::unique_ptr<consumer_transport> make_fm_consumer(fm_config cfg);

}  // namespace wsync::file_mmap_detail
