// Built with or without UCX: what other modules may ask of the transport. Whether it is
// compiled in: transport_known("ucx").
#include <algorithm>
#include <array>

#include "wsync/transports/ucx.hpp"

namespace wsync {

bool ucx_tls_shared_memory_only(std::string_view tls) {
  static constexpr std::array<std::string_view, 8> shared_memory = {
      "posix", "sysv", "cma", "sm", "shm", "knem", "xpmem", "self"};
  if (tls.empty()) return false;
  while (true) {
    auto comma = tls.find(',');
    if (std::find(shared_memory.begin(), shared_memory.end(), tls.substr(0, comma)) ==
        shared_memory.end()) {
      return false;
    }
    if (comma == std::string_view::npos) return true;
    tls.remove_prefix(comma + 1);
  }
}

bool ucx_tls_may_use_tcp(std::string_view tls) {
  bool excluded = !tls.empty() && tls.front() == '^';
  if (excluded) tls.remove_prefix(1);
  if (tls.empty()) return true;
  bool named = false;
  while (true) {
    auto comma = tls.find(',');
    auto name = tls.substr(0, std::min(comma, tls.find(':')));  // "tcp:aux" is tcp too
    if (name == "tcp" || (name == "all" && !excluded)) named = true;
    if (comma == std::string_view::npos) break;
    tls.remove_prefix(comma + 1);
  }
  return excluded ? !named : named;
}

std::string ucx_auto_op(std::string_view tls) {
  return ucx_tls_shared_memory_only(tls) ? "get" : "tag";
}

}  // namespace wsync
