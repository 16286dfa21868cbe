#pragma once
// Pause and resume of generation, as the HTTP /pause and /resume drive them (docs/http.md). A
// generation brackets itself with begin()/end() and calls step() before each step it runs:
//  - abort: in-flight generations end at their next step with generation_status::aborted, and
//    pause() returns once none is left;
//  - wait:  in-flight generations run to completion, and pause() returns once they drained;
//  - keep:  in-flight generations hold at their next step and go on after resume(); pause()
//    returns once each of them is holding or done.
// In every mode a generation that begins while paused waits for resume().
// Apart from the pause, an update that must not be read by generations begun before it (SGLang's
// abort_all_requests) calls abort_and_hold(): every generation in flight or waiting to begin
// ends, and none begins until release_hold(). A hold is not a pause: paused() does not show it,
// and a pause made while it lasts stays after it.

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string_view>

namespace wsync {

enum class pause_mode { abort, wait, keep };
/// "abort" | "wait" | "keep"; nullopt for anything else.
std::optional<pause_mode> pause_mode_parse(std::string_view text);
const char* pause_mode_name(pause_mode mode);

enum class generation_status { running, aborted };

class generation_control {
 public:
  /// Blocks while paused or held; then counts the generation as in flight. Returns its ticket.
  /// A generation that an abort ended while it waited begins with a ticket its first step()
  /// refuses.
  std::uint64_t begin();
  /// Before each step: aborted if an abort caught this generation (then stop and call end());
  /// in keep mode, holds until resume() (or an abort).
  generation_status step(std::uint64_t ticket);
  void end(std::uint64_t ticket);

  /// Pauses and returns when the mode's promise holds (see above): true, or false when a
  /// resume() came first. Pausing again while paused changes nothing (neither the mode nor the
  /// generations) and returns when the pause in force keeps its promise, in its own mode.
  [[nodiscard]] bool pause(pause_mode mode);
  void resume();

  /// Ends every generation in flight or waiting to begin, paused or not, and returns once those
  /// in flight ended; until release_hold() no generation begins. Holds stack.
  void abort_and_hold();
  void release_hold();
  /// For good, before shutting down: every generation in flight or waiting ends, any that
  /// begins later is refused at its first step; returns once none is in flight.
  void close();

  bool paused() const;
  std::uint64_t in_flight() const;
  /// Generations blocked in begin() (paused or held), not yet in flight.
  std::uint64_t waiting() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool paused_ = false;
  pause_mode mode_ = pause_mode::abort;
  std::uint64_t in_flight_ = 0;
  std::uint64_t holding_ = 0;      ///< keep mode: generations waiting in step()
  std::uint64_t waiting_ = 0;      ///< generations waiting in begin()
  std::uint64_t abort_epoch_ = 0;  ///< bumped by each abort; a ticket is the epoch it began in
  std::uint64_t current_ = 0;      ///< in flight with a ticket of this epoch (not aborted)
  std::uint64_t holds_ = 0;        ///< abort_and_hold() calls not yet released
  bool closed_ = false;

  void abort_locked();
};

/// begin()/end() as a scope.
class generation_scope {
 public:
  explicit generation_scope(generation_control& c) : c_(c), ticket_(c_.begin()) {}
  ~generation_scope() { c_.end(ticket_); }
  generation_scope(const generation_scope&) = delete;
  generation_scope& operator=(const generation_scope&) = delete;
  generation_status step() { return c_.step(ticket_); }

 private:
  generation_control& c_;
  std::uint64_t ticket_;
};

/// abort_and_hold()/release_hold() as a scope; nothing when `abort` is false.
class abort_hold {
 public:
  abort_hold(generation_control& c, bool abort) : c_(abort ? &c : nullptr) {
    if (c_) c_->abort_and_hold();
  }
  ~abort_hold() {
    if (c_) c_->release_hold();
  }
  abort_hold(const abort_hold&) = delete;
  abort_hold& operator=(const abort_hold&) = delete;

 private:
  generation_control* c_;
};

}  // namespace wsync
