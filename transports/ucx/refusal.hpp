#pragma once
// The code of a source's refusal of a fetch, as the wire carries it (pure: no UCX here).

#include <cstdint>
#include <initializer_list>

#include "wsync/manifest/result.hpp"

namespace wsync::ucx_detail {

/// Only the codes a source sends (node_serve.cpp's refusals) are taken as such. Any other
/// number, or a code that means "not an error" (in_progress), from a peer that is broken or
/// hostile, is an io_error: it must not pass for a retry or a success.
inline errc refusal_code(std::uint32_t wire) {
  for (errc c : {errc::unknown_update, errc::invalid_argument, errc::checksum_mismatch,
                 errc::try_again, errc::timeout}) {
    if (wire == static_cast<std::uint32_t>(c)) return c;
  }
  return errc::io_error;
}

}  // namespace wsync::ucx_detail
