#pragma once
// Passing a shared-memory slot's file descriptor from one consumer to another on the same node,
// so that a rank which (re)joins after the publisher exited still gets the last committed
// version while any peer maps it: the publisher unlinked the slot's name, but the memory lives
// as long as a mapping or descriptor of it does.
//
// Every shared-memory consumer listens on an abstract Unix socket named
// "wsync-peer-<uid>-<pid>-<random>" (abstract: nothing on disk to leave behind, and per network
// namespace, so emulated nodes do not see each other's). A consumer that cannot open a slot by
// name asks each such socket of its own uid for that slot; the peer answers with a read-only
// descriptor (SCM_RIGHTS) only for a slot it maps, and both ends check with SO_PEERCRED that
// the other runs as the same user. The slot's name is a 128-bit secret that only manifests
// carry, and the importer still checks the slot's header, generation and checksums.

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "wsync/manifest/result.hpp"

namespace wsync::shm_peer {

/// The abstract socket names of this user's listening peers on this node, from /proc/net/unix.
std::vector<std::string> peers_listening();

/// A slot received from a peer: a read-only descriptor (the caller closes it) and the rank of
/// the consumer that had it.
struct fetched {
  int fd = -1;
  std::int32_t rank = -1;
};

/// `lookup(name)`: a descriptor of slot `name` that the caller may close (a dup), or -1 when this
/// consumer does not map it. Called under a process-wide lock: it must not block for long.
using lookup_fn = std::function<int(const std::string& name)>;

/// One shared-memory consumer's place among the process's: while it lives, the process answers
/// peers' requests for the slots this consumer maps (one socket and one thread per process,
/// however many consumer ranks it holds).
class registration {
 public:
  registration(lookup_fn lookup, std::function<std::int32_t()> rank);
  ~registration();
  registration(const registration&) = delete;
  registration& operator=(const registration&) = delete;
  std::uint64_t id() const { return id_; }

 private:
  std::uint64_t id_ = 0;
};

/// Asks the other consumers of this process, then every listening peer process of this user on
/// this node, for slot `name`; the first that maps it answers. `self` is left out. An error says
/// how many peers were asked.
result<fetched> fetch(const std::string& name, const registration& self);

}  // namespace wsync::shm_peer
