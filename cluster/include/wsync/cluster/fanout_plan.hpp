#pragma once
// The fan-out planner (docs/cluster.md, "Fan-out plan"): a pure function from membership to the
// route every byte of an update takes. One leader per node receives over the network; leaders form
// a relay tree of a chosen degree (degree 1 is a chain, star puts every leader under the
// publishers); the other ranks of a node import from their leader over shared memory. Each
// publisher rank's shard follows the same tree, entering it at the top-level leaders.
//
// Promises (property-tested): every consumer gets every segment exactly once; no node receives
// a segment over the network twice; a tree's depth is at most ceil(log_d(nodes)) + 1. When a
// leader fails mid-update, replan() re-sources only its subtree and keeps every other rank's
// route, so nobody else restarts.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"

namespace wsync {

/// naive: no relay at all, every rank pulls every shard from its publisher (ranks x bytes
/// leave the publisher's node): the baseline the other shapes are measured against.
enum class plan_shape { tree, chain, star, naive };
/// "tree" | "chain" | "star" | "naive"
result<plan_shape> plan_shape_parse(const std::string& text);
const char* plan_shape_name(plan_shape shape);

struct plan_member {
  std::int32_t rank = 0;
  std::string node;
  friend bool operator==(const plan_member&, const plan_member&) = default;
};

struct plan_request {
  std::vector<plan_member> publishers;  ///< one per shard
  std::vector<plan_member> consumers;
  plan_shape shape = plan_shape::tree;
  std::uint32_t degree = 2;  ///< children per leader for tree; ignored for chain (1) and star
  friend bool operator==(const plan_request&, const plan_request&) = default;
};

/// Where one consumer rank takes its bytes from.
struct plan_hop {
  bool from_publishers = false;  ///< each shard straight from its publisher rank
  std::int32_t from = -1;        ///< otherwise: the consumer rank that relays every shard
  bool network = false;          ///< over the network (else shared memory on the node)
  std::uint32_t depth = 0;       ///< hops from the publishers
  bool leader = false;           ///< receives for its node
  friend bool operator==(const plan_hop&, const plan_hop&) = default;
};

struct fanout_plan {
  plan_request request;
  std::map<std::int32_t, plan_hop> hops;                       ///< consumer rank -> its source
  std::map<std::int32_t, std::vector<std::int32_t>> children;  ///< relay rank -> who it feeds
  std::map<std::string, std::int32_t> leader_of;               ///< node -> its leader rank
  /// Tree plans of degree d >= 2 over two or more nodes are striped: chunk i of the update
  /// travels in stripe i % d, and each stripe has its own tree over the leaders, rooted at one
  /// leader fed by the publishers, in which a different group of leaders relays. So every
  /// leader forwards about 1/d of the update to about d children, and every uplink (the
  /// publishers' too) carries the update about once, where one d-ary tree would make each relay
  /// send it d times. stripes[s]: leader rank -> the leader it takes stripe s from, -1 for the
  /// publishers. Empty for chains, stars and single nodes: `hops` is then the whole route.
  /// Members of a node take every stripe from their leader, as `hops` says.
  std::vector<std::map<std::int32_t, std::int32_t>> stripes;

  /// The ranks `rank` feeds, directly or through others.
  std::set<std::int32_t> subtree(std::int32_t rank) const;
  /// "received_from" as the status object shows it: "publisher:0,1" or "rank:5 (network)"; a
  /// striped leader lists its stripes' sources: "stripes: publisher:0 | rank:4 (network)".
  std::string received_from(std::int32_t rank) const;
};

/// Plans an update. Errors (invalid_argument, naming the field): no publisher, a rank listed
/// twice, an empty node name, degree 0 for a tree.
result<fanout_plan> plan_fanout(const plan_request& request);

/// The plan after `failed` (a consumer rank) died mid-update: a new leader for its node if one
/// is left, and its subtree re-sourced onto live ranks; every rank outside that subtree keeps
/// its hop. Error (invalid_argument) if `failed` is not in the plan.
result<fanout_plan> replan(const fanout_plan& plan, std::int32_t failed);

/// Plans once per membership: the plan is reused while the request stays the same.
class plan_cache {
 public:
  result<const fanout_plan*> plan_for(const plan_request& request);
  /// How many plans were computed (for tests and status).
  std::uint64_t computed() const { return computed_; }

 private:
  std::optional<fanout_plan> plan_;
  std::uint64_t computed_ = 0;
};

}  // namespace wsync
