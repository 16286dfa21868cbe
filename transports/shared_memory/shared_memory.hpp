#pragma once

#include "wsync/transports/registry.hpp"
#include "wsync/transports/shared_memory.hpp"

namespace wsync {

/// Registry entry of "shared-memory": one node, many processes. The publisher keeps a ring of
/// pre-faulted POSIX shared-memory slots (mode 0600, unguessable names); consumers map each
/// slot once, read-only, and import zero-copy.
transport_entry shared_memory_entry();

}  // namespace wsync
