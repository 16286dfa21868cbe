#include "wsync/manifest/manifest.hpp"

#include <sys/random.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <random>
#include <stdexcept>

namespace wsync {

std::string random_hex(std::size_t bytes) {
  std::string raw(bytes, '\0');
  std::size_t got = 0;
  while (got < bytes) {
    ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return {};
    got += static_cast<std::size_t>(n);
  }
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (unsigned char b : raw) out += {hex[b >> 4], hex[b & 15]};
  return out;
}

update_id update_id_generate() {
  // 128 bits from the kernel's CSPRNG make ids unique across processes, hosts and restarts;
  // the time prefix keeps them sortable by creation in logs.
  std::string secret = random_hex(16);
  if (secret.empty()) {
    // getrandom only fails on ancient kernels; fall back to random_device, never to a counter.
    std::random_device rd;
    static constexpr char hex[] = "0123456789abcdef";
    for (int i = 0; i < 32; ++i) secret.push_back(hex[rd() & 15]);
  }
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                std::chrono::system_clock::now().time_since_epoch())
                .count();
  char buf[64];
  int len = std::snprintf(buf, sizeof buf, "u-%011llx-", static_cast<unsigned long long>(ms));
  return std::string(buf, static_cast<std::size_t>(len)) + secret;
}

std::string update_context(const update_id& id, std::int32_t rank) {
  return "update_id=" + (id.empty() ? std::string("<none>") : id) + " rank=" + std::to_string(rank);
}

std::string update_context(const weight_update_manifest& m) {
  return update_context(m.update_id, m.source_rank);
}

std::string update_key(const std::string& model_id, std::uint64_t weight_version) {
  return model_id + "@" + std::to_string(weight_version);
}

}  // namespace wsync
