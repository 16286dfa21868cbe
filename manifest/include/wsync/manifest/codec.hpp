#pragma once
// JSON form of a manifest: every field, exact round trip. 64-bit checksums travel as 16-digit
// hex strings so that JSON readers with double-precision numbers cannot corrupt them.

#include <optional>
#include <string>
#include <string_view>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

/// Serialises a manifest to compact JSON text.
std::string manifest_to_json(const weight_update_manifest& m);

/// Parses JSON text; structural problems (missing field, wrong type) are errc::invalid_manifest
/// naming the field. Does not run manifest_validate().
result<weight_update_manifest> manifest_from_json(std::string_view text);

namespace detail {
/// manifest_from_json's general path alone (the parsed document, read field by field), for the
/// tests that hold its fast path to the same answers.
result<weight_update_manifest> manifest_from_json_document(std::string_view text);
/// manifest_from_json's first path alone: its own lexer over plain JSON (integers, strings of
/// printable ASCII without escapes); nullopt where it leaves the text to the other paths.
std::optional<weight_update_manifest> manifest_from_plain_json(std::string_view text);
}  // namespace detail

}  // namespace wsync
