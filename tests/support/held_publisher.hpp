#pragma once
// A shared-memory publisher whose updates stay held until the test releases them (as a
// coordinator or a trainer script would), for tests that feed consumers in the same process.

#include <memory>
#include <string>

#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync::test {

/// nullptr when shared memory is not available here.
inline std::unique_ptr<weight_publisher> held_shm_publisher(const std::string& model_id,
                                                            int slots = 4) {
  auto t = make_transport("shared-memory", {{"slots", std::to_string(slots)}});
  if (!t) return nullptr;
  auto pt = (*t)->make_publisher();
  if (!pt) return nullptr;
  publisher_config cfg;
  cfg.model_id = model_id;
  cfg.release_when_answered = false;
  return std::make_unique<weight_publisher>(std::move(*pt), "shared-memory", cfg);
}

/// Gives back every update `p` still holds.
inline void release_held(weight_publisher& p) {
  for (const auto& id : p.held_updates()) (void)p.release(id);
}

}  // namespace wsync::test
