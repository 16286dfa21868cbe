#pragma once

#include "wsync/transports/registry.hpp"

namespace wsync {

/// Registry entry of "local-clone": publisher and consumer in one process; the consumer gets
/// its own copy of every segment, so the publisher can reuse its memory as soon as it wants.
transport_entry local_clone_entry();

}  // namespace wsync
