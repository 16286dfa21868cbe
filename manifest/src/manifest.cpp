#include "wsync/manifest/manifest.hpp"

#include <sys/random.h>

#include <algorithm>
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

// An id as errors show it: a valid one as it is; one that is not (errors about it come before
// or instead of its check) cut to 64 bytes, bytes outside the id alphabet as \xNN, and its
// length said, so a peer's 50 MB or escape-laden id does not travel into every report.
std::string update_id_shown(const update_id& id) {
  auto plain = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.' || c == ':' || c == '/' || c == '@';
  };
  if (id.empty()) return "<none>";
  if (id.size() <= 128 && std::all_of(id.begin(), id.end(), plain)) return id;
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < id.size() && i < 64; ++i) {
    const auto c = static_cast<unsigned char>(id[i]);
    if (plain(id[i])) {
      out += id[i];
    } else {
      out += {'\\', 'x', hex[c >> 4], hex[c & 15]};
    }
  }
  return out + (id.size() > 64 ? "...(" + std::to_string(id.size()) + " bytes)" : "");
}

std::string update_context(const update_id& id, std::int32_t rank) {
  return "update_id=" + update_id_shown(id) + " rank=" + std::to_string(rank);
}

std::string update_context(const weight_update_manifest& m) {
  return update_context(m.update_id, m.source_rank);
}

std::string update_key(const std::string& model_id, std::uint64_t weight_version) {
  return model_id + "@" + std::to_string(weight_version);
}

}  // namespace wsync
