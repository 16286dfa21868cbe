#pragma once

#include "wsync/transports/registry.hpp"
#include "wsync/transports/ucx.hpp"

namespace wsync {

/// Registry entry of "ucx": publisher and consumers on any nodes UCX can connect. Segments live
/// in a ring of pre-faulted slots registered once with ucp_mem_map; consumers pull them in
/// chunks, verify chunks before relaying them, and serve what they imported to other consumers.
transport_entry ucx_entry();

}  // namespace wsync
