#pragma once
// The coordinator's bookkeeping as a pure state machine: membership, the per-model version
// registry, update assembly from publisher shards, per-rank states with timestamps, commit,
// deadlines, failures, catch-up and release. No I/O and no CAF: the coordinator actor feeds it
// messages and the current time, and carries out the effects it returns. Deterministic, so it is
// tested message by message without sleeps.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

using coord_clock = std::chrono::steady_clock;

enum class rank_role { publisher, consumer };
std::string_view rank_role_name(rank_role r);

/// What a rank tells the coordinator when it joins.
struct rank_info {
  std::int32_t rank = 0;
  rank_role role = rank_role::consumer;
  std::string node;
  std::string model_id;
  std::vector<std::string> transports;
  std::string address;  ///< data-plane address, opaque here
  /// Publishers: how many ranks publish shards of this model (ranks 0..n-1). A version is
  /// complete when all n shards arrived, even from ranks that join late. 0: the publishers
  /// joined when the version's first shard arrives.
  std::int32_t publisher_ranks = 0;
  /// Consumers: the version the rank serves. A coordinator that restarted learns from it that
  /// versions up to this one were already used, so versions stay monotonic across restarts.
  std::uint64_t active_weight_version = 0;
  /// Consumers: the updates (keys) the rank still holds as it joins, imported or active. A rank
  /// that comes back (its link was lost, or it was stopped) keeps holding those the book knows,
  /// so their memory is not given back to the publishers until it lets go.
  std::vector<std::string> held;
};

/// A consumer rank's progress on one update: pending, importing, acknowledged, rejected,
/// failed or released, with the time of each state. `waiting`: the update's bytes were gone
/// (its publisher exited, or rewrote the slot, and no peer holds it): the rank holds nothing of
/// it and waits for the next version; an answer, like rejected, but nothing was wrong with it.
enum class rank_state { pending, importing, acknowledged, rejected, failed, released, waiting };
std::string_view rank_state_name(rank_state s);

struct rank_progress {
  rank_state state = rank_state::pending;
  bool acknowledged = false;  ///< stays true after release
  std::string reason;         ///< for rejected / failed
  std::string received_from;  ///< the hop the bytes came from, e.g. "publisher:0"
  double data_s = 0;          ///< the rank's own import-to-answer time, as it reported it
  /// Failed by the deadline while still joined (frozen, slow): it may be reading the update's
  /// memory yet, so the publishers keep it until the rank reports released or leaves.
  bool may_hold = false;
  /// The rank left after this entry was made: a rank of that number that joins again is a new
  /// process, which this entry does not describe.
  bool left = false;
  std::map<rank_state, coord_clock::time_point> at;
};

enum class update_phase { assembling, distributing, committed, aborted };
std::string_view update_phase_name(update_phase p);

/// One model version: the shards that make it up and every consumer's answer.
struct update_record {
  std::string key;  ///< "<model_id>@<weight_version>"
  std::string model_id;
  std::uint64_t weight_version = 0;
  std::set<std::int32_t> expected_publishers;
  std::map<std::int32_t, weight_update_manifest> shards;  ///< by publisher rank
  std::map<std::int32_t, rank_progress> consumers;
  update_phase phase = update_phase::assembling;
  std::string reason;  ///< why aborted
  coord_clock::time_point created, deadline;
  std::optional<coord_clock::time_point> finished;
  bool publishers_released = false;
  std::uint32_t attempt = 1;  ///< 2, 3, ...: a retry of a version that was aborted
  /// Learnt from a consumer that served it when it re-joined a restarted coordinator (adopt),
  /// not committed here: the book never releases its publishers' memory (publishers_released
  /// stays true); the coordinator keeps that memory as an orphan held by the ranks that read it.
  bool adopted = false;
  /// Running counts over `consumers`, kept by the book on every change, so that an answer costs
  /// O(log ranks) and not a walk of the table (1,024 ranks would make each update quadratic).
  struct tally {
    std::size_t unanswered = 0;    ///< pending or importing
    std::size_t acknowledged = 0;  ///< acknowledged at some point
    std::size_t holding = 0;       ///< ranks that may still read it (book_detail::may_read)
  } counts;
};

/// Effects the caller must carry out, in order.
struct book_effect {
  enum class kind {
    distribute,        ///< send `manifests` to each rank in `ranks`
    drop,              ///< tell `ranks` to drop what they imported of `key` (aborted)
    outcome,           ///< tell the publishers of `key` the final table (committed / aborted)
    release_publisher  ///< every consumer let go of `key`: publishers may reuse its memory
  };
  kind what;
  std::string key;
  std::vector<std::int32_t> ranks;
  std::vector<weight_update_manifest> manifests;
  /// distribute: a committed version sent to a rank that joined (catch-up), not a new one
  bool catch_up = false;
  /// outcome: the record as it finished, without its shards. The history may drop the record
  /// itself before the effect is carried out (another update finishing in the same call).
  std::shared_ptr<const update_record> record = nullptr;
  /// release_publisher: the update ids of the attempt's shards, so that a publisher holding a
  /// retry of the same key lets go of this attempt and not of the retry.
  std::vector<update_id> update_ids = {};
};

struct book_config {
  /// First shard to the last one, and then distribution to every answer.
  std::chrono::milliseconds update_deadline{30000};
  std::size_t history_per_model = 16;  ///< finished updates kept for status
  /// After the coordinator starts: how long updates it does not know (held by ranks of a
  /// coordinator before it) are kept at their publishers even when no rank that rejoined holds
  /// them, so that ranks still reconnecting (every 5 s at most) can say they do.
  std::chrono::milliseconds rejoin_grace{10000};
};

class coordinator_book {
 public:
  explicit coordinator_book(book_config config = {}) : config_(config) {}

  /// A rank joins (or re-joins after a crash). A consumer gets the latest committed version of
  /// its model (catch-up) as a distribute effect.
  result<std::vector<book_effect>> join(const rank_info& info, coord_clock::time_point now);

  /// A coordinator that restarted holds no manifests: consumer `rank` (joined) re-joined serving
  /// the version `shards` make up, which the book has no record of, nor of a newer committed
  /// one. The version becomes a committed, adopted record that catch-ups come from, the rank
  /// acknowledged in it; consumers that joined behind it get it as a catch-up (effects). No
  /// effects when there is nothing to adopt (the book knows the version, or a newer one); an
  /// error names the shard and field that make them unusable.
  result<std::vector<book_effect>> adopt(std::int32_t rank,
                                         const std::vector<weight_update_manifest>& shards,
                                         coord_clock::time_point now);

  /// A rank went away (down message, node lost, heartbeat timeout). A consumer is failed for
  /// every update in flight; a publisher's in-flight updates are aborted.
  std::vector<book_effect> leave(std::int32_t rank, rank_role role, const std::string& reason,
                                 coord_clock::time_point now);

  /// A publisher rank's shard. The version rule, per model: above the last committed version
  /// (and any version a joining consumer serves), not below a version in progress, and equal
  /// to one only while it assembles; a version that was aborted may be published again (a new
  /// attempt, with new update ids) once every rank let go of the aborted one. Shards must not
  /// share tensor names. When every expected publisher has sent its shard, the update is
  /// distributed to the live consumers.
  result<std::vector<book_effect>> publish(const weight_update_manifest& shard,
                                           coord_clock::time_point now);
  /// True when `shard` retries an aborted version that ranks still hold: publish() would refuse
  /// it now, and accept it once the release_publisher effect of that version came. False for a
  /// version a rank installed after the abort: publish() refuses that for good.
  bool retry_must_wait(const weight_update_manifest& shard) const;

  /// Consumer reports. Each names the update key and the rank; out-of-order reports are refused.
  result<std::vector<book_effect>> importing(const std::string& key, std::int32_t rank,
                                             std::string received_from,
                                             coord_clock::time_point now);
  /// `received_from`, when not empty, replaces where the rank said it imports from (a peer gave
  /// it the bytes instead).
  result<std::vector<book_effect>> acknowledged(const std::string& key, std::int32_t rank,
                                                coord_clock::time_point now, double data_s = 0,
                                                std::string received_from = "");
  result<std::vector<book_effect>> waiting(const std::string& key, std::int32_t rank,
                                           std::string reason, coord_clock::time_point now);
  result<std::vector<book_effect>> rejected(const std::string& key, std::int32_t rank,
                                            std::string reason, coord_clock::time_point now);
  result<std::vector<book_effect>> released(const std::string& key, std::int32_t rank,
                                            coord_clock::time_point now);

  /// Fails what missed its deadline: unanswered consumers become failed, unfinished assembly
  /// is aborted. Call periodically.
  std::vector<book_effect> expire(coord_clock::time_point now);

  const update_record* find(const std::string& key) const;
  /// The consumer ranks that may still read the memory of `key` (the attempt the book tracks).
  std::vector<std::int32_t> holders(const std::string& key) const;
  const book_config& config() const { return config_; }
  /// Newest committed version of a model, if any.
  const update_record* latest_committed(const std::string& model_id) const;
  /// The highest version of a model in use: committed here, served by a consumer as it joined,
  /// or installed by one after its abort. A publish must go above it (0: none yet).
  std::uint64_t used_version(const std::string& model_id) const;
  /// Updates of a model, oldest first.
  std::vector<const update_record*> updates(const std::string& model_id) const;
  const std::map<std::int32_t, rank_info>& consumers() const { return consumers_; }
  /// The live consumer ranks of `model_id` that speak `transport`, ascending: who a collective
  /// transport's next update goes to (docs/transports.md, "The nccl transport").
  std::vector<std::int32_t> consumers_of(const std::string& model_id,
                                         const std::string& transport) const;
  const std::map<std::int32_t, rank_info>& publishers() const { return publishers_; }
  /// For tests: whether every update's running counts match a walk of its table.
  bool counts_consistent() const;

 private:
  using effects = std::vector<book_effect>;
  struct entry {
    update_record* update;
    rank_progress* progress;
  };
  result<entry> consumer_entry(const std::string& key, std::int32_t rank);
  /// consumer_entry for an answer (`verb`: "acknowledge", ...): refused unless the rank is
  /// pending or importing, or answers a catch-up the deadline failed (then no longer may_hold).
  result<entry> answering(const std::string& key, std::int32_t rank, const char* verb);
  /// A consumer silent past a deadline: failed with `reason`, and still counted as holding the
  /// update's memory while it is joined.
  void fail_silent(update_record& u, std::int32_t rank, rank_progress& p, const char* reason,
                   coord_clock::time_point now);
  /// Every change of a consumer's progress goes through these two, which keep `counts` true.
  void set_state(update_record& u, rank_progress& p, rank_state s, coord_clock::time_point now);
  void set_may_hold(update_record& u, rank_progress& p, bool may_hold);
  bool rejoined_mid_update(update_record& u, rank_progress& p, const rank_info& info,
                           coord_clock::time_point now, std::vector<book_effect>& out);
  void distribute(update_record& u, coord_clock::time_point now, effects& out);
  void check_finished(update_record& u, coord_clock::time_point now, effects& out);
  void catch_up_joined_meanwhile(update_record& u, coord_clock::time_point now, effects& out);
  // Sends committed update `u` to `ranks` again as a catch-up: fresh pending entries, its
  // memory held again until they answer.
  void catch_up(update_record& u, std::vector<std::int32_t> ranks, coord_clock::time_point now,
                effects& out);
  void abort(update_record& u, const std::string& reason, coord_clock::time_point now,
             effects& out);
  void check_released(update_record& u, effects& out);
  /// Fails the catch-ups of committed `u` that went unanswered past the update deadline.
  void expire_catch_ups(update_record& u, coord_clock::time_point now, effects& out);
  void collect_garbage(const std::string& model_id, const update_record* keep);
  update_record* latest_committed_mutable(const std::string& model_id);

  book_config config_;
  std::map<std::int32_t, rank_info> consumers_, publishers_;  ///< live ranks
  std::map<std::string, update_record> updates_;              ///< by key
  /// Per model: the highest version committed here or served by a consumer that joined.
  std::map<std::string, std::uint64_t> committed_version_;
  /// `version` of `model_id` is in use (committed, served, installed after its abort): raises
  /// committed_version_, which publish() must go above.
  void mark_used(const std::string& model_id, std::uint64_t version) {
    auto& v = committed_version_[model_id];
    v = std::max(v, version);
  }
  /// Per model: the highest version this book made a record of (published or adopted).
  std::map<std::string, std::uint64_t> recorded_version_;
  std::map<std::string, std::int32_t> publisher_ranks_;  ///< per model, when declared
};

}  // namespace wsync
