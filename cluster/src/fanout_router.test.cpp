// The coordinator's router: which handle each consumer gets for a plan.

#include "wsync/cluster/fanout_router.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

// A ucx handle as a publisher writes it (addresses are opaque hex to the router).
std::string publisher_handle() {
  return nlohmann::json{{"address", "aa"},
                        {"chunk", 65536},
                        {"checksums", {{"0000000000000001", "0000000000000002"}}}}
      .dump();
}

weight_update_manifest shard(std::string transport, std::string handle) {
  weight_update_manifest m;
  m.update_id = "u-1";
  m.model_id = "m";
  m.weight_version = 1;
  m.transport = std::move(transport);
  m.transport_handle = std::move(handle);
  m.segments = {{100000}};
  return m;
}

// Four consumers on two nodes; their relay addresses "c0".."c3" are hex, as UCX's are.
std::vector<route_member> consumers() {
  return {{0, "n1", "c0"}, {1, "n1", "c1"}, {2, "n2", "c2"}, {3, "n2", "c3"}};
}

class fanout_router_test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!transport_known("ucx")) GTEST_SKIP() << "built without UCX (libucx-dev not found)";
  }
};

TEST_F(fanout_router_test, a_chain_points_each_rank_at_its_source_with_the_path_as_fallbacks) {
  auto route = fanout_router(plan_shape::chain, 1);
  auto routes = route({shard("ucx", publisher_handle())}, consumers(), {{0, "n0", ""}});
  ASSERT_TRUE(routes) << routes.error().message;
  ASSERT_EQ(routes->size(), 4u);
  auto handle = [&](std::int32_t r) {
    return nlohmann::json::parse(routes->at(r).manifests.at(0).transport_handle);
  };
  EXPECT_EQ(handle(0)["address"], "aa");
  EXPECT_EQ(handle(1)["address"], "c0");
  EXPECT_EQ(handle(1)["fallbacks"], nlohmann::json({"aa"}));
  EXPECT_EQ(handle(2)["address"], "c0");
  EXPECT_EQ(handle(3)["address"], "c2");
  EXPECT_EQ(handle(3)["fallbacks"], nlohmann::json({"c0", "aa"}));
  EXPECT_EQ(routes->at(0).received_from, "publisher:0");
  EXPECT_EQ(routes->at(2).received_from, "rank:0 (network)");
  EXPECT_EQ(routes->at(3).received_from, "rank:2 (shared memory)");
  // Everything but the handle is the publisher's manifest.
  auto m = routes->at(3).manifests.at(0);
  m.transport_handle = publisher_handle();
  EXPECT_EQ(m, shard("ucx", publisher_handle()));
}

TEST_F(fanout_router_test, a_tree_gives_leaders_one_source_per_stripe) {
  auto route = fanout_router(plan_shape::tree, 2);
  auto routes = route({shard("ucx", publisher_handle())}, consumers(), {{0, "n0", ""}});
  ASSERT_TRUE(routes) << routes.error().message;
  auto leader = nlohmann::json::parse(routes->at(0).manifests.at(0).transport_handle);
  ASSERT_EQ(leader["stripes"].size(), 2u);
  EXPECT_EQ(leader["stripes"][0]["address"], "aa");
  EXPECT_EQ(leader["stripes"][1]["address"], "c2");
  EXPECT_EQ(leader["stripes"][1]["fallbacks"], nlohmann::json({"aa"}));
  auto member = nlohmann::json::parse(routes->at(1).manifests.at(0).transport_handle);
  EXPECT_EQ(member["address"], "c0");
  EXPECT_FALSE(member.contains("stripes"));
  EXPECT_EQ(routes->at(2).received_from, "stripes: rank:0 (network) | publisher:0");
}

TEST_F(fanout_router_test, nothing_is_routed_when_a_consumer_cannot_relay) {
  auto route = fanout_router(plan_shape::tree, 2);
  auto cs = consumers();
  cs[3].address.clear();  // e.g. a shared-memory consumer
  auto routes = route({shard("ucx", publisher_handle())}, cs, {{0, "n0", ""}});
  ASSERT_TRUE(routes);
  EXPECT_TRUE(routes->empty());
  // A transport that cannot relay is refused by name, and the coordinator then routes nothing.
  auto refused = route({shard("shared-memory", "{}")}, consumers(), {{0, "n0", ""}});
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("shared-memory cannot relay"), std::string::npos)
      << refused.error().message;
}

}  // namespace
}  // namespace wsync
