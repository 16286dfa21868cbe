#pragma once
// What every benchmark measures with: a monotonic clock in seconds, the median of samples, and
// the host name every row's env carries.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace wsync {

/// Seconds on the steady clock (comparable within one boot, across processes).
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The median of `v`; 0 for no samples.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  auto n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// This machine's name, for a row's `env.host`.
inline std::string host_name() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? host : "unknown";
}

}  // namespace wsync
