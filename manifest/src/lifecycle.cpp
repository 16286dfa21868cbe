#include "wsync/manifest/lifecycle.hpp"

#include <string>

namespace wsync {

std::string_view update_state_name(update_state s) {
  switch (s) {
    case update_state::announced:
      return "announced";
    case update_state::imported:
      return "imported";
    case update_state::verified:
      return "verified";
    case update_state::installed:
      return "installed";
    case update_state::acknowledged:
      return "acknowledged";
    case update_state::rejected:
      return "rejected";
    case update_state::released:
      return "released";
  }
  return "invalid";
}

std::string_view update_event_name(update_event e) {
  switch (e) {
    case update_event::import_ok:
      return "import";
    case update_event::verify_ok:
      return "verify";
    case update_event::install_ok:
      return "install";
    case update_event::acknowledge:
      return "acknowledge";
    case update_event::reject:
      return "reject";
    case update_event::release:
      return "release";
  }
  return "invalid";
}

namespace {

// The single table of legal moves; everything else is refused with a message saying why.
bool legal(update_state from, update_event e, update_state& to) {
  using s = update_state;
  using ev = update_event;
  switch (from) {
    case s::announced:
      if (e == ev::import_ok) return to = s::imported, true;
      if (e == ev::reject) return to = s::rejected, true;  // import failed: report why
      if (e == ev::release) return to = s::released, true;
      return false;
    case s::imported:
      if (e == ev::verify_ok) return to = s::verified, true;
      if (e == ev::install_ok) return to = s::installed, true;  // verification turned off
      break;
    case s::verified:
      if (e == ev::install_ok) return to = s::installed, true;
      break;
    case s::installed:
      if (e == ev::acknowledge) return to = s::acknowledged, true;
      break;
    case s::acknowledged:
    case s::rejected:
      if (e == ev::release) return to = s::released, true;
      return false;
    case s::released:
      return false;
  }
  // imported, verified, installed: may still be rejected or released.
  if (e == ev::reject) return to = s::rejected, true;
  if (e == ev::release) return to = s::released, true;
  return false;
}

std::string why(update_state from, update_event e) {
  using s = update_state;
  std::string verb(update_event_name(e));
  if (from == s::announced) return "cannot " + verb + " update before import_update succeeds";
  if (from == s::released) return "cannot " + verb + " update after release";
  if (from == s::rejected) return "cannot " + verb + " update after reject";
  if (e == update_event::acknowledge && (from == s::imported || from == s::verified)) {
    return "cannot acknowledge update before install succeeds";
  }
  return "cannot " + verb + " update in state " + std::string(update_state_name(from));
}

}  // namespace

result<update_state> update_transition(update_state from, update_event event,
                                       std::string_view context) {
  update_state to = from;
  if (legal(from, event, to)) return to;
  std::string message = why(from, event);
  if (!context.empty()) message += " (" + std::string(context) + ")";
  return make_error(errc::illegal_transition, std::move(message));
}

}  // namespace wsync
