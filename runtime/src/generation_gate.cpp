#include "wsync/runtime/generation_gate.hpp"

namespace wsync {

void generation_gate::lock_shared() {
  (void)lock_shared_timed();
}

std::chrono::nanoseconds generation_gate::lock_shared_timed() {
  std::unique_lock lock(mutex_);
  std::chrono::nanoseconds held_back{0};
  if (writer_ || writers_waiting_ > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    ++readers_waiting_;
    cv_.wait(lock, [&] { return !writer_ && writers_waiting_ == 0; });
    --readers_waiting_;
    held_back = std::chrono::steady_clock::now() - t0;
  }
  ++readers_;
  return held_back;
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

std::uint64_t generation_gate::waiting_readers() const {
  std::lock_guard lock(mutex_);
  return readers_waiting_;
}

}  // namespace wsync
