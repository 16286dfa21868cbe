#pragma once
// Pause and resume of generation, as the HTTP /pause and /resume drive them (docs/http.md). A
// generation brackets itself with begin()/end() and calls step() before each step it runs:
//  - abort: in-flight generations end at their next step with generation_status::aborted, and
//    pause() returns once none is left;
//  - wait:  in-flight generations run to completion, and pause() returns once they drained;
//  - keep:  in-flight generations hold at their next step and go on after resume(); pause()
//    returns once each of them is holding or done.
// In every mode a generation that begins while paused waits for resume().

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
  /// Blocks while paused; then counts the generation as in flight. Returns its ticket.
  std::uint64_t begin();
  /// Before each step: aborted if a pause in abort mode caught this generation (then stop and
  /// call end()); in keep mode, holds until resume().
  generation_status step(std::uint64_t ticket);
  void end();

  /// Pauses and returns when the mode's promise holds (see above). Pausing again while paused
  /// changes nothing and returns at once.
  void pause(pause_mode mode);
  void resume();

  bool paused() const;
  std::uint64_t in_flight() const;

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool paused_ = false;
  pause_mode mode_ = pause_mode::abort;
  std::uint64_t in_flight_ = 0;
  std::uint64_t holding_ = 0;      ///< keep mode: generations waiting in step()
  std::uint64_t abort_epoch_ = 0;  ///< bumped by each abort pause
};

/// begin()/end() as a scope.
class generation_scope {
 public:
  explicit generation_scope(generation_control& c) : c_(c), ticket_(c_.begin()) {}
  ~generation_scope() { c_.end(); }
  generation_scope(const generation_scope&) = delete;
  generation_scope& operator=(const generation_scope&) = delete;
  generation_status step() { return c_.step(ticket_); }

 private:
  generation_control& c_;
  std::uint64_t ticket_;
};

}  // namespace wsync
