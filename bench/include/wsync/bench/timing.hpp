#pragma once
// What every benchmark measures with: a monotonic clock in seconds and the median of samples.

#include <algorithm>
#include <chrono>
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

}  // namespace wsync
