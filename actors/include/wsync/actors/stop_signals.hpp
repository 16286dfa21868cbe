#pragma once
// How a wsync process stops: SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session) are
// blocked in every thread and taken by the main loop (sigwait), so a rank shuts down in order
// (its /dev/shm segments removed) instead of dying mid-update. Free of CAF.

#include <signal.h>

#include <chrono>
#include <ctime>

namespace wsync {

/// The signals that ask a wsync process to stop in order.
inline sigset_t stop_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  return set;
}

/// Blocks the stop signals in this thread (and every thread started after), so that
/// wait_for_signal() / stop_requested() see them instead of the default action.
inline void block_stop_signals() {
  const sigset_t set = stop_signal_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

/// Waits until a stop signal arrives.
inline void wait_for_signal() {
  const sigset_t set = stop_signal_set();
  int sig = 0;
  sigwait(&set, &sig);
}

/// True once a stop signal is pending (consumed).
inline bool stop_requested() {
  const sigset_t set = stop_signal_set();
  timespec zero{0, 0};
  return sigtimedwait(&set, nullptr, &zero) > 0;
}

/// Waits up to `d` for a stop signal (consumed): true when one came. A pacing sleep that a stop
/// request cuts short.
inline bool stop_requested_within(std::chrono::milliseconds d) {
  const sigset_t set = stop_signal_set();
  timespec t{static_cast<time_t>(d.count() / 1000), static_cast<long>(d.count() % 1000) * 1000000};
  return sigtimedwait(&set, nullptr, &t) > 0;
}

}  // namespace wsync
