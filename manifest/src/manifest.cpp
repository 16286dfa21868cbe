#include "wsync/manifest/manifest.hpp"

#include <sys/random.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <random>
#include <stdexcept>

namespace wsync {

update_id update_id_generate() {
  // 128 bits from the kernel's CSPRNG make ids unique across processes, hosts and restarts;
  // the time prefix keeps them sortable by creation in logs.
  unsigned char bytes[16];
  std::size_t got = 0;
  while (got < sizeof bytes) {
    ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      // getrandom only fails on ancient kernels; fall back to random_device, never to a counter.
      std::random_device rd;
      for (auto& b : bytes) b = static_cast<unsigned char>(rd());
      break;
    }
    got += static_cast<std::size_t>(n);
  }
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::system_clock::now().time_since_epoch())
                .count();
  char buf[64];
  int len = std::snprintf(buf, sizeof buf, "u-%011llx-", static_cast<unsigned long long>(ms));
  std::string id(buf, static_cast<std::size_t>(len));
  static constexpr char hex[] = "0123456789abcdef";
  for (unsigned char b : bytes) {
    id.push_back(hex[b >> 4]);
    id.push_back(hex[b & 15]);
  }
  return id;
}

std::string update_context(const update_id& id, std::int32_t rank) {
  return "update_id=" + (id.empty() ? std::string("<none>") : id) + " rank=" + std::to_string(rank);
}

std::string update_context(const weight_update_manifest& m) {
  return update_context(m.update_id, m.source_rank);
}

}  // namespace wsync
