// `wsync status`: ask the coordinator for its per-rank table.

#include <iostream>
#include <memory>

#include "common.hpp"
#include "subcommand.hpp"
#include "wsync/cluster/status.hpp"

namespace wsync::cli {
namespace {

struct status_state {
  std::string coordinator;  // host:port, parsed into `ep` after the checks
  endpoint ep;
  bool json = false;
};

int status_query(status_state& s) {
  if (!need_token(s.ep.token)) return 2;
  if (!coordinator_from(s.coordinator, s.ep)) return 2;
  std::string err;
  auto text = coordinator_status(s.ep, err);
  if (text.empty()) {
    std::cerr << "wsync status: " << err << "\n";
    return 1;
  }
  if (s.json) {
    std::cout << text << std::endl;
    return 0;
  }
  return status_print(text, std::cout);
}

}  // namespace

subcommand add_status(CLI::App& app) {
  auto state = std::make_shared<status_state>();
  auto* status = app.add_subcommand("status", "Print the coordinator's per-rank table.");
  status->add_option("--coordinator", state->coordinator, "coordinator host:port")
      ->envname("WSYNC_COORDINATOR")
      ->required();
  add_token(status, state->ep.token);
  status->add_flag("--json", state->json,
                   "print the status object (JSON: every rank's state and version, and the "
                   "recent updates; see docs/cluster.md)");
  add_tls(status, state->ep.tls);
  return {status, [state] {
            return status_query(*state);
          }};
}

}  // namespace wsync::cli
