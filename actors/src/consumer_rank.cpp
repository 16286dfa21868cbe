// The worker actor of one consumer rank (consumer_rank.hpp).

#include "consumer_rank.hpp"

#include <algorithm>

namespace wsync::consumer_detail {
namespace {

using namespace proto;

// Where a rank's shards came from when a peer gave them (the status table's received_from);
// empty when every shard came from where the update said.
std::string import_source(const rollout_side& side, const std::vector<update_id>& shards) {
  std::set<std::string> sources;
  for (const auto& id : shards) {
    if (auto from = side.consumer.import_source(id); !from.empty()) sources.insert(from);
  }
  std::string out;
  for (const auto& s : sources) out += (out.empty() ? "" : ",") + s;
  return out;
}

}  // namespace

using namespace proto;

// One consumer rank's worker: installs each update its endpoint hands it, on its own actor, so
// the ranks of a process import in parallel on the scheduler's threads. Installing is blocking
// CPU work, but a consumer process runs nothing else on the scheduler, and networking
// (heartbeats included) has the middleman's own thread. A detached actor here made
// ~actor_system wait forever when the coordinator died first (CAF 0.17 keeps a reference to an
// actor whose handle went to a dead node).
caf::behavior rank_worker(caf::event_based_actor*, std::shared_ptr<rollout_side> side,
                          rank_hello hello, std::shared_ptr<report_outbox> box,
                          consumer_observer* observer) {
  const std::int32_t rank = hello.rank;
  return {
      [=](update_atom, const parsed_update_ptr& u) {
        if (!u || !token_matches(u->token, hello.token))
          return;  // only its endpoint knows it, and checked it
        std::vector<rank_report> out;
        // Reports name the attempt too (one of its shard ids), except a parse error's.
        const update_id attempt = u->shards.empty() ? update_id() : u->shards.front().update_id;
        auto report = [&](const std::string& key, const std::string& state, std::string reason,
                          double seconds = 0, std::string from = "", update_id id = "") {
          out.push_back(rank_report{hello.token, key, rank, state, std::move(reason),
                                    side->active_version(), seconds, std::move(from),
                                    id.empty() && key == u->key ? attempt : std::move(id)});
        };
        if (!u->error.empty()) {
          side->dropped(u->key);
          report(u->key, "rejected", u->error);
          // It holds nothing of this delivery; said unless it serves the key from another
          // (the release would name no attempt and could let that one go).
          if (!side->holds_key(u->key)) report(u->key, "released", "");
          box->put(std::move(out));
          return;
        }
        // The import of u->key ends at settle() below, right after the install (which never
        // throws); should building the shard list throw first (out of memory), it ends here
        // all the same, or held() would name the key for good and a restarted coordinator keep
        // its memory from the publishers.
        struct import_end {
          rollout_side& side;
          const std::string& key;
          bool settling = false;
          ~import_end() {
            if (!settling) side.dropped(key);
          }
        } ending{*side, u->key};
        // The ranks of this process share the decoded shards: none copies them.
        std::vector<manifest_ptr> shards;
        for (const auto& m : u->shards) shards.emplace_back(u, &m);
        auto r = side->executor.update_weights(std::span<const manifest_ptr>(shards));
        // The update this one replaced is let go before the answer, so the publisher can reuse
        // its memory by the time it hears the outcome. Settled before anything else can throw:
        // what the install holds must be on record.
        ending.settling = true;
        const auto released = side->settle(r, u->key);
        if (observer) {
          std::uint64_t bytes = 0;
          for (const auto& m : u->shards) bytes += m.total_bytes;
          observer->update_done(rank, u->key, r, bytes);
        }
        for (const auto& [key, id] : released) report(key, "released", "", 0, "", id);
        // Every report leaves when the import is over, so "importing" would tell the coordinator
        // nothing on its own: an acknowledgement carries the hop itself (a third fewer reports).
        auto from = import_source(*side, r.shard_ids);
        if (from.empty()) from = u->received_from;
        if (r.acknowledged) {
          side->serving(u);
          report(u->key, "acknowledged", "", r.timings.total, std::move(from));
        } else if (r.failure && r.failure->code == errc::unknown_update) {
          // The bytes are gone (publisher exited or rewrote the slot, and no peer had them):
          // nothing is wrong with the version, there is just nothing to install.
          report(u->key, "importing", std::move(from));
          report(u->key, "waiting",
                 "waiting for the next version: " + u->key + " is no longer held on this node (" +
                     r.failure->message + ")",
                 r.timings.total);
          // It holds nothing of it: said, for a coordinator that knows the key only as held
          // at this rank's re-join (its release names this attempt) — unless the rank holds
          // another attempt of the key, which that release could let go.
          if (!side->holds_key(u->key)) report(u->key, "released", "");
        } else {
          report(u->key, "importing", std::move(from));
          report(u->key, "rejected", r.failure ? r.failure->message : "unknown failure",
                 r.timings.total);
          // The executor gave back what it imported of a rejected update. When the import itself
          // failed, the rank says it let go all the same (else the coordinator counts it as a
          // holder, and a retry of the version waits for it forever) — unless it still serves
          // this very attempt from an earlier delivery (a catch-up of its active version): then
          // it does hold the memory, and the publishers must not reuse it. Another attempt of the
          // same version that it serves (from before a coordinator restart) is not this one: the
          // release names this attempt's id, which the coordinator keeps apart from the other.
          if (!r.released_self && !side->holds_any(u->shards)) report(u->key, "released", "");
        }
        if (r.released_self) report(u->key, "released", "");
        box->put(std::move(out));
      },
  };
}

}  // namespace wsync::consumer_detail
