#pragma once
// What other modules may use of the file-mmap transport: reading its state file, for a consumer
// that follows a directory without a coordinator (the pull model).

#include <optional>
#include <string>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

/// The update that `dir`'s CURRENT state file names: the manifest of the last version a
/// file-mmap publisher made durable there. Empty when no version was published yet;
/// invalid_manifest when the file is not a file-mmap state file, io_error when it cannot be read.
result<std::optional<weight_update_manifest>> file_mmap_current(const std::string& dir);

}  // namespace wsync
