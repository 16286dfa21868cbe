#pragma once
// What other modules may ask of the UCX transport without including UCX headers.

#include <string>
#include <string_view>

namespace wsync {

/// The UCX operation a consumer uses to pull chunks straight from a publisher when its option
/// `op` is "auto", given the `tls` option (UCX_TLS): "get" (RMA) when every listed transport is
/// a shared-memory one, where RMA measured fastest here; "tag" (request + tag-matched
/// rendezvous reply) otherwise, since RMA over TCP is emulated and measured 3x slower. Pulls
/// from a relay always use "tag".
std::string ucx_auto_op(std::string_view tls);

/// The options' defaults: bytes per pulled chunk, and chunks in flight per lane.
inline constexpr unsigned long long ucx_default_chunk_bytes = 4ull << 20;
inline constexpr unsigned ucx_default_window = 8;

/// True when `tls` (a UCX_TLS list) names only shared-memory transports (posix, sysv, cma, sm,
/// shm, knem, xpmem, self); empty means UCX's own choice, which may include the network.
bool ucx_tls_shared_memory_only(std::string_view tls);

/// True when UCX may pick its TCP transport under `tls` (a UCX_TLS list): empty (UCX's own
/// choice), "all", a list naming "tcp", or a "^" list that does not name it.
bool ucx_tls_may_use_tcp(std::string_view tls);

}  // namespace wsync
