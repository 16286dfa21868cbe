#pragma once

#include "wsync/transports/file_mmap.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {

/// Registry entry of "file-mmap": a directory both sides can reach (local disk, tmpfs, NFS). The
/// publisher double-buffers pre-sized files and names the durable version in DIR/CURRENT;
/// consumers map the files read-only and hold a lease file while they use a buffer.
transport_entry file_mmap_entry();

}  // namespace wsync
