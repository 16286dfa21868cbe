#pragma once
// Runs one work loop on several threads: the caller's and up to `threads - 1` helpers.
#include <system_error>
#include <thread>
#include <vector>

namespace wsync::parallel {

/// Runs `work` on the calling thread and on up to `threads - 1` helper threads, and returns
/// once every one of them returned. `work` must share its items out itself (an atomic counter):
/// a helper the system refuses to start (EAGAIN at a process or cgroup thread limit, likely in a
/// process holding a thousand ranks) is not started, and the others do its share, rather than
/// the vector of joinable threads ending the process.
template <class Work>
void run(unsigned threads, Work&& work) {
  std::vector<std::thread> helpers;
  // Before any starts: growing the vector later could throw with joinable threads in it.
  helpers.reserve(threads);
  for (unsigned k = 1; k < threads; ++k) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;
    }
  }
  work();
  for (auto& h : helpers) h.join();
}

}  // namespace wsync::parallel
