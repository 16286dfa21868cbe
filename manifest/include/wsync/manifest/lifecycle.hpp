#pragma once
// The update lifecycle as one state machine, shared by publisher and consumer sides:
// publish -> import -> [verify] -> install -> acknowledge | reject -> release.

#include <string>
#include <string_view>

#include "wsync/manifest/result.hpp"

namespace wsync {

/// Consumer-side state of one update.
enum class update_state {
  announced,     ///< manifest known, nothing imported
  imported,      ///< import_update succeeded; bytes reachable
  verified,      ///< every checksum matched
  installed,     ///< the install adapter took the update
  acknowledged,  ///< reported success
  rejected,      ///< reported failure with a reason
  released,      ///< buffers given back; terminal
};

/// Lifecycle events.
enum class update_event { import_ok, verify_ok, install_ok, acknowledge, reject, release };

std::string_view update_state_name(update_state s);
std::string_view update_event_name(update_event e);

/// Returns the next state, or errc::illegal_transition whose message starts with the exact text
/// of docs/protocol.md (e.g. "cannot acknowledge update before import_update succeeds") followed by
/// `context` (which names the update id and rank).
result<update_state> update_transition(update_state from, update_event event,
                                       std::string_view context);

}  // namespace wsync
