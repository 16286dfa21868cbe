#pragma once
// manifest_from_json for a manifest nlohmann has parsed already (one inside an HTTP body): read
// as it stands rather than written out and parsed again, with the same answers and errors.
// Include only in .cpp files (nlohmann is heavy).

#include <nlohmann/json.hpp>

#include "wsync/manifest/codec.hpp"

namespace wsync {

result<weight_update_manifest> manifest_from_json_value(const nlohmann::json& j);

}  // namespace wsync
