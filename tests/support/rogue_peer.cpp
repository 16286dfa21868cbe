// A test tool: a peer that reaches the coordinator's port without the cluster token and tries
// everything CAF lets it send — kill and shutdown exits, an asynchronous error, stream and
// timeout messages, a forged down message, publishes, reports, a status request, a join with
// a wrong token. Exits 0 when the coordinator refused all of it and still answers afterwards;
// otherwise prints what got through and exits 1. Used by tests/integration/cluster_faults.sh.

#include <chrono>
#include <iostream>
#include <thread>

#include "protocol.hpp"

using namespace wsync::proto;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: wsync_rogue_peer HOST PORT\n";
    return 2;
  }
  caf::actor_system_config cfg;
  cfg.add_message_types<caf::id_block::wsync>();
  cfg.load<caf::io::middleman>();
  cfg.set("logger.console", caf::atom("none"));
  caf::actor_system sys{cfg};
  auto port = static_cast<std::uint16_t>(std::stoi(argv[2]));
  auto coordinator = sys.middleman().remote_actor<coordinator_actor>(argv[1], port);
  if (!coordinator) {
    std::cerr << "rogue: cannot reach the coordinator: " << sys.render(coordinator.error()) << "\n";
    return 2;
  }
  auto raw = caf::actor_cast<caf::actor>(*coordinator);
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::cout << (ok ? "refused: " : "GOT THROUGH: ") << what << "\n";
    if (!ok) ++failures;
  };

  // Messages that would stop or confuse an unguarded actor.
  caf::anon_send_exit(raw, caf::exit_reason::kill);
  caf::anon_send_exit(raw, caf::exit_reason::user_shutdown);
  caf::anon_send(raw, caf::make_error(caf::sec::runtime_error));
  caf::anon_send(raw, caf::down_msg{raw.address(), caf::exit_reason::kill});
  caf::anon_send(raw, caf::timeout_msg{caf::atom("stream"), 1});
  caf::anon_send(raw, report_atom::value,
                 rank_report{"guess", "m@1", 0, "acknowledged", "", 1, 0, ""});

  caf::scoped_actor self{sys};
  auto ask = [&](auto... xs) {
    std::string token = "unset", text;
    self->request(*coordinator, std::chrono::seconds(5), xs...)
        .receive([&](const std::string& t, const std::string& s) { token = t, text = s; },
                 [&](caf::error& err) { text = "no answer: " + sys.render(err); });
    return std::make_pair(token, text);
  };
  auto [jt, jr] = ask(join_atom::value, hello_make("guess", 7, "consumer", "rogue", "m"));
  expect(jt.empty() && jr.find("token") != std::string::npos,
         "join with a wrong token (" + jr + ")");
  auto [pt, pr] = ask(publish_atom::value, std::string("guess"), std::string("{}"));
  expect(pt.empty() && pr.find("refused") != std::string::npos,
         "publish without joining (" + pr + ")");

  // Give the coordinator time to have handled everything, then check it still answers.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::string status;
  self->request(*coordinator, std::chrono::seconds(5), status_atom::value, std::string("guess"))
      .receive([&](const std::string& s) { status = s; },
               [&](caf::error& err) { status = "no answer: " + sys.render(err); });
  expect(status.find("status refused") != std::string::npos,
         "status with a wrong token, after the exits (" + status + ")");
  return failures == 0 ? 0 : 1;
}
