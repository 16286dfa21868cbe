// A client of the coordinator: asks for its status table and returns it as text.

#include <caf/all.hpp>

#include "protocol.hpp"
#include "runtime_support.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {

using namespace proto;

namespace {

// One try on a connection of its own; `lost`: the request went out and no answer came back.
std::string status_once(const endpoint& coordinator, std::string& error, bool& lost) {
  cluster_system sys(std::chrono::milliseconds(200), coordinator.tls);
  auto c = sys.connect(coordinator);
  if (!c) {
    error = "cannot reach the coordinator at " + coordinator.host + ":" +
            std::to_string(coordinator.port) + ": " + sys.get().render(c.error());
    return {};
  }
  caf::scoped_actor self{sys.get()};
  std::string out;
  self->request(*c, std::chrono::seconds(5), status_atom::value, coordinator.token)
      .receive([&](const std::string& s) { out = s; },
               [&](caf::error& err) {
                 error = sys.get().render(err);
                 lost = err == caf::sec::request_timeout;
               });
  return out;
}

}  // namespace

std::string coordinator_status(const endpoint& coordinator, std::string& error) {
  // An answer lost to CAF 0.17's late cleanup of a closed connection (cluster_system turns the
  // cause off; about 1 in 100 with a dozen status calls at once here before) stays lost on that
  // connection: the retry goes over a new one.
  for (int attempt = 1;; ++attempt) {
    bool lost = false;
    error.clear();
    auto out = status_once(coordinator, error, lost);
    if (!out.empty() || !lost) return out;
    if (attempt == 3) {
      error = "no answer after 3 tries of 5 s, each on a new connection: " + error;
      return out;
    }
    log_warn("status: no answer from the coordinator at " + coordinator.host + ":" +
             std::to_string(coordinator.port) + " within 5 s (" + error +
             "); asking again on a new connection");
  }
}

}  // namespace wsync
