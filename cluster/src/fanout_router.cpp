#include "wsync/cluster/fanout_router.hpp"

#include <functional>
#include <memory>

#include "wsync/transports/registry.hpp"

namespace wsync {

result<std::map<std::int32_t, std::string>> plan_handles(
    const fanout_plan& plan, const std::string& publisher_handle,
    const std::map<std::int32_t, std::string>& relay_address, const transport& t) {
  auto via = [&](const std::string& handle, std::int32_t relay) -> result<std::string> {
    auto it = relay_address.find(relay);
    if (it == relay_address.end() || it->second.empty()) {
      return make_error(errc::invalid_argument,
                        "plan: rank " + std::to_string(relay) + " relays but gave no address");
    }
    return t.handle_via_relay(handle, it->second);
  };
  // Within one stripe the sources form a tree, so this recursion ends at the publishers.
  std::map<std::pair<std::size_t, std::int32_t>, std::string> paths;
  std::function<result<std::string>(std::size_t, std::int32_t)> stripe_path =
      [&](std::size_t s, std::int32_t leader) -> result<std::string> {
    if (auto it = paths.find({s, leader}); it != paths.end()) return it->second;
    auto from = plan.stripes[s].at(leader);
    if (from < 0) return paths[{s, leader}] = publisher_handle;
    auto up = stripe_path(s, from);
    if (!up) return up;
    auto h = via(*up, from);
    if (!h) return h;
    return paths[{s, leader}] = *h;
  };
  std::map<std::int32_t, std::string> handles;
  std::function<result<std::string>(std::int32_t)> handle_of =
      [&](std::int32_t r) -> result<std::string> {
    if (auto it = handles.find(r); it != handles.end()) return it->second;
    const auto& hop = plan.hops.at(r);
    if (hop.leader && !plan.stripes.empty()) {
      std::vector<std::string> lanes;
      for (std::size_t s = 0; s < plan.stripes.size(); ++s) {
        auto h = stripe_path(s, r);
        if (!h) return h;
        lanes.push_back(*h);
      }
      auto striped = t.handle_striped(lanes);
      if (!striped) return striped;
      return handles[r] = *striped;
    }
    if (hop.from_publishers) return handles[r] = publisher_handle;
    auto up = handle_of(hop.from);
    if (!up) return up;
    auto h = via(*up, hop.from);
    if (!h) return h;
    return handles[r] = *h;
  };
  for (const auto& [rank, hop] : plan.hops) {
    if (auto h = handle_of(rank); !h) return h.error();
  }
  return handles;
}

update_router fanout_router(plan_shape shape, std::uint32_t degree) {
  auto cache = std::make_shared<plan_cache>();
  return [cache, shape, degree](const std::vector<weight_update_manifest>& shards,
                                const std::vector<route_member>& consumers,
                                const std::vector<route_member>& publishers)
             -> result<std::map<std::int32_t, routed_update>> {
    std::map<std::int32_t, std::string> relay_address;
    for (const auto& c : consumers) {
      if (c.address.empty()) return std::map<std::int32_t, routed_update>{};  // cannot relay
      relay_address[c.rank] = c.address;
    }
    if (shards.empty() || consumers.empty()) return std::map<std::int32_t, routed_update>{};
    auto t = make_transport(shards.front().transport);
    if (!t) return t.error();
    plan_request req;
    for (const auto& p : publishers) req.publishers.push_back({p.rank, p.node});
    for (const auto& c : consumers) req.consumers.push_back({c.rank, c.node});
    req.shape = shape;
    req.degree = degree;
    auto plan = cache->plan_for(req);
    if (!plan) return plan.error();
    std::map<std::int32_t, routed_update> routes;
    for (const auto& c : consumers) routes[c.rank].received_from = (*plan)->received_from(c.rank);
    for (const auto& shard : shards) {
      auto handles = plan_handles(**plan, shard.transport_handle, relay_address, **t);
      if (!handles) return handles.error();
      for (auto& [rank, handle] : *handles) {
        auto m = shard;
        m.transport_handle = std::move(handle);
        routes[rank].manifests.push_back(std::move(m));
      }
    }
    return routes;
  };
}

}  // namespace wsync
