#pragma once
// The fan-out planner put to work: each consumer's handles pointed at its source in the plan.

#include <cstdint>
#include <map>
#include <string>

#include "wsync/actors/node.hpp"
#include "wsync/cluster/fanout_plan.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync {

/// Each consumer's handle for one shard whose publisher handle is `publisher_handle`: a leader
/// of a striped plan pulls each stripe along that stripe's tree, every other rank from its
/// source in `plan.hops`, each with the path up to the publisher as fallbacks. `relay_address`
/// names every consumer that is anyone's source. Errors: a source without an address, or a
/// transport that cannot relay.
result<std::map<std::int32_t, std::string>> plan_handles(
    const fanout_plan& plan, const std::string& publisher_handle,
    const std::map<std::int32_t, std::string>& relay_address, const transport& t);

/// The coordinator's router over the fan-out planner (`wsync coordinator --plan`): plans once
/// per membership and routes each update along the plan when its shards' transport relays and
/// every consumer gave a relay address; otherwise it routes nothing, and every consumer pulls
/// from the publishers.
update_router fanout_router(plan_shape shape, std::uint32_t degree);

}  // namespace wsync
