// A publisher (trainer) rank: publishes its shard of each version through the data plane,
// hands the manifest to the coordinator, waits for the outcome, and gives slots back when the
// coordinator says every consumer released them.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "guard.hpp"
#include "protocol.hpp"
#include "runtime_support.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/json_writer.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

using namespace proto;
using json = nlohmann::json;

// The top-level text fields of the coordinator's answer (phase and reason of an outcome, error
// and code of a refusal), read without building its document: an outcome lists every rank,
// and a thousand of them took ~3 ms to parse and re-encode on the trainer's path.
struct outcome_head {
  bool object = false;  // the answer is a JSON object
  int depth = 0;
  std::string last_key;  // the last top-level key
  bool members = false;  // the object has a key
  std::map<std::string, std::string> fields;

  std::string value(const std::string& k, const std::string& otherwise) const {
    auto it = fields.find(k);
    return it == fields.end() ? otherwise : it->second;
  }
  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const std::string&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool string(std::string& v) {
    const auto& k = last_key;
    if (depth == 1 && (k == "error" || k == "code" || k == "phase" || k == "reason")) {
      fields[k] = std::move(v);
    }
    return true;
  }
  bool key(std::string& k) {
    if (depth == 1) {
      last_key = std::move(k);
      members = true;
    }
    return true;
  }
  bool start_object(std::size_t) {
    if (depth++ == 0) object = true;
    return true;
  }
  bool end_object() { return --depth, true; }
  bool start_array(std::size_t) { return ++depth, true; }
  bool end_array() { return --depth, true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }
};
// Every dump below replaces invalid UTF-8 (a reason quoting bytes a peer sent) instead of
// throwing inside an actor.

struct publisher_side {
  std::unique_ptr<weight_publisher> publisher;
  std::atomic<bool> coordinator_lost{false};  ///< set by the endpoint, read by the trainer
  std::mutex mutex;
  /// The coordinator's answer to the join of round `join_round` (mutex held): joined, refused
  /// (invalid_argument) or no answer (io_error). The trainer waits for it, so a refused join
  /// fails its connect.
  std::condition_variable join_cv;
  std::uint64_t join_round = 0;
  std::optional<result<void>> join_answer;
  void answer_join(std::uint64_t round, result<void> answer) {
    std::lock_guard lock(mutex);
    if (round != join_round) return;
    join_answer = std::move(answer);
    join_cv.notify_all();
  }
  /// Update key -> this rank's shards of it, oldest first: a retry of an aborted version has
  /// the key of the attempt before it, and the coordinator releases attempts in order.
  std::map<std::string, std::deque<update_id>> id_of;
  /// `id` of `key` is given back: out of its queue; mutex held.
  void forget_locked(const std::string& key, const update_id& id) {
    auto it = id_of.find(key);
    if (it == id_of.end()) return;
    std::erase(it->second, id);
    if (it->second.empty()) id_of.erase(it);
  }
};

publisher_actor::behavior_type publisher_impl(publisher_actor::pointer self,
                                              coordinator_actor coordinator,
                                              std::shared_ptr<publisher_side> side,
                                              rank_hello hello, std::chrono::milliseconds timeout,
                                              std::uint64_t round) {
  const std::int32_t rank = hello.rank;
  self->request(coordinator, std::chrono::seconds(10), join_atom::value, hello)
      .then(
          [=](const std::string& token, const std::string& refusal) {
            if (token_matches(token, hello.token) && refusal.empty())
              return side->answer_join(round, {});
            side->answer_join(round,
                              make_error(errc::invalid_argument,
                                         refusal.empty() ? "join refused: token: the coordinator "
                                                           "answered with another cluster token"
                                                         : refusal));
            self->quit(caf::exit_reason::user_shutdown);
          },
          [=](caf::error& err) {
            side->answer_join(
                round, make_error(errc::io_error, "join failed: " + self->system().render(err)));
            self->quit(err);
          });
  // CAF 0.17 does not fail a request when its peer dies: fail pending publishes ourselves.
  // By a serial: each leaves when answered, so the list holds only publishes in flight.
  // Publishes waiting for their outcome, with the update and rank their errors name.
  struct waiting {
    caf::typed_response_promise<std::string> promise;
    std::string context;
  };
  auto pending = std::make_shared<std::map<std::uint64_t, waiting>>();
  auto serial = std::make_shared<std::uint64_t>(0);
  // Why the coordinator went away, once it did: a publish that comes after is answered at once
  // (sent on, it would reach no one and wait out its whole timeout).
  auto gone = std::make_shared<std::string>();
  self->monitor(coordinator);
  self->set_down_handler([=](caf::down_msg& msg) {
    if (msg.source != coordinator.address() || !really_down(coordinator)) {
      log_warn("publisher rank " + std::to_string(rank) +
               ": refused a down message for an actor that is still running");
      return;
    }
    side->coordinator_lost = true;
    const auto reason = self->system().render(msg.reason);
    *gone = reason;
    for (auto& [n, w] : *pending) {
      w.promise.deliver(
          json{{"error", "the coordinator went away: " + reason + " (" + w.context + ")"}}.dump(
              -1, ' ', false, json::error_handler_t::replace));
    }
    pending->clear();
  });
  return {
      [=](publish_atom, const std::string& token, const std::string& key, const std::string& id,
          const std::string& manifest) -> caf::result<std::string> {
        if (!token_matches(token, hello.token)) {
          return json{{"error", "publish refused: token: not from this process"},
                      {"code", "invalid_argument"}}
              .dump(-1, ' ', false, json::error_handler_t::replace);
        }
        {
          std::lock_guard lock(side->mutex);
          side->id_of[key].push_back(id);
        }
        const auto context = update_context(id, rank);
        if (!gone->empty()) {  // the trainer checked before its copy; the link went meanwhile
          // With a code: no coordinator saw this manifest, so the trainer frees its memory now.
          return json{{"error", "the coordinator went away: " + *gone + " (" + context + ")"},
                      {"code", "io_error"}}
              .dump(-1, ' ', false, json::error_handler_t::replace);
        }
        auto rp = self->make_response_promise<std::string>();
        const auto n = ++*serial;
        pending->emplace(n, waiting{rp, context});
        self->request(coordinator, timeout, publish_atom::value, hello.token, manifest)
            .then(
                [=](const std::string& reply_token, const std::string& outcome) mutable {
                  pending->erase(n);
                  if (token_matches(reply_token, hello.token)) {
                    rp.deliver(outcome);
                    return;
                  }
                  rp.deliver(json{{"error", "the coordinator refused the cluster token: " +
                                                outcome + " (" + context + ")"},
                                  {"code", "invalid_argument"}}
                                 .dump(-1, ' ', false, json::error_handler_t::replace));
                },
                [=](caf::error& err) mutable {
                  pending->erase(n);
                  rp.deliver(json{{"error", "no outcome from the coordinator: " +
                                                self->system().render(err) + " (" + context + ")"}}
                                 .dump(-1, ' ', false, json::error_handler_t::replace));
                });
        return rp;
      },
      [=](release_atom, const std::string& token, const std::string& key,
          const std::vector<std::string>& ids) {
        if (!token_matches(token, hello.token)) {
          log_warn("publisher rank " + std::to_string(rank) + ": refused a release of " + key +
                   ": token: not from the coordinator");
          return;
        }
        // Exactly the attempt the coordinator let go of: a retry of the same version may be
        // held under the same key meanwhile.
        std::vector<update_id> release;
        {
          std::lock_guard lock(side->mutex);
          auto it = side->id_of.find(key);
          if (it == side->id_of.end()) return;
          if (ids.empty()) {
            release.push_back(it->second.front());
          } else {
            for (const auto& id : it->second) {
              if (std::find(ids.begin(), ids.end(), id) != ids.end()) release.push_back(id);
            }
          }
          for (const auto& id : release) side->forget_locked(key, id);
        }
        for (const auto& id : release) (void)side->publisher->release(id);
      },
  };
}

}  // namespace

shard_spec publisher_shard(const publisher_options& o) {
  return {o.layout, o.safetensors, o.rank, o.ranks};
}

std::string publisher_model_id(const publisher_options& o) {
  return o.model_id.empty() ? shard_model_id(publisher_shard(o)) : o.model_id;
}

struct trainer_rank::impl {
  impl(std::chrono::milliseconds heartbeat, const tls_settings& tls) : sys(heartbeat, tls) {}
  ~impl() { retire_endpoint(); }

  // Stops the endpoint, so the coordinator sees it leave, and drops the registry's reference to
  // it (stop_and_wait).
  void retire_endpoint() {
    if (!endpoint) return;
    stop_and_wait(sys.get(), std::vector<publisher_actor>{endpoint});
    endpoint = nullptr;
  }
  cluster_system sys;  // first: blocks the stop signals before any thread starts
  std::shared_ptr<publisher_side> side = std::make_shared<publisher_side>();
  publisher_actor endpoint;
  coordinator_actor coordinator_handle;  ///< as joined last
  trainer_options options;
  bool collective = false;  ///< the transport broadcasts to every consumer: ask who they are

  // The live consumer ranks of this model that speak the transport, from the coordinator: a
  // collective transport's group for the next update.
  result<std::vector<std::int32_t>> live_consumers() {
    const std::string who = "publisher rank " + std::to_string(options.rank);
    result<std::vector<std::int32_t>> out =
        make_error(errc::io_error, who + ": no answer from the coordinator");
    caf::scoped_actor self{sys.get()};
    self->request(coordinator_handle, std::chrono::seconds(10), members_atom::value,
                  options.coordinator.token, options.model_id, options.transport)
        .receive(
            [&](const std::string& text) {
              auto j = json::parse(text, nullptr, false);
              if (!j.is_array()) {
                out = make_error(errc::io_error,
                                 who + ": the coordinator did not name the consumers: " +
                                     (j.is_object() ? j.value("error", text) : text));
                return;
              }
              std::vector<std::int32_t> ranks;
              for (const auto& r : j) {
                if (r.is_number_integer()) ranks.push_back(r.get<std::int32_t>());
              }
              if (ranks.empty()) {
                out = make_error(errc::invalid_argument,
                                 who + ": no live consumer rank of model_id=" + options.model_id +
                                     " speaks " + options.transport +
                                     ", which broadcasts to its consumers: nothing to publish to");
                return;
              }
              out = std::move(ranks);
            },
            [&](caf::error& err) {
              out = make_error(errc::io_error, who +
                                                   ": asking the coordinator for the consumers "
                                                   "failed: " +
                                                   sys.get().render(err));
            });
    return out;
  }

  // Reaches the coordinator and joins through a fresh endpoint. Blocking: runs in the trainer's
  // thread, never inside an actor.
  result<void> join() {
    auto& system = sys.get();
    auto coordinator = sys.connect(options.coordinator);
    if (!coordinator) {
      return make_error(errc::io_error, "publisher rank " + std::to_string(options.rank) +
                                            ": cannot reach the coordinator at " +
                                            options.coordinator.host + ":" +
                                            std::to_string(options.coordinator.port) + ": " +
                                            system.render(coordinator.error()));
    }
    retire_endpoint();
    coordinator_handle = *coordinator;
    side->coordinator_lost = false;
    auto hello = hello_make(options.coordinator.token, options.rank, "publisher", options.node,
                            options.model_id, options.transport);
    hello.publisher_ranks = options.ranks;
    std::uint64_t round = 0;
    {
      std::lock_guard lock(side->mutex);
      // What it still holds, so that a coordinator that lost the release (it restarted, or
      // sent it while this rank was away) gives it back once no consumer holds it.
      for (const auto& [key, ids] : side->id_of) {
        for (const auto& id : ids) hello.held.push_back(key), hello.held_ids.push_back(id);
      }
      round = ++side->join_round;
      side->join_answer.reset();
    }
    endpoint = system.spawn<guarded<publisher_actor::base>>(
        "publisher rank " + std::to_string(options.rank),
        [c = *coordinator, side = side, hello, timeout = options.outcome_timeout,
         round](publisher_actor::base* self) {
          return publisher_impl(self, c, side, hello, timeout, round);
        });
    // Joined only once the coordinator says so: a wrong token or a full coordinator fails
    // here, naming why, instead of every publish failing later without the reason.
    const std::string who = "publisher rank " + std::to_string(options.rank);
    std::unique_lock lock(side->mutex);
    if (!side->join_cv.wait_for(lock, std::chrono::seconds(15),
                                [&] { return side->join_answer.has_value(); })) {
      side->coordinator_lost = true;  // the next publish joins again
      return make_error(errc::timeout, who + ": the coordinator did not answer its join");
    }
    if (!*side->join_answer) {
      side->coordinator_lost = true;  // the endpoint quit: the next publish joins again
      const auto& e = side->join_answer->error();
      return make_error(e.code, who + ": " + e.message);
    }
    return {};
  }

  // After losing the coordinator: retry with backoff (200 ms doubling to 5 s) for up to the
  // outcome timeout, so a restarted coordinator is picked up.
  result<void> rejoin() {
    auto backoff = std::chrono::milliseconds(200);
    auto deadline = std::chrono::steady_clock::now() + options.outcome_timeout;
    for (;;) {
      auto ok = join();
      // A refusal (a wrong token) stays one: only an unreachable coordinator is worth waiting on.
      if (ok || ok.error().code == errc::invalid_argument ||
          std::chrono::steady_clock::now() + backoff > deadline) {
        return ok;
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
    }
  }
};

trainer_rank::trainer_rank(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
trainer_rank::~trainer_rank() = default;

result<std::unique_ptr<trainer_rank>> trainer_rank::connect(const trainer_options& o) {
  auto p = std::make_unique<impl>(o.heartbeat, o.coordinator.tls);
  p->options = o;
  auto t = make_transport(o.transport, o.transport_settings);
  if (!t) return t.error();
  auto pt = (*t)->make_publisher();
  if (!pt) return pt.error();
  publisher_config cfg;
  cfg.model_id = o.model_id;
  cfg.source_rank = o.rank;
  cfg.release_when_answered = false;  // the coordinator says when
  cfg.coordinator_orders_versions = true;
  cfg.slot_wait = o.outcome_timeout;
  cfg.lend_sources = o.lend_sources;
  p->side->publisher = std::make_unique<weight_publisher>(std::move(*pt), o.transport, cfg);
  p->collective = (*t)->caps().collective;
  if (auto ok = p->join(); !ok) return ok.error();
  return std::unique_ptr<trainer_rank>(new trainer_rank(std::move(p)));
}

publish_outcome trainer_rank::publish(std::span<const tensor_source> tensors,
                                      std::uint64_t weight_version,
                                      std::map<std::string, std::string> metadata) {
  publish_outcome out;
  auto& o = impl_->options;
  if (impl_->side->coordinator_lost) {
    log_warn("publisher rank " + std::to_string(o.rank) + ": coordinator lost; reconnecting");
    if (auto ok = impl_->rejoin(); !ok) return out.fail(ok.error()), out;
    log_info("publisher rank " + std::to_string(o.rank) + ": reconnected to the coordinator");
  }
  std::vector<std::int32_t> consumers;  // named only for a collective transport
  if (impl_->collective) {
    auto live = impl_->live_consumers();
    if (!live) return out.fail(live.error()), out;
    consumers = std::move(*live);
  }
  auto t0 = std::chrono::steady_clock::now();
  auto m = impl_->side->publisher->publish(tensors, weight_version, std::move(consumers),
                                           std::move(metadata));
  out.publish_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!m) return out.fail(m.error()), out;
  auto key = update_key(m->model_id, weight_version);
  caf::scoped_actor self{impl_->sys.get()};
  bool refused = false;  // the coordinator answered no: the version never entered its books
  self->request(impl_->endpoint, o.outcome_timeout + std::chrono::seconds(5), publish_atom::value,
                o.coordinator.token, key, m->update_id, manifest_to_json(*m))
      .receive(
          [&](const std::string& outcome) {
            outcome_head head;
            const bool parsed = json::sax_parse(outcome, &head) && head.object;
            if (!parsed || head.fields.count("error")) {
              out.error = parsed ? head.value("error", outcome) : outcome;
              if (out.error.find("update_id=") == std::string::npos) {
                out.error += " (" + update_context(m->update_id, o.rank) + ")";
              }
              out.error_code = parsed ? head.value("code", "io_error") : "io_error";
              refused = parsed && head.fields.count("code");  // refusals carry their code
              return;
            }
            // The outcome with this rank's publish time, spliced in, not re-encoded: where
            // sorted keys put it (before "ranks", which the coordinator writes after "phase"
            // and whose name no earlier value can hold), else first.
            json_writer seconds;
            seconds.real(out.publish_s);
            const auto field = "\"publish_s\":" + seconds.take();
            const auto ranks = outcome.find(",\"ranks\":");
            if (ranks != std::string::npos) {
              out.outcome_json = outcome.substr(0, ranks + 1) + field + outcome.substr(ranks);
            } else {  // an object (parsed as one), maybe after spaces
              const auto open = outcome.find('{') + 1;
              out.outcome_json = outcome.substr(0, open) + field + (head.members ? "," : "") +
                                 outcome.substr(open);
            }
            out.committed = head.value("phase", "") == "committed";
            if (!out.committed) {
              out.error = "update " + key + " aborted: " + head.value("reason", "") + " (" +
                          update_context(m->update_id, o.rank) + ")";
            }
          },
          [&](caf::error& err) {
            out.fail(make_error(errc::io_error, "no outcome from this rank's endpoint: " +
                                                    impl_->sys.get().render(err) + " (" +
                                                    update_context(m->update_id, o.rank) + ")"));
          });
  // Lent tensors: the caller may change them once this returns, so wait for the transport to
  // stop reading them (by the outcome it has; an abort may come first).
  if (auto lent = impl_->side->publisher->lent_wait(m->update_id, o.outcome_timeout);
      !lent && out.error.empty()) {
    out.fail(lent.error());
  }
  // A refused version never reached the coordinator's books: give that memory back here. Any
  // other failure keeps it until a coordinator releases it, since consumers may be reading it:
  // no outcome in time (the coordinator may take two deadlines, plus retries), or a lost
  // coordinator (the next join names it among the keys this rank holds; a coordinator that
  // restarted releases it once no consumer that rejoined holds it).
  if (!out.error.empty() && out.outcome_json.empty() && refused) {
    (void)impl_->side->publisher->release(m->update_id);
    std::lock_guard lock(impl_->side->mutex);
    impl_->side->forget_locked(key, m->update_id);
  }
  return out;
}

std::vector<std::uint64_t> trainer_rank::held_versions() const {
  std::set<std::uint64_t> versions;
  std::lock_guard lock(impl_->side->mutex);
  for (const auto& [key, ids] : impl_->side->id_of) {
    versions.insert(std::strtoull(key.c_str() + key.rfind('@') + 1, nullptr, 10));
  }
  return {versions.begin(), versions.end()};
}

int publisher_run(const publisher_options& o) {
  auto shard = shard_load(publisher_shard(o));
  if (!shard) return log_error(shard.error().message), 1;
  trainer_options to;
  to.coordinator = o.coordinator;
  to.rank = o.rank;
  to.ranks = o.ranks;
  to.node = o.node;
  to.transport = o.transport;
  to.transport_settings = o.transport_settings;
  to.model_id = publisher_model_id(o);
  to.outcome_timeout = o.outcome_timeout;
  to.heartbeat = o.heartbeat;
  auto trainer = trainer_rank::connect(to);
  if (!trainer) return log_error(trainer.error().message), 1;
  const std::string who = "publisher rank " + std::to_string(o.rank);
  for (std::uint64_t v = o.first_version; v < o.first_version + o.versions; ++v) {
    // Between versions only (a publish in flight runs to its outcome), and not after the last.
    if (stop_requested_within(v == o.first_version ? std::chrono::milliseconds(0) : o.interval)) {
      log_info(who + ": stopped by SIGINT, SIGTERM or SIGHUP before version " + std::to_string(v));
      return 0;
    }
    if (auto same = shard_unchanged(*shard, o.rank, v, false); !same) {
      return log_error(same.error().message), 1;
    }
    auto r = (*trainer)->publish(shard->tensors, v, {{"rank", std::to_string(o.rank)}});
    if (auto same = shard_unchanged(*shard, o.rank, v, true); !same) {
      return log_error(same.error().message), 1;
    }
    if (o.json && !r.outcome_json.empty()) std::cout << r.outcome_json << std::endl;
    if (!r.error.empty()) {
      log_error(who + " version " + std::to_string(v) + ": " + r.error);
      return 1;
    }
    if (!o.json) log_info(who + ": version " + std::to_string(v) + " committed");
  }
  return 0;
}

}  // namespace wsync
