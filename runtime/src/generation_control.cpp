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

namespace {
constexpr std::uint64_t refused = ~std::uint64_t{0};  // a ticket no epoch reaches
}  // namespace

// The ticket is the abort epoch the generation began in: a later abort caught it.
std::uint64_t generation_control::begin() {
  std::unique_lock lock(mutex_);
  const std::uint64_t entered = abort_epoch_;
  ++waiting_;
  cv_.wait(lock, [&] { return (!paused_ && holds_ == 0) || abort_epoch_ != entered || closed_; });
  --waiting_;
  ++in_flight_;
  if (closed_) return refused;
  if (entered == abort_epoch_) ++current_;
  return entered;
}

generation_status generation_control::step(std::uint64_t ticket) {
  std::unique_lock lock(mutex_);
  if (ticket != abort_epoch_) return generation_status::aborted;
  if (paused_ && mode_ == pause_mode::keep) {
    ++holding_;
    cv_.notify_all();  // pause() waits for every in-flight generation to hold or end
    cv_.wait(lock, [&] { return !paused_ || ticket != abort_epoch_; });
    --holding_;
    if (ticket != abort_epoch_) return generation_status::aborted;
  }
  return generation_status::running;
}

void generation_control::end(std::uint64_t ticket) {
  std::lock_guard lock(mutex_);
  --in_flight_;
  if (ticket == abort_epoch_) --current_;
  cv_.notify_all();
}

// Every ticket in hand goes stale: those generations end at their next step.
void generation_control::abort_locked() {
  ++abort_epoch_;
  current_ = 0;
  cv_.notify_all();
}

bool generation_control::pause(pause_mode mode) {
  std::unique_lock lock(mutex_);
  if (!paused_) {
    paused_ = true;
    mode_ = mode;
    if (mode == pause_mode::abort) abort_locked();
  }
  // A second pause (a retry, another caller) changes nothing, but it too returns only once the
  // pause in force keeps its promise: its caller may update next.
  cv_.wait(lock, [&] {
    if (!paused_) return true;
    return mode_ == pause_mode::keep ? holding_ == in_flight_ : in_flight_ == 0;
  });
  return paused_;
}

void generation_control::resume() {
  std::lock_guard lock(mutex_);
  paused_ = false;
  cv_.notify_all();
}

void generation_control::abort_and_hold() {
  std::unique_lock lock(mutex_);
  ++holds_;
  abort_locked();
  // While held nothing begins afresh, so what is left in flight is what the abort caught (and
  // those woken from begin() with a stale ticket, which end at their first step).
  cv_.wait(lock, [&] { return in_flight_ == current_; });
}

void generation_control::close() {
  std::unique_lock lock(mutex_);
  closed_ = true;
  abort_locked();
  cv_.wait(lock, [&] { return in_flight_ == 0; });
}

void generation_control::release_hold() {
  std::lock_guard lock(mutex_);
  if (holds_ > 0) --holds_;
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

std::uint64_t generation_control::waiting() const {
  std::lock_guard lock(mutex_);
  return waiting_;
}

}  // namespace wsync
