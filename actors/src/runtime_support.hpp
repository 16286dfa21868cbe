#pragma once
// What every cluster process needs around CAF: one actor system configured the same way
// (message types, networking, heartbeats on at both ends), and running until a stop signal.

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include <caf/openssl/all.hpp>

#include "guard.hpp"
#include "protocol.hpp"
#include "tcp_probe.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/actors/stop_signals.hpp"

namespace wsync {

/// Stops `endpoints` and waits, up to `grace`, until they terminated: their down messages, which
/// say user_shutdown, then leave for the peers that monitor them before this process closes its
/// connections, so the coordinator sees an orderly leave rather than a lost link.
template <class Handle>
void stop_and_wait(caf::actor_system& sys, const std::vector<Handle>& endpoints,
                   std::chrono::milliseconds grace = std::chrono::milliseconds(1000)) {
  caf::scoped_actor self{sys};
  std::size_t running = 0;
  for (const auto& e : endpoints) {
    if (!e) continue;
    self->monitor(e);
    ++running;
  }
  for (const auto& e : endpoints) stop_guarded(e);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool waiting = true;  // both change in the handlers below
  while (waiting && running > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    self->receive(
        [&](caf::down_msg&) { --running; },
        caf::after(std::max(left, std::chrono::milliseconds(0))) >> [&] { waiting = false; });
  }
  // An actor whose handle went to a remote node stays in the registry until that node says it
  // dropped it; a peer that died first never does.
  for (const auto& e : endpoints) {
    if (e) sys.registry().erase(e->id());
  }
}

/// Runs until SIGINT/SIGTERM/SIGHUP (returns 0) or until one of `endpoints` terminates on its own
/// (returns 1: it logged why), then calls `closing` (work in flight may end now: the actor system
/// waits for it) and stops them all.
inline int run_until_stopped(caf::actor_system& sys, const std::vector<caf::actor>& endpoints,
                             const std::function<void()>& closing = {}) {
  caf::scoped_actor self{sys};
  for (const auto& e : endpoints) self->monitor(e);
  bool ended = false;
  while (!ended && !stop_requested()) {
    self->receive([&](caf::down_msg&) { ended = true; },
                  caf::after(std::chrono::milliseconds(100)) >> [] {});
  }
  if (closing) closing();
  stop_and_wait(sys, endpoints);
  return ended ? 1 : 0;
}

/// The actor system of a cluster process. CAF 0.17 detects a frozen peer only with heartbeats
/// on at both ends, so every process turns them on (notes/caf-0.17.md).
class cluster_system {
 public:
  explicit cluster_system(std::chrono::milliseconds heartbeat, const tls_settings& tls = {})
      : tls_(tls.enabled()) {
    block_stop_signals();
    cfg_.add_message_types<caf::id_block::wsync>();
    cfg_.load<caf::io::middleman>();
    if (tls_) {
      cfg_.load<caf::openssl::manager>();
      cfg_.openssl_certificate = tls.certificate;
      cfg_.openssl_key = tls.key;
      cfg_.openssl_cafile = tls.ca_file;
    }
    cfg_.set("middleman.heartbeat-interval", caf::timespan{heartbeat});
    cfg_.set("middleman.connection-timeout", caf::timespan{heartbeat * 5});
    cfg_.set("logger.console", caf::atom("none"));
    // One shared queue whose idle workers sleep on a condition variable: CAF's default work
    // stealing polls, so every idle cluster process burnt CPU that the trainer and the engines
    // beside it want, and on this project's 2-core machines the sharing policy committed updates
    // to 1,024 ranks faster as well (docs/benchmark.md, `--mode cluster`).
    cfg_.set("scheduler.policy", caf::atom("sharing"));
    // No BASP deserialization workers: messages are decoded on the middleman's own thread. With
    // workers, a closed connection's cleanup waits in BASP's ordered queue behind messages still
    // being decoded, while the kernel hands its descriptor (CAF's connection handle) to the
    // next accepted connection; the late cleanup then unmaps that new connection from its node,
    // and every answer to it is dropped for good. Measured here: 17 of 1,920 status calls (12 at
    // once) lost their answer with workers, 0 of 3,840 without; `--mode cluster` commit times
    // did not change beyond noise (docs/cluster.md, "Failures and what they look like").
    cfg_.set("middleman.workers", size_t{0});
    sys_ = std::make_unique<caf::actor_system>(cfg_);
  }
  caf::actor_system& get() { return *sys_; }
  bool tls() const { return tls_; }

  /// Connects to the coordinator (blocking: never call from inside an actor). One that takes no
  /// TCP connection within `limit` is given up then (tcp_probe.hpp), not after the kernel's
  /// SYN retries.
  caf::expected<proto::coordinator_actor> connect(
      const endpoint& where, std::chrono::milliseconds limit = std::chrono::seconds(10)) {
    if (auto why = tcp_answers(where.host, where.port, limit); !why.empty()) {
      return caf::make_error(caf::sec::cannot_connect_to_node, std::move(why));
    }
    // CAF 0.17's heartbeat tick drops a connection whose handshake has not come back by then
    // (its last-seen time starts at zero): rare on loopback, less so with TLS across hosts. That
    // failure reads connection_timeout, and is worth another try or two.
    for (int attempt = 1;; ++attempt) {
      auto c =
          tls_ ? caf::openssl::remote_actor<proto::coordinator_actor>(*sys_, where.host, where.port)
               : sys_->middleman().remote_actor<proto::coordinator_actor>(where.host, where.port);
      if (c || attempt == 3 || c.error().category() != caf::atom("system") ||
          c.error().code() != static_cast<std::uint8_t>(caf::sec::connection_timeout)) {
        return c;
      }
    }
  }

  /// Publishes `actor` (the coordinator, or a consumer endpoint for its node) on `where` (TLS
  /// when configured); returns the port.
  template <class Handle>
  caf::expected<std::uint16_t> publish(const Handle& actor, const endpoint& where) {
    if (tls_) return caf::openssl::publish(actor, where.port, where.host.c_str(), true);
    return sys_->middleman().publish(actor, where.port, where.host.c_str(), true);
  }

  /// The actor that opens connections without blocking (for reconnects inside actors).
  caf::io::middleman_actor connector() {
    if (tls_) return sys_->openssl_manager().actor_handle();
    return sys_->middleman().actor_handle();
  }

 private:
  bool tls_ = false;
  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> sys_;
};

}  // namespace wsync
