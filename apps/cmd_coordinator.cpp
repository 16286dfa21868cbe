// `wsync coordinator`: the rank registry, with the fan-out planner as its router.

#include <memory>

#include "common.hpp"
#include "subcommand.hpp"
#include "wsync/cluster/fanout_router.hpp"

namespace wsync::cli {
namespace {

struct coordinator_state {
  coordinator_options options;
  // The router is a function built after parsing; its flags start from the planner's defaults.
  std::string plan = plan_shape_name(plan_request{}.shape);
  unsigned degree = plan_request{}.degree;
};

int coordinator_start(coordinator_state& s) {
  if (!need_token(s.options.listen.token)) return 2;
  s.options.router = fanout_router(*plan_shape_parse(s.plan), s.degree);
  return coordinator_run(s.options);
}

}  // namespace

subcommand add_coordinator(CLI::App& app) {
  auto state = std::make_shared<coordinator_state>();
  coordinator_options& opt = state->options;
  auto* coord = app.add_subcommand(
      "coordinator", "Run the coordinator: rank registry, versions, per-rank ack tracking.");
  coord->add_option("--host", opt.listen.host, "address to listen on")->capture_default_str();
  coord->add_option("--port", opt.listen.port, "port to listen on (0: pick a free one)")
      ->capture_default_str();
  coord->add_option("--port-file", opt.port_file, "write the port here once listening");
  add_token(coord, opt.listen.token);
  add_milliseconds(coord, "--update-deadline-ms", opt.update_deadline,
                   "an update whose shards do not all arrive this long after the first is "
                   "aborted; one that is not answered this long after it went out fails its "
                   "unanswered ranks",
                   100, 3600000);
  add_milliseconds(coord, "--rejoin-grace-ms", opt.rejoin_grace,
                   "after a start: how long updates of a coordinator before this one stay at "
                   "their publishers although no rank that rejoined holds them (ranks reconnect "
                   "every 5 s at most)",
                   0, 3600000);
  coord
      ->add_option("--history", opt.history_per_model,
                   "finished updates kept per model for `wsync status` (older ones are dropped, "
                   "so memory stays flat however long the job runs)")
      ->check(CLI::Range(1u, 100000u))
      ->capture_default_str();
  coord
      ->add_option("--plan", state->plan,
                   "how updates cross nodes when the consumers' transport relays (ucx): tree "
                   "(striped), chain or star; one leader per node either way")
      ->check(CLI::IsMember({"tree", "chain", "star"}))
      ->capture_default_str();
  coord->add_option("--degree", state->degree, "children per leader in a tree plan")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  add_tls(coord, opt.listen.tls);
  coord->add_flag("--insecure", opt.insecure,
                  "listen on a non-loopback --host without TLS anyway (refused otherwise; warned "
                  "at every start)");
  return {coord, [state] {
            return coordinator_start(*state);
          }};
}

}  // namespace wsync::cli
