#pragma once
// The door of every wsync actor that a peer can address. CAF 0.17 delivers whatever a connected
// peer sends, and BASP lets a peer write the sender of a routed message itself (any node, any
// actor id, or none), so neither "who sent it" nor "is it local" can be trusted. A guarded
// actor therefore
//  - refuses every exit message unless this process asked the actor to stop (stop_guarded):
//    exit_reason::kill is untrappable in CAF, so it must never reach the mailbox;
//  - refuses asynchronous error messages (CAF's default handler quits on one), stream
//    messages and behaviour timeouts, none of which wsync uses;
//  - lets down messages through: handlers check that the monitored actor really terminated
//    (really_down), which a forged down message cannot fake;
//  - leaves content authentication to the handlers: every state-changing message carries the
//    cluster token (protocol.hpp).
// Heavy (CAF): include only from actor code.

#include <atomic>
#include <functional>
#include <string>

#include "protocol.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {

/// Set by this process, never by a message: the actor may now take an exit message.
class stop_latch {
 public:
  virtual ~stop_latch() = default;
  std::atomic<bool> may_stop{false};
};

/// Why a message at a guarded actor's door is refused, or nullptr to let it in.
inline const char* door_refusal(const caf::mailbox_element& x, bool may_stop) {
  const auto& c = x.content();
  if (c.match_elements<caf::exit_msg>()) return may_stop ? nullptr : "an exit message";
  if (x.mid.is_response()) return nullptr;  // matched against our own pending requests
  if (c.match_elements<caf::error>()) return "an asynchronous error message";
  if (c.match_elements<caf::timeout_msg>()) return "a timeout message";
  if (c.match_elements<caf::open_stream_msg>() || c.match_elements<caf::upstream_msg>() ||
      c.match_elements<caf::downstream_msg>()) {
    return "a stream message";
  }
  return nullptr;
}

/// `Base` (a typed event-based actor, possibly stateful) behind the door above. `init` builds
/// the behaviour, as a function-based actor's body would.
template <class Base>
class guarded final : public Base, public stop_latch {
 public:
  using behavior_type = typename Base::behavior_type;
  using init_fn = std::function<behavior_type(Base*)>;

  guarded(caf::actor_config& cfg, std::string who, init_fn init)
      : Base(cfg), who_(std::move(who)), init_(std::move(init)) {}

  void enqueue(caf::mailbox_element_ptr ptr, caf::execution_unit* eu) override {
    if (ptr) {
      if (const char* why = door_refusal(*ptr, may_stop.load())) {
        log_warn(who_ + ": refused " + why + " from outside (guard.hpp)");
        return;
      }
    }
    Base::enqueue(std::move(ptr), eu);
  }

  // The init function goes once it ran: handles it captured (the middleman's, a peer's) must not
  // live as long as this object, or ~actor_system can wait for them forever.
  behavior_type make_behavior() override {
    auto init = std::move(init_);
    init_ = nullptr;
    return init(this);
  }

 private:
  std::string who_;
  init_fn init_;
};

/// Lets a guarded actor take an exit message, then sends it one.
template <class Handle>
void stop_guarded(const Handle& h, caf::exit_reason reason = caf::exit_reason::user_shutdown) {
  if (!h) return;
  if (auto* latch = dynamic_cast<stop_latch*>(caf::actor_cast<caf::abstract_actor*>(h))) {
    latch->may_stop = true;
  }
  caf::anon_send_exit(h, reason);
}

/// True when `h` (a monitored actor or its proxy) has terminated: a genuine down message for it
/// is only sent after that, a forged one arrives while it still runs.
template <class Handle>
bool really_down(const Handle& h) {
  auto* p = caf::actor_cast<caf::abstract_actor*>(h);
  return p == nullptr || p->getf(caf::abstract_actor::is_terminated_flag);
}

}  // namespace wsync
