#pragma once
// One open descriptor per shared-memory slot per process, however many consumer ranks of the
// process map it: with a descriptor per rank, 1,024 ranks in one process would pass the usual
// `ulimit -n` of 1,024 at the first update. The descriptors stay open so that a peer on this
// node can be given the slot after its publisher exited (peer_fd.hpp).

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace wsync::shared_memory_detail {

/// An open descriptor of one slot, closed when the last rank that maps the slot lets it go. It is
/// the process's own open file description (never one shared with another process), so its
/// flock is this process's alone.
struct slot_fd {
  explicit slot_fd(int f) : fd(f) {}
  ~slot_fd();
  slot_fd(const slot_fd&) = delete;
  slot_fd& operator=(const slot_fd&) = delete;

  /// A rank of this process reads the slot until it calls unhold(): while any does, the process
  /// holds a shared flock that keeps the publisher from rewriting the slot (slot_claim), even
  /// after the coordinator took the rank for dead. 0, or the errno of a refused lock
  /// (EWOULDBLOCK: the publisher is taking the slot for a newer update right now).
  int hold() const;
  void unhold() const;

  const int fd;

 private:
  mutable std::mutex mu_;
  mutable int holds_ = 0;
};

class open_slots {
 public:
  /// The process's table (never destroyed: consumers may outlive static destructors).
  static open_slots& instance();
  /// Takes `fd`, a new descriptor of slot `name`; when another rank of this process already holds
  /// one, closes `fd` and shares that one.
  std::shared_ptr<const slot_fd> adopt(const std::string& name, int fd);

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::weak_ptr<const slot_fd>> by_name_;
};

}  // namespace wsync::shared_memory_detail
