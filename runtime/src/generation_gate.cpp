#include "wsync/runtime/generation_gate.hpp"

namespace wsync {

void generation_gate::lock_shared() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !writer_ && writers_waiting_ == 0; });
  ++readers_;
}

void generation_gate::unlock_shared() {
  std::lock_guard lock(mutex_);
  if (--readers_ == 0) cv_.notify_all();
}

void generation_gate::lock() {
  std::unique_lock lock(mutex_);
  ++writers_waiting_;
  cv_.wait(lock, [&] { return !writer_ && readers_ == 0; });
  --writers_waiting_;
  writer_ = true;
}

void generation_gate::unlock() {
  std::lock_guard lock(mutex_);
  writer_ = false;
  cv_.notify_all();
}

std::uint64_t generation_gate::active_readers() const {
  std::lock_guard lock(mutex_);
  return readers_;
}

std::uint64_t generation_gate::waiting_writers() const {
  std::lock_guard lock(mutex_);
  return writers_waiting_;
}

}  // namespace wsync
