// A consumer rank: joins the coordinator, runs the rollout executor on every update it is
// sent, and reports importing / acknowledged / rejected / released.

#include <atomic>
#include <map>
#include <thread>

#include "guard.hpp"
#include "protocol.hpp"
#include "runtime_support.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

using namespace proto;

// The rollout side of one rank; touched only by its actor's thread, except the atomics. It
// installs through its own reference runtime (`wsync consumer`) or through an adapter and gate
// the embedding program brings (rollout_rank).
struct rollout_side {
  std::string relay_address;  ///< where other consumers pull from this rank (first: taken
                              ///< from the transport before the consumer owns it)
  weight_consumer consumer;
  std::unique_ptr<reference_runtime> own_runtime;  ///< null when the program brings an adapter
  rollout_executor executor;
  std::map<update_id, std::string> key_of;  ///< shard id -> update key, for release reports
  std::atomic<bool> joined{false};
  std::atomic<bool> refused{false};  ///< the coordinator refused the rank (bad token, ...)

  rollout_side(std::unique_ptr<consumer_transport> t, std::int32_t rank, bool verify)
      : rollout_side(std::move(t), rank, verify, std::make_unique<reference_runtime>()) {}
  rollout_side(std::unique_ptr<consumer_transport> t, std::int32_t rank, bool verify,
               install_adapter& adapter, generation_gate& gate)
      : relay_address(t->relay_address()),
        consumer(std::move(t), consumer_config{rank, 2}),
        executor(consumer, adapter, gate, executor_config{verify}) {}

  std::uint64_t active_version() const { return executor.active_weight_version().value_or(0); }

 private:
  rollout_side(std::unique_ptr<consumer_transport> t, std::int32_t rank, bool verify,
               std::unique_ptr<reference_runtime> runtime)
      : rollout_side(std::move(t), rank, verify, *runtime, runtime->gate()) {
    own_runtime = std::move(runtime);
  }
};

struct consumer_state {
  coordinator_actor coordinator;
  bool joined = false;
  std::chrono::milliseconds backoff{200};
};

using consumer_pointer = consumer_actor::pointer;

// Joins (or re-joins) the current coordinator, telling it the version this rank serves.
void join(consumer_pointer self, std::shared_ptr<consumer_state> st, rank_hello hello,
          std::shared_ptr<rollout_side> side) {
  const std::int32_t rank = hello.rank;
  hello.active_weight_version = side->active_version();
  std::set<std::string> held;
  for (const auto& [id, key] : side->key_of) held.insert(key);
  hello.held.assign(held.begin(), held.end());
  self->monitor(st->coordinator);
  self->request(st->coordinator, std::chrono::seconds(10), join_atom::value, hello)
      .then(
          [=](const std::string& token, const std::string& refusal) {
            if (token == hello.token && refusal.empty()) {
              st->joined = true;
              side->joined = true;
              st->backoff = std::chrono::milliseconds(200);
              return;
            }
            log_error("consumer rank " + std::to_string(rank) + ": " + refusal);
            side->refused = true;
            self->quit(caf::exit_reason::user_shutdown);
          },
          [=](caf::error& err) {
            log_warn("consumer rank " + std::to_string(rank) +
                     ": join failed: " + self->system().render(err));
            self->delayed_send(self, st->backoff, reconnect_atom::value);
          });
}

consumer_actor::behavior_type consumer_impl(consumer_pointer self, coordinator_actor coordinator,
                                            std::shared_ptr<rollout_side> side, rank_hello hello,
                                            endpoint where, caf::io::middleman_actor connector,
                                            consumer_observer* observer) {
  const std::int32_t rank = hello.rank;
  auto st = std::make_shared<consumer_state>();
  st->coordinator = coordinator;
  join(self, st, hello, side);
  self->set_down_handler([=](caf::down_msg& msg) {
    if (msg.source != st->coordinator.address()) return;
    if (!really_down(st->coordinator)) {
      log_warn("consumer rank " + std::to_string(rank) +
               ": refused a down message for the coordinator, which is still running");
      return;
    }
    st->joined = false;
    side->joined = false;
    // Keep serving the active version and look for a restarted coordinator, with backoff.
    log_warn("consumer rank " + std::to_string(rank) +
             ": coordinator went away; serving active version " +
             std::to_string(side->active_version()) + ", reconnecting");
    self->delayed_send(self, st->backoff, reconnect_atom::value);
  });
  auto report = [=](const std::string& key, const std::string& state, std::string reason,
                    double seconds = 0) {
    self->send(st->coordinator, report_atom::value,
               rank_report{hello.token, key, rank, state, std::move(reason), side->active_version(),
                           seconds});
  };
  return {
      [=](update_atom, const update_available& msg) {
        if (msg.token != hello.token) {
          log_warn("consumer rank " + std::to_string(rank) + ": refused update " + msg.key +
                   ": token: not from the coordinator");
          return;
        }
        std::vector<weight_update_manifest> shards;
        for (const auto& text : msg.manifests) {
          auto m = manifest_from_json(text);
          if (!m) {
            report(msg.key, "rejected", m.error().message);
            return;
          }
          shards.push_back(std::move(*m));
        }
        report(msg.key, "importing", msg.received_from);
        auto r = side->executor.update_weights(shards);
        if (observer) {
          std::uint64_t bytes = 0;
          for (const auto& m : shards) bytes += m.total_bytes;
          observer->update_done(rank, msg.key, r, bytes);
        }
        // The update this one replaced is let go before the answer, so the publisher can reuse
        // its memory by the time it hears the outcome.
        std::set<std::string> released_keys;
        for (const auto& id : r.released) {
          auto it = side->key_of.find(id);
          if (it == side->key_of.end()) continue;
          released_keys.insert(it->second);
          side->key_of.erase(it);
        }
        for (const auto& key : released_keys) report(key, "released", "");
        if (r.acknowledged) {
          log_info("consumer rank " + std::to_string(rank) + ": active version " +
                   std::to_string(r.weight_version) + " (" + msg.key + ")");
          for (const auto& id : r.shard_ids) side->key_of[id] = msg.key;
          report(msg.key, "acknowledged", "", r.timings.total);
          if (r.released_self) report(msg.key, "released", "");
        } else {
          report(msg.key, "rejected", r.failure ? r.failure->message : "unknown failure",
                 r.timings.total);
          if (r.released_self) report(msg.key, "released", "");
        }
      },
      [=](reconnect_atom) {
        if (st->joined) return;  // a stray reconnect: the coordinator is there
        st->backoff = std::min(st->backoff * 2, std::chrono::milliseconds(5000));
        self->request(connector, std::chrono::seconds(5), caf::connect_atom::value, where.host,
                      where.port)
            .then(
                [=](const caf::node_id&, caf::strong_actor_ptr& ptr, const std::set<std::string>&) {
                  if (!ptr) {
                    self->delayed_send(self, st->backoff, reconnect_atom::value);
                    return;
                  }
                  st->coordinator = caf::actor_cast<coordinator_actor>(ptr);
                  log_info("consumer rank " + std::to_string(rank) +
                           ": reconnected to the coordinator");
                  join(self, st, hello, side);
                },
                [=](caf::error&) { self->delayed_send(self, st->backoff, reconnect_atom::value); });
      },
      [=](drop_atom, const std::string& token, const std::string& key) {
        if (token != hello.token) return;
        // Updates run to completion inside update_atom, so an aborted one is either already
        // rejected and released, or active — and the active version is kept.
        log_info("consumer rank " + std::to_string(rank) + ": update " + key +
                 " was aborted; keeping active version " + std::to_string(side->active_version()));
      },
  };
}

}  // namespace

int consumer_run(const consumer_options& options) {
  cluster_system sys(options.heartbeat, options.coordinator.tls);
  auto coordinator = sys.connect(options.coordinator);
  if (!coordinator) {
    log_error("consumer rank " + std::to_string(options.rank) +
              ": cannot reach the coordinator at " + options.coordinator.host + ":" +
              std::to_string(options.coordinator.port) + ": " +
              sys.get().render(coordinator.error()));
    return 1;
  }
  // Installing is blocking CPU work, but this process runs nothing else on the scheduler, and
  // networking (heartbeats included) has the middleman's own thread. A detached actor here
  // made ~actor_system wait forever when the coordinator died first (CAF 0.17 keeps a
  // reference to an actor whose handle went to a dead node).
  std::vector<caf::actor> endpoints;
  std::vector<std::shared_ptr<rollout_side>> sides;  // outlive the actors, for the observer
  for (std::int32_t k = 0; k < options.count; ++k) {
    auto t = make_transport(options.transport, options.transport_settings);
    if (!t) return log_error(t.error().message), 1;
    auto c = (*t)->make_consumer();
    if (!c) return log_error(c.error().message), 1;
    auto side = std::make_shared<rollout_side>(std::move(*c), options.rank + k, options.verify);
    if (options.observer) options.observer->rank_started(options.rank + k, *side->own_runtime);
    sides.push_back(side);
    auto hello = hello_make(options.coordinator.token, options.rank + k, "consumer", options.node,
                            options.model_id, options.transport);
    hello.address = side->relay_address;
    auto who = "consumer rank " + std::to_string(options.rank + k);
    endpoints.push_back(caf::actor_cast<caf::actor>(sys.get().spawn<guarded<consumer_actor::base>>(
        who, [=, c = *coordinator, where = options.coordinator,
              connector = sys.connector()](consumer_actor::base* self) {
          return consumer_impl(self, c, side, hello, where, connector, options.observer);
        })));
  }
  int rc = run_until_stopped(sys.get(), endpoints);
  if (options.observer) options.observer->stopping();
  return rc;
}

struct rollout_rank::impl {
  impl(std::chrono::milliseconds heartbeat, const tls_settings& tls) : sys(heartbeat, tls) {}
  cluster_system sys;  // first: blocks the stop signals before any thread starts
  std::shared_ptr<rollout_side> side;
  caf::actor endpoint;
};

rollout_rank::rollout_rank(std::unique_ptr<impl> p) : impl_(std::move(p)) {}

rollout_rank::~rollout_rank() {
  stop_and_wait(impl_->sys.get(), std::vector<caf::actor>{impl_->endpoint});
  impl_->endpoint = nullptr;
  impl_->side->executor.release_active();
}

result<std::unique_ptr<rollout_rank>> rollout_rank::connect(const rollout_options& o,
                                                            install_adapter& adapter,
                                                            generation_gate& gate,
                                                            consumer_observer* observer) {
  auto p = std::make_unique<impl>(o.heartbeat, o.coordinator.tls);
  const auto who = "consumer rank " + std::to_string(o.rank);
  auto coordinator = p->sys.connect(o.coordinator);
  if (!coordinator) {
    return make_error(errc::io_error, who + ": cannot reach the coordinator at " +
                                          o.coordinator.host + ":" +
                                          std::to_string(o.coordinator.port) + ": " +
                                          p->sys.get().render(coordinator.error()));
  }
  auto t = make_transport(o.transport, o.transport_settings);
  if (!t) return t.error();
  auto c = (*t)->make_consumer();
  if (!c) return c.error();
  p->side = std::make_shared<rollout_side>(std::move(*c), o.rank, o.verify, adapter, gate);
  auto hello = hello_make(o.coordinator.token, o.rank, "consumer", o.node, o.model_id, o.transport);
  hello.address = p->side->relay_address;
  p->endpoint = caf::actor_cast<caf::actor>(p->sys.get().spawn<guarded<consumer_actor::base>>(
      who, [=, c = *coordinator, side = p->side, where = o.coordinator,
            connector = p->sys.connector()](consumer_actor::base* self) {
        return consumer_impl(self, c, side, hello, where, connector, observer);
      }));
  auto rank = std::unique_ptr<rollout_rank>(new rollout_rank(std::move(p)));
  const auto deadline = std::chrono::steady_clock::now() + o.join_timeout;
  while (!rank->impl_->side->joined) {
    if (rank->impl_->side->refused) {
      return make_error(errc::invalid_argument,
                        who + ": the coordinator refused the rank (see the log for why)");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return make_error(errc::timeout, who + ": not joined to the coordinator at " +
                                           o.coordinator.host + ":" +
                                           std::to_string(o.coordinator.port) + " within " +
                                           std::to_string(o.join_timeout.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return rank;
}

std::uint64_t rollout_rank::active_weight_version() const {
  return impl_->side->active_version();
}

bool rollout_rank::joined() const {
  return impl_->side->joined;
}

}  // namespace wsync
