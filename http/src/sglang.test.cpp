// SGLang's weight-update calls, the weight version label and the weight checker, call by call on
// the HTTP-free service. A publisher in this process feeds it over shared memory.

#include <gtest/gtest.h>
#include <openssl/evp.h>

#include <cstdio>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>

#include "held_publisher.hpp"
#include "pattern_tensors.hpp"
#include "wsync/http/weight_transfer.hpp"
#include "wsync/manifest/codec.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string sha256_of(const tensor_source& t) {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_Digest(t.data, t.nbytes, d, &n, EVP_sha256(), nullptr);
  std::string hex;
  char b[3];
  for (unsigned i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", d[i]);
    hex += b;
  }
  return hex;
}

class sglang_test : public ::testing::Test {
 protected:
  void SetUp() override {
    publisher_ = test::held_shm_publisher("m");
    ASSERT_TRUE(publisher_);
  }
  void TearDown() override {
    if (publisher_) test::release_held(*publisher_);
  }

  json manifest(std::uint64_t version) {
    auto m = publisher_->publish(tensors_.fill(version), version, {0});
    EXPECT_TRUE(m) << m.error().message;
    return m ? json::parse(manifest_to_json(*m)) : json();
  }
  // SGLang's update call as a trainer makes it, with wsync's manifest beside names/dtypes/shapes.
  json update_body(const json& m) const {
    json names = json::array(), dtypes = json::array(), shapes = json::array();
    for (const auto& t : m["tensors"]) {
      names.push_back(t["name"]);
      dtypes.push_back("int64");
      shapes.push_back(t["shape"]);
    }
    return {{"names", names},
            {"dtypes", dtypes},
            {"shapes", shapes},
            {"group_name", "weight_update_group"},
            {"flush_cache", true},
            {"abort_all_requests", false},
            {"weight_version", nullptr},
            {"load_format", nullptr},
            {"manifest", m}};
  }
  static json body(const http_reply& r) { return json::parse(r.body); }
  // Waits (up to 10 s) until a generation runs on the service.
  // Generation steps served so far (the metric).
  std::uint64_t generation_steps() {
    const std::string name = "\nwsync_generation_steps_total ";
    auto text = service_.metrics();
    auto at = text.find(name);
    return at == std::string::npos ? 0 : std::stoull(text.substr(at + name.size()));
  }
  // Until a generation runs and has read a version: a pause that came between its start and its
  // first step would otherwise hold it before it saw the version the test means (seen under
  // ASan on a loaded machine).
  void wait_for_generation() {
    const std::string running = "\nwsync_generations_in_flight 1\n";
    const auto before = generation_steps();
    for (int i = 0; i < 10000 && (service_.metrics().find(running) == std::string::npos ||
                                  generation_steps() == before);
         ++i) {
      std::this_thread::sleep_for(1ms);
    }
  }
  void init() {
    auto r = service_.sglang_init_group(R"({"backend": "shared-memory"})");
    ASSERT_EQ(r.status, 200) << r.body;
  }

  test::pattern_tensors tensors_{4, 512};
  std::unique_ptr<weight_publisher> publisher_;
  weight_transfer_service service_{weight_transfer_config{}};
};

TEST_F(sglang_test, nccl_rendezvous_is_refused_as_blocked) {
  auto r = service_.sglang_init_group(
      R"({"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(body(r)["success"], false);
  EXPECT_NE(body(r)["message"].get<std::string>().find("master_address: blocked:"),
            std::string::npos);
  r = service_.sglang_init_group(R"({"group_name": "g"})");  // SGLang's default backend: nccl
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("backend: blocked:"), std::string::npos) << r.body;
  r = service_.sglang_init_group(R"({"backend": "carrier-pigeon"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("unknown transport"), std::string::npos) << r.body;
}

TEST_F(sglang_test, an_update_installs_and_its_weight_version_label_shows) {
  init();
  auto b = update_body(manifest(1));
  b["weight_version"] = "step_1";
  auto r = service_.sglang_update(b.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["success"], true);
  EXPECT_EQ(service_.active_version(), 1u);
  auto info = body(service_.sglang_model_info());
  EXPECT_EQ(info["weight_version"], "step_1");
  EXPECT_EQ(info["model_path"], "m");
  EXPECT_EQ(body(service_.weight_info())["weight_version"], "step_1");
  // A new version without a label shows its number; a label set later names the active one.
  ASSERT_EQ(service_.sglang_update(update_body(manifest(2)).dump()).status, 200);
  EXPECT_EQ(body(service_.weight_info())["weight_version"], "2");
  ASSERT_EQ(service_.update_weight_version(R"({"new_version": "rl-step-2"})").status, 200);
  EXPECT_EQ(body(service_.sglang_model_info())["weight_version"], "rl-step-2");
}

TEST_F(sglang_test, bad_bodies_are_refused_naming_the_field_and_change_nothing) {
  init();
  auto m1 = manifest(1);
  ASSERT_EQ(service_.sglang_update(update_body(m1).dump()).status, 200);
  auto m2 = manifest(2);
  auto refused = [&](json b, const std::string& text) {
    auto r = service_.sglang_update(b.dump());
    EXPECT_EQ(r.status, 400) << text;
    EXPECT_EQ(body(r)["success"], false) << text;
    EXPECT_NE(body(r)["message"].get<std::string>().find(text), std::string::npos) << r.body;
  };
  auto with = [&](const char* key, json value) {
    auto b = update_body(m2);
    b[key] = std::move(value);
    return b;
  };
  refused(with("group_name", "other"), "group_name: no weight update group \"other\"");
  refused(with("flush_cache", "yes"), "flush_cache: must be a boolean");
  refused(with("abort_all_requests", 1), "abort_all_requests: must be a boolean");
  refused(with("weight_version", json::object()), "weight_version: must be a string");
  refused(with("load_format", "flattened_bucket"), "load_format: \"flattened_bucket\"");
  refused(with("dtypes", json::array({"float32", "int64", "int64", "int64"})),
          "dtypes[0]: float32 differs from the manifest's i64");
  refused(with("names", json::array({"nope"})), "dtypes: has 4 entries, names has 1");
  refused(with("shapes", json::array({{1}, {512}, {512}, {512}})), "shapes[0]: differs");
  // A chunk's refusal names the update and this rank too.
  refused(with("shapes", json::array({{1}, {512}, {512}, {512}})),
          "(update_id=" + m2["update_id"].get<std::string>() + " rank=0)");
  refused(with("manifest", json::array()), "manifest: an empty list");
  auto no_manifest = update_body(m2);
  no_manifest.erase("manifest");
  refused(no_manifest, "manifest: missing");
  // Refusals before the update is known name this rank.
  refused(no_manifest, "(rank=0)");
  refused(with("flush_cache", "yes"), "flush_cache: must be a boolean (rank=0)");
  refused(update_body(m1), "weight_version must increase monotonically");
  EXPECT_EQ(service_.sglang_update("{\"names\":").status, 400);
  EXPECT_EQ(body(service_.sglang_update("[]"))["message"], "body: must be a JSON object (rank=0)");
  EXPECT_EQ(service_.active_version(), 1u);

  // torch's spelling of a dtype is accepted; a list of manifests is one update of many shards.
  auto b = with("dtypes", json::array({"torch.int64", "int64", "int64", "int64"}));
  b["manifest"] = json::array({m2});
  auto r = service_.sglang_update(b.dump());
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(service_.active_version(), 2u);
}

TEST_F(sglang_test, a_failed_install_answers_400_and_keeps_the_previous_version) {
  init();
  ASSERT_EQ(service_.sglang_update(update_body(manifest(1)).dump()).status, 200);
  auto bad = manifest(2);
  bad["tensors"][0]["checksum"] = "0000000000000001";
  auto r = service_.sglang_update(update_body(bad).dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("tensor checksum mismatch"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("version 1 stays active"), std::string::npos) << r.body;
  EXPECT_EQ(service_.active_version(), 1u);
}

TEST_F(sglang_test, destroying_the_group_keeps_the_weights_and_refuses_updates_until_init) {
  init();
  ASSERT_EQ(service_.sglang_update(update_body(manifest(1)).dump()).status, 200);
  EXPECT_EQ(service_.sglang_destroy_group(R"({"group_name": "other"})").status, 400);
  EXPECT_EQ(service_.sglang_destroy_group(R"({"group_name": "weight_update_group"})").status, 200);
  EXPECT_EQ(service_.sglang_destroy_group("{}").status, 400);  // gone already
  auto m2 = manifest(2);
  auto r = service_.sglang_update(update_body(m2).dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("call /init_weights_update_group first"), std::string::npos) << r.body;
  EXPECT_EQ(service_.active_version(), 1u);
  auto g = body(service_.generate(R"({"steps": 1, "step_ms": 0})"));
  EXPECT_EQ(g["weight_versions"], json::array({1}));  // still served
  init();
  EXPECT_EQ(service_.sglang_update(update_body(m2).dump()).status, 200);
}

TEST_F(sglang_test, pause_modes_map_onto_wsyncs_and_abort_all_requests_ends_generations) {
  init();
  ASSERT_EQ(service_.sglang_update(update_body(manifest(1)).dump()).status, 200);
  for (const char* mode : {"abort", "retract", "in_place"}) {
    auto r = service_.sglang_pause(json{{"mode", mode}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(body(r)["status"], "ok");
    EXPECT_EQ(body(service_.is_paused())["is_paused"], true);
    EXPECT_EQ(service_.sglang_continue("{}").status, 200);
    EXPECT_EQ(body(service_.is_paused())["is_paused"], false);
  }
  EXPECT_EQ(service_.sglang_pause("").status, 200);  // no body: abort, SGLang's default
  EXPECT_EQ(service_.sglang_continue("").status, 200);
  auto bad = service_.sglang_pause(R"({"mode": "sideways"})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_NE(bad.body.find("is not one of abort, retract, in_place"), std::string::npos);
  EXPECT_EQ(service_.sglang_pause(R"({"mode": 3})").status, 400);

  // in_place keeps a live generation: it goes on after /continue_generation on the new version.
  auto held = std::async(std::launch::async, [&] {
    return body(service_.generate(R"({"steps": 400, "step_ms": 1})"));
  });
  wait_for_generation();
  ASSERT_EQ(service_.sglang_pause(R"({"mode": "in_place"})").status, 200);
  ASSERT_EQ(service_.sglang_update(update_body(manifest(2)).dump()).status, 200);
  ASSERT_EQ(service_.sglang_continue("{}").status, 200);
  auto r = held.get();
  EXPECT_EQ(r["status"], "completed");
  EXPECT_EQ(r["weight_versions"], json::array({1, 2}));

  // abort_all_requests ends what runs, installs, and leaves generation running.
  auto live = std::async(std::launch::async, [&] {
    return body(service_.generate(R"({"steps": 100000, "step_ms": 1})"));
  });
  wait_for_generation();
  auto b = update_body(manifest(3));
  b["abort_all_requests"] = true;
  ASSERT_EQ(service_.sglang_update(b.dump()).status, 200);
  EXPECT_EQ(live.get()["status"], "aborted");
  EXPECT_EQ(body(service_.is_paused())["is_paused"], false);
  EXPECT_EQ(service_.active_version(), 3u);

  // abort_all_requests aborts generations a pause keeps too, and the trainer's pause stays.
  auto kept = std::async(std::launch::async, [&] {
    return body(service_.generate(R"({"steps": 100000, "step_ms": 1})"));
  });
  wait_for_generation();
  ASSERT_EQ(service_.sglang_pause(R"({"mode": "in_place"})").status, 200);
  b = update_body(manifest(4));
  b["abort_all_requests"] = true;
  ASSERT_EQ(service_.sglang_update(b.dump()).status, 200);
  EXPECT_EQ(kept.get()["status"], "aborted");
  EXPECT_EQ(body(service_.is_paused())["is_paused"], true);
  EXPECT_EQ(service_.sglang_continue("{}").status, 200);
}

TEST_F(sglang_test, the_weight_checker_proves_the_served_bytes) {
  init();
  ASSERT_EQ(service_.sglang_update(update_body(manifest(1)).dump()).status, 200);
  json expected = json::object();
  for (const auto& t : tensors_.sources()) expected[t.name] = sha256_of(t);

  auto r = service_.weight_checker(R"({"action": "checksum"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["checksums"], expected);
  EXPECT_EQ(body(r)["weight_version"], 1);

  auto compare = [&](const json& baseline) {
    json b = {{"action", "compare"}};
    if (!baseline.is_null()) b["baseline"] = baseline;
    return service_.weight_checker(b.dump());
  };
  EXPECT_EQ(body(compare(expected))["match"], true);
  EXPECT_EQ(body(compare(nullptr))["match"], true);  // against the last checksum taken

  // The trainer moves on to version 2: the rollout still serving 1 is caught, tensor by tensor.
  tensors_.fill(2);
  json newer = json::object();
  for (const auto& t : tensors_.sources()) newer[t.name] = sha256_of(t);
  auto m = body(compare(newer));
  EXPECT_EQ(m["match"], false);
  ASSERT_EQ(m["mismatches"].size(), 4u);
  EXPECT_EQ(m["mismatches"][0]["name"], "model.layers.0.weight");
  EXPECT_EQ(m["mismatches"][0]["actual"], expected["model.layers.0.weight"]);
  EXPECT_EQ(m["mismatches"][0]["expected"], newer["model.layers.0.weight"]);
  auto extra = expected;
  extra["lm_head.weight"] = std::string(64, 'A');  // upper case is accepted
  m = body(compare(extra));
  EXPECT_EQ(m["match"], false);
  ASSERT_EQ(m["mismatches"].size(), 1u);
  EXPECT_EQ(m["mismatches"][0]["actual"], nullptr);

  EXPECT_EQ(body(service_.weight_checker(R"({"action": "reset"})"))["status"], "reset");
  r = compare(nullptr);
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("baseline: missing"), std::string::npos);
  EXPECT_EQ(service_.weight_checker(R"({"action": "snapshot"})").status, 400);
  EXPECT_EQ(service_.weight_checker(R"({})").status, 400);
  EXPECT_EQ(service_.weight_checker(R"({"action": "checksum", "rank": 7})").status, 400);
  r = compare(json{{"a", "zz"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("baseline.a: must be a SHA-256 digest"), std::string::npos);
  r = service_.update_weight_version(R"({"new_version": 3})");
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("new_version: must be a non-empty string"), std::string::npos);
}

}  // namespace
}  // namespace wsync
