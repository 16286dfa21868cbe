#pragma once
// How a wsync process stops: SIGINT and SIGTERM are blocked in every thread and taken by the
// main loop (sigwait), so a rank shuts down in order instead of dying mid-update. Free of CAF.

#include <signal.h>

#include <chrono>
#include <ctime>

namespace wsync {

/// Blocks SIGINT and SIGTERM in this thread (and every thread started after), so that
/// wait_for_signal() / stop_requested() see them instead of the default action.
inline void block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

/// Waits until SIGINT or SIGTERM arrives.
inline void wait_for_signal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
}

/// True once SIGINT or SIGTERM is pending (consumed).
inline bool stop_requested() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  timespec zero{0, 0};
  return sigtimedwait(&set, nullptr, &zero) > 0;
}

/// Waits up to `d` for SIGINT or SIGTERM (consumed): true when one came. A pacing sleep that a
/// stop request cuts short.
inline bool stop_requested_within(std::chrono::milliseconds d) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  timespec t{static_cast<time_t>(d.count() / 1000), static_cast<long>(d.count() % 1000) * 1000000};
  return sigtimedwait(&set, nullptr, &t) > 0;
}

}  // namespace wsync
