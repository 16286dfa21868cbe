#pragma once
// The gate between generation (readers of the active weights) and installs (the one writer).
// Writer-preferring: once an install waits, new generations wait behind it, so hundreds of
// readers cannot starve an update.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace wsync {

/// Meets the SharedMutex requirements, so std::shared_lock / std::unique_lock work on it.
class generation_gate {
 public:
  /// Shared side: one generation step. Blocks while an install holds or waits for the gate.
  void lock_shared();
  /// lock_shared() that says how long an install held this generation back (zero when no
  /// install held or waited for the gate): the pause installs cost readers.
  std::chrono::nanoseconds lock_shared_timed();
  void unlock_shared();
  /// Exclusive side: waits for running generations to finish and holds new ones back.
  void lock();
  void unlock();

  /// Generations running now (for status and tests).
  std::uint64_t active_readers() const;
  /// Installs waiting for the exclusive side (for status and tests).
  std::uint64_t waiting_writers() const;
  /// Generations held back by an install (for tests).
  std::uint64_t waiting_readers() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t readers_ = 0;
  std::uint64_t writers_waiting_ = 0;
  std::uint64_t readers_waiting_ = 0;
  bool writer_ = false;
};

}  // namespace wsync
