// A client of the coordinator: asks for its status table and returns it as text.

#include <caf/all.hpp>

#include "protocol.hpp"
#include "runtime_support.hpp"
#include "wsync/actors/node.hpp"

namespace wsync {

using namespace proto;

std::string coordinator_status(const endpoint& coordinator, std::string& error) {
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
               [&](caf::error& err) { error = sys.get().render(err); });
  return out;
}

}  // namespace wsync
