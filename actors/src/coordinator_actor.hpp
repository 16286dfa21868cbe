#pragma once
// The coordinator actor, for coordinator_run and for tests that drive it in one process.
// Heavy (CAF): include only from actor code.

#include <string>

#include "protocol.hpp"
#include "wsync/actors/coordinator_book.hpp"
#include "wsync/actors/node.hpp"

namespace wsync {

/// Spawns a guarded coordinator (guard.hpp) that admits ranks holding `token` and routes each
/// update with `router` (empty: every consumer from the publishers).
proto::coordinator_actor coordinator_spawn(caf::actor_system& sys, std::string token,
                                           book_config config, update_router router = {});

}  // namespace wsync
