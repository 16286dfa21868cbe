#include "shared_memory/slot_fds.hpp"

#include <pthread.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <new>

namespace wsync::shared_memory_detail {

slot_fd::~slot_fd() {
  ::close(fd);
}

int slot_fd::hold() const {
  std::lock_guard lock(mu_);
  if (holds_ == 0 && ::flock(fd, LOCK_SH | LOCK_NB) != 0) return errno;
  ++holds_;
  return 0;
}

void slot_fd::unhold() const {
  std::lock_guard lock(mu_);
  if (holds_ > 0 && --holds_ == 0) ::flock(fd, LOCK_UN);
}

open_slots& open_slots::instance() {
  static auto* s = [] {
    // A forked child has none of the parent's threads: one of them may have held the lock at
    // the fork. Its entries are dropped too: an inherited descriptor shares the parent's open
    // file description, and so its readers' lock (slot_fd::hold); a slot the child maps gets a
    // description of its own.
    ::pthread_atfork(nullptr, nullptr, [] {
      new (&instance().mu_) std::mutex;
      instance().by_name_.clear();
    });
    return new open_slots;
  }();
  return *s;
}

std::shared_ptr<const slot_fd> open_slots::adopt(const std::string& name, int fd) {
  std::lock_guard lock(mu_);
  auto& entry = by_name_[name];
  if (auto held = entry.lock()) {
    ::close(fd);
    return held;
  }
  auto made = std::make_shared<const slot_fd>(fd);
  entry = made;
  if (by_name_.size() > 256) {  // names of slots nobody maps any more
    std::erase_if(by_name_, [](const auto& kv) { return kv.second.expired(); });
  }
  return made;
}

}  // namespace wsync::shared_memory_detail
