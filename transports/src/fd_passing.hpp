#pragma once
// Passing a file descriptor between processes of one user over a Unix socket (SCM_RIGHTS), with
// the peer's identity checked by the kernel (SO_PEERCRED). Shared-memory consumers pass slots
// to peers with it; CUDA VMM segments (POSIX-fd handles) will travel the same way.

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include <cstddef>
#include <functional>
#include <string>

namespace wsync::fd_passing {

/// Fills `a` with the abstract Unix socket address `name` (no file: sun_path starts with NUL and
/// the name follows without a terminator) and returns its length for bind or connect.
socklen_t abstract_address(const std::string& name, sockaddr_un& a);

/// True when the process at the other end of Unix socket `sock` runs as this process's user.
bool same_user(int sock);

/// Send and receive timeouts of `ms` on `sock`, so a stuck peer cannot block a caller forever.
void set_timeouts(int sock, int ms);

/// Sends `bytes` bytes of `data` as one message, with `fd` attached when it is >= 0 (the caller
/// keeps its own copy). Returns the bytes sent, or -1 (errno set).
ssize_t send_with_fd(int sock, const void* data, std::size_t bytes, int fd);

/// Receives one message of up to `bytes` into `data`; `*fd` is the descriptor that came with it
/// (close-on-exec, the caller closes it) or -1. Extra descriptors a peer attached are closed.
/// Returns the bytes received, 0 at the end, or -1 (errno set).
ssize_t receive_with_fd(int sock, void* data, std::size_t bytes, int* fd);

/// A descriptor server's thread body: accepts connections on listening socket `listen_fd` and
/// calls `answer(connection)` for each, one at a time, closing it after, until eventfd
/// `wake_fd` is written.
void serve(int listen_fd, int wake_fd, const std::function<void(int)>& answer);

}  // namespace wsync::fd_passing
