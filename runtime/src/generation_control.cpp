#include "wsync/runtime/generation_control.hpp"

namespace wsync {

std::optional<pause_mode> pause_mode_parse(std::string_view text) {
  if (text == "abort") return pause_mode::abort;
  if (text == "wait") return pause_mode::wait;
  if (text == "keep") return pause_mode::keep;
  return std::nullopt;
}

const char* pause_mode_name(pause_mode mode) {
  switch (mode) {
    case pause_mode::abort:
      return "abort";
    case pause_mode::wait:
      return "wait";
    case pause_mode::keep:
      return "keep";
  }
  return "?";
}

// The ticket is the abort epoch the generation began in: a later abort pause caught it.
std::uint64_t generation_control::begin() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !paused_; });
  ++in_flight_;
  return abort_epoch_;
}

generation_status generation_control::step(std::uint64_t ticket) {
  std::unique_lock lock(mutex_);
  if (ticket != abort_epoch_) return generation_status::aborted;
  if (paused_ && mode_ == pause_mode::keep) {
    ++holding_;
    cv_.notify_all();  // pause() waits for every in-flight generation to hold or end
    cv_.wait(lock, [&] { return !paused_; });
    --holding_;
  }
  return generation_status::running;
}

void generation_control::end() {
  std::lock_guard lock(mutex_);
  --in_flight_;
  cv_.notify_all();
}

void generation_control::pause(pause_mode mode) {
  std::unique_lock lock(mutex_);
  if (paused_) return;
  paused_ = true;
  mode_ = mode;
  if (mode == pause_mode::abort) ++abort_epoch_;
  if (mode == pause_mode::keep) {
    cv_.wait(lock, [&] { return holding_ == in_flight_ || !paused_; });
  } else {
    cv_.wait(lock, [&] { return in_flight_ == 0 || !paused_; });
  }
}

void generation_control::resume() {
  std::lock_guard lock(mutex_);
  paused_ = false;
  cv_.notify_all();
}

bool generation_control::paused() const {
  std::lock_guard lock(mutex_);
  return paused_;
}

std::uint64_t generation_control::in_flight() const {
  std::lock_guard lock(mutex_);
  return in_flight_;
}

}  // namespace wsync
