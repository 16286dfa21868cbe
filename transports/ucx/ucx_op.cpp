// Built with or without UCX: what other modules may ask of the transport.
#include <algorithm>
#include <array>

#include "wsync/transports/ucx.hpp"

namespace wsync {

std::string ucx_auto_op(std::string_view tls) {
  static constexpr std::array<std::string_view, 8> shared_memory = {
      "posix", "sysv", "cma", "sm", "shm", "knem", "xpmem", "self"};
  if (tls.empty()) return "tag";
  while (true) {
    auto comma = tls.find(',');
    if (std::find(shared_memory.begin(), shared_memory.end(), tls.substr(0, comma)) ==
        shared_memory.end()) {
      return "tag";
    }
    if (comma == std::string_view::npos) return "get";
    tls.remove_prefix(comma + 1);
  }
}

bool ucx_compiled_in() {
  return WSYNC_HAVE_UCX;
}

}  // namespace wsync
