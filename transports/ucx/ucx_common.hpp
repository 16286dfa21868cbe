#pragma once
// What every part of the ucx transport shares: its settings, UCX status -> error mapping with the
// one checking macro, and small helpers. Internal to transports/ucx/; includes UCX's headers.

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/manifest/result.hpp"
#include "wsync/transports/ucx.hpp"

namespace wsync::ucx_detail {

using clock_type = std::chrono::steady_clock;

inline constexpr std::uint64_t page = 4096;
inline constexpr std::uint64_t slot_quantum = std::uint64_t{2} << 20;

constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

inline std::uint64_t chunks_of(std::uint64_t nbytes, std::uint64_t chunk) {
  return (nbytes + chunk - 1) / chunk;
}

// --- settings: the option table of "ucx" -------------------------------------------------------

struct ucx_settings {
  std::string tls;          // UCX_TLS of this transport's context; empty: UCX's own choice
  std::string devices;      // UCX_NET_DEVICES
  std::string rndv_thresh;  // UCX_RNDV_THRESH
  std::string op = "auto";  // auto | tag | get: how consumers pull from a publisher
  std::uint64_t chunk_bytes = ucx_default_chunk_bytes;
  std::uint64_t window = ucx_default_window;  // chunks in flight per lane (one per stripe)
  std::uint64_t slots = 2;                    // ring size, on each side
  std::uint64_t timeout_ms = 60000;
};

// --- errors ------------------------------------------------------------------------------------

errc status_code(ucs_status_t st);

// `call` is the call's text as the macro saw it; messages name only the function.
error status_error(std::string_view call, ucs_status_t st, const std::string& context);

// One checking macro for UCX calls: the failing call, UCX's status text and our context.
#define WSYNC_UCX_CHECK(call, context)                                         \
  do {                                                                         \
    ucs_status_t wsync_status_ = (call);                                       \
    if (wsync_status_ != UCS_OK) {                                             \
      return ::wsync::ucx_detail::status_error(#call, wsync_status_, context); \
    }                                                                          \
  } while (0)

// UCS_PTR_IS_ERR / UCS_PTR_STATUS without their C casts.
inline bool ptr_is_error(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) >=
         static_cast<std::uintptr_t>(static_cast<std::intptr_t>(UCS_ERR_LAST));
}
inline ucs_status_t ptr_status(const void* p) {
  return static_cast<ucs_status_t>(reinterpret_cast<std::intptr_t>(p));
}

// --- hex: how worker addresses and packed rkeys travel in handles and fetches -----------------

std::string hex_encode(const void* data, std::size_t n);
std::optional<std::vector<unsigned char>> hex_decode(const std::string& text);

}  // namespace wsync::ucx_detail
