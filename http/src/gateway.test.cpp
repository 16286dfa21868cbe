// The HTTP surface over loopback with httplib's client: pause modes with live generations, and
// 32 clients hammering /status and /metrics while updates install. A publisher in this process
// feeds it over shared memory (the consumer side maps the segments as another process would).

#include "wsync/http/gateway.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "held_publisher.hpp"
#include "pattern_tensors.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/transports/nccl.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

class http_gateway_test : public ::testing::Test {
 protected:
  void SetUp() override {
    publisher_ = test::held_shm_publisher("m");
    ASSERT_TRUE(publisher_);
    auto port = gateway_.start();
    ASSERT_TRUE(port) << port.error().message;
    port_ = *port;
    ASSERT_EQ(post_status("/init_weight_transfer_engine", R"({"init_info":{}})"), 200);
  }
  void TearDown() override {
    gateway_.stop();
    if (publisher_) test::release_held(*publisher_);
  }

  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(30, 0);
    return c;
  }
  // With 32 clients hammering the server on a loaded 2-core machine, a connect may be refused
  // (the listen backlog is full); only then is the request tried again, as it never arrived.
  httplib::Result post(const std::string& path, const std::string& body = "") const {
    for (int attempt = 0;; ++attempt) {
      auto r = client().Post(path.c_str(), body, "application/json");
      if (r || r.error() != httplib::Error::Connection || attempt == 20) return r;
      std::this_thread::sleep_for(50ms);
    }
  }
  // The status of a POST, or 0 (and a failure naming the error) when no answer came.
  int post_status(const std::string& path, const std::string& body = "") const {
    auto r = post(path, body);
    EXPECT_TRUE(r) << path << ": " << httplib::to_string(r.error());
    return r ? r->status : 0;
  }
  json get_json(const std::string& path) const {
    auto r = client().Get(path.c_str());
    return r ? json::parse(r->body) : json();
  }

  // start -> update(manifest of `version`) -> finish; returns finish's status.
  int install(std::uint64_t version, const std::string& finish_body = "") {
    auto m = publisher_->publish(tensors_.fill(version), version, {0});
    EXPECT_TRUE(m) << m.error().message;
    if (!m) return 0;
    EXPECT_EQ(post_status("/start_weight_update"), 200);
    auto body = json{{"update_info", {{"manifest", json::parse(manifest_to_json(*m))}}}}.dump();
    EXPECT_EQ(post_status("/update_weights", body), 200);
    auto r = post("/finish_weight_update", finish_body);
    // The previous version's slot goes back once this one is active.
    if (r && r->status == 200 && previous_) (void)publisher_->release(*previous_);
    if (r && r->status == 200) previous_ = m->update_id;
    return r ? r->status : 0;
  }

  // A generation of `steps` steps over HTTP, run in the background.
  std::future<json> generate(int steps, int step_ms) const {
    return std::async(std::launch::async, [this, steps, step_ms] {
      auto r = post("/generate", json{{"steps", steps}, {"step_ms", step_ms}}.dump());
      return r ? json::parse(r->body) : json();
    });
  }
  void wait_in_flight(int n) const {
    for (int i = 0; i < 2000 && service_metric("wsync_generations_in_flight") < n; ++i) {
      std::this_thread::sleep_for(1ms);
    }
  }
  double service_metric(const std::string& name) const {
    auto text = client().Get("/metrics")->body;
    auto at = text.find("\n" + name + " ");
    return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
  }

  test::pattern_tensors tensors_{8, 4096};
  std::unique_ptr<weight_publisher> publisher_;
  std::optional<update_id> previous_;
  weight_transfer_service service_{weight_transfer_config{}};
  http_gateway gateway_{service_, http_options{}};
  std::uint16_t port_ = 0;
};

TEST_F(http_gateway_test, abort_fails_live_generations_with_a_clear_status) {
  ASSERT_EQ(install(1), 200);
  auto g = generate(100000, 1);
  wait_in_flight(1);
  EXPECT_EQ(post_status("/pause?mode=abort"), 200);  // returns once the generation ended
  auto r = g.get();
  EXPECT_EQ(r["status"], "aborted");
  EXPECT_EQ(r["finish_reason"], "abort");
  EXPECT_EQ(r["weight_versions"], json::array({1}));
  EXPECT_EQ(get_json("/is_paused")["is_paused"], true);
  EXPECT_EQ(post_status("/resume"), 200);
}

TEST_F(http_gateway_test, wait_drains_live_generations_then_an_update_installs_and_keep_resumes) {
  ASSERT_EQ(install(1), 200);
  auto g = generate(40, 2);
  wait_in_flight(1);
  auto first = std::async(std::launch::async, [&] { return post_status("/pause?mode=wait"); });
  while (!get_json("/is_paused")["is_paused"].get<bool>()) std::this_thread::sleep_for(1ms);
  // A second caller (or a retry) may update once answered: it too waits for the drain, and its
  // mode changes nothing.
  EXPECT_EQ(post_status("/pause?mode=keep"), 200);
  EXPECT_EQ(service_metric("wsync_generations_in_flight"), 0);
  EXPECT_EQ(first.get(), 200);  // returns after the generation completed
  auto drained = g.get();
  EXPECT_EQ(drained["status"], "completed");
  EXPECT_EQ(drained["steps_done"], 40);
  ASSERT_EQ(install(2), 200);  // while paused: nothing reads
  EXPECT_EQ(post_status("/resume"), 200);

  // keep: a held generation sees version 2, then 3 after the update and resume.
  auto held = generate(60, 2);
  wait_in_flight(1);
  EXPECT_EQ(post_status("/pause?mode=keep"), 200);
  ASSERT_EQ(install(3), 200);
  EXPECT_EQ(post_status("/resume"), 200);
  auto r = held.get();
  EXPECT_EQ(r["status"], "completed");
  EXPECT_EQ(r["steps_done"], 60);
  EXPECT_EQ(r["weight_versions"], json::array({2, 3}));  // one version per step, never mixed
}

TEST_F(http_gateway_test, a_generation_for_a_rank_not_served_is_refused_at_once_while_paused) {
  ASSERT_EQ(install(1), 200);
  ASSERT_EQ(post_status("/pause"), 200);
  auto c = client();
  c.set_read_timeout(5, 0);  // before the fix it waited for a resume that never came
  auto r = c.Post("/generate", json{{"rank", 99}}.dump(), "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"], "rank: 99 is not served here");
  EXPECT_EQ(post_status("/resume"), 200);
}

TEST_F(http_gateway_test, metrics_write_a_version_as_the_integer_it_is) {
  ASSERT_EQ(install(1234567), 200);
  auto text = client().Get("/metrics")->body;
  EXPECT_NE(text.find("\nwsync_active_weight_version 1234567\n"), std::string::npos) << text;
}

// A shard the install would refuse at finish (a second one from a source rank, a tensor sent
// twice) is refused when it comes, with the update still open for the right one.
TEST_F(http_gateway_test, a_shard_that_repeats_a_source_rank_or_a_tensor_is_refused_at_once) {
  auto m = publisher_->publish(tensors_.fill(2), 2, {0});
  ASSERT_TRUE(m) << m.error().message;
  const auto manifest = json::parse(manifest_to_json(*m));
  auto body = [](const json& mj) {
    return json{{"update_info", {{"manifest", mj}}}}.dump();
  };
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  ASSERT_EQ(post_status("/update_weights", body(manifest)), 200);
  auto again = manifest;  // a restarted publisher's new attempt at the same shard
  auto id = again["update_id"].get<std::string>();
  id.back() = id.back() == '0' ? '1' : '0';
  again["update_id"] = id;
  auto r = post("/update_weights", body(again));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"],
            "update_info.manifest.source_rank: 0 sent a shard of this update already (update_id=" +
                m->update_id + ") (update_id=" + id + " rank=0)");
  again["source_rank"] = 1;
  r = post("/update_weights", body(again));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"], "update_info.manifest.tensors: \"" + m->tensors[0].name +
                                               "\" came in an earlier shard of this update "
                                               "(update_id=" +
                                               id + " rank=0)");
  EXPECT_EQ(get_json("/status")["phase"], "started");
  EXPECT_EQ(post_status("/finish_weight_update"), 200);  // the first shard installs
  EXPECT_EQ(get_json("/status")["active_weight_version"], 2);
}

// A version whose install failed (here: a corrupted checksum) is taken again with a new update
// id once the trainer retries it; the active one is kept meanwhile.
TEST_F(http_gateway_test, a_failed_version_is_retried) {
  ASSERT_EQ(install(2), 200);
  auto bad = publisher_->publish(tensors_.fill(3), 3, {0});
  ASSERT_TRUE(bad) << bad.error().message;
  auto corrupted = json::parse(manifest_to_json(*bad));
  corrupted["tensors"][0]["checksum"] = "0123456789abcdef";
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  ASSERT_EQ(post_status("/update_weights", json{{"update_info", {{"manifest", corrupted}}}}.dump()),
            200);
  auto failed = post("/finish_weight_update");
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->status, 500);
  EXPECT_NE(failed->body.find("version 2 stays active"), std::string::npos) << failed->body;
  ASSERT_TRUE(publisher_->release(bad->update_id));
  EXPECT_EQ(install(3), 200);
  auto status = get_json("/status");
  EXPECT_EQ(status["active_weight_version"], 3);
  // The retry's answer replaces the failed one: version 3 shows committed, not rejected.
  const auto& last = status["updates"].back();
  EXPECT_EQ(last["weight_version"], 3);
  EXPECT_EQ(last["phase"], "committed") << last.dump();
  EXPECT_EQ(last["ranks"].size(), 1u) << last.dump();
  EXPECT_EQ(status["status"], "pass");
  // 3 again is old now.
  auto again = publisher_->publish(tensors_.fill(3), 3, {0});
  ASSERT_FALSE(again);  // the publisher still holds the active 3
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  auto old = json::parse(manifest_to_json(*bad));
  old["update_id"] = update_id_generate();
  auto refused = post("/update_weights", json{{"update_info", {{"manifest", old}}}}.dump());
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 400);
  EXPECT_NE(refused->body.find("weight_version must increase monotonically"), std::string::npos)
      << refused->body;
}

// A trainer that restarts mid-update calls init again: what its last life sent is dropped
// (finishing it would install part of an update), the active version stays, and the phase is
// ready for a new start. A refused init (another transport) changes nothing.
TEST_F(http_gateway_test, an_init_while_an_update_is_started_drops_that_update) {
  ASSERT_EQ(install(1), 200);
  auto m = publisher_->publish(tensors_.fill(2), 2, {0});
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  const auto manifest = json::parse(manifest_to_json(*m));
  ASSERT_EQ(post_status("/update_weights", json{{"update_info", {{"manifest", manifest}}}}.dump()),
            200);
  EXPECT_EQ(
      post_status("/init_weight_transfer_engine", R"({"init_info":{"transport":"file-mmap"}})"),
      400);
  EXPECT_EQ(get_json("/status")["phase"], "started");
  ASSERT_EQ(post_status("/init_weight_transfer_engine", R"({"init_info":{}})"), 200);
  EXPECT_EQ(get_json("/status")["phase"], "ready");
  EXPECT_EQ(post_status("/finish_weight_update"), 409);  // nothing left to finish
  EXPECT_EQ(get_json("/status")["active_weight_version"], 1);
  // The same version comes again, whole, from the new start.
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  ASSERT_EQ(post_status("/update_weights", json{{"update_info", {{"manifest", manifest}}}}.dump()),
            200);
  ASSERT_EQ(post_status("/finish_weight_update"), 200);
  EXPECT_EQ(get_json("/status")["active_weight_version"], 2);
  ASSERT_TRUE(publisher_->release(*previous_));
  previous_ = m->update_id;
}

TEST_F(http_gateway_test, finish_takes_the_manifests_number_or_a_free_form_label) {
  ASSERT_EQ(install(1, R"({"weight_version": "1"})"), 200);
  EXPECT_EQ(get_json("/weight_info")["weight_version"], "1");
  // vLLM's weight_version is free text: anything but a number labels the version.
  ASSERT_EQ(install(2, R"({"weight_version": "step-12"})"), 200);
  EXPECT_EQ(get_json("/weight_info")["weight_version"], "step-12");
  EXPECT_EQ(get_json("/status")["active_weight_version"], 2);
  // A number that is not the manifests' contradicts them.
  auto m = publisher_->publish(tensors_.fill(3), 3, {0});
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  ASSERT_EQ(
      post_status("/update_weights",
                  json{{"update_info", {{"manifest", json::parse(manifest_to_json(*m))}}}}.dump()),
      200);
  auto r = post("/finish_weight_update", R"({"weight_version": "4"})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"].get<std::string>().rfind(
                "weight_version: \"4\" differs from the manifests' 3", 0),
            0u)
      << r->body;
}

TEST_F(http_gateway_test, thirty_two_clients_hammer_status_and_metrics_during_updates) {
  ASSERT_EQ(install(1), 200);
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, answered{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < 32; ++i) {
    clients.emplace_back([&, i] {
      auto c = client();
      while (!stop) {
        auto r = c.Get(i % 2 ? "/status" : "/metrics");
        if (!r || r->status != 200) {
          ++bad;
          continue;
        }
        if (i % 2) {
          auto j = json::parse(r->body, nullptr, false);
          if (j.is_discarded() || !j.contains("active_weight_version")) ++bad;
        } else if (r->body.find("wsync_active_weight_version") == std::string::npos) {
          ++bad;
        }
        ++answered;
      }
    });
  }
  for (std::uint64_t v = 2; v <= 6; ++v) EXPECT_EQ(install(v), 200);
  stop = true;
  for (auto& t : clients) t.join();
  EXPECT_EQ(bad, 0);
  EXPECT_GT(answered, 32);
  EXPECT_EQ(get_json("/status")["active_weight_version"], 6);
}

// vLLM's older /pause form: wait_for_inflight_requests=true drains as mode=wait does.
TEST_F(http_gateway_test, pause_with_wait_for_inflight_requests_drains_live_generations) {
  ASSERT_EQ(install(1), 200);
  auto g = generate(40, 2);
  wait_in_flight(1);
  EXPECT_EQ(post_status("/pause?wait_for_inflight_requests=true"), 200);
  auto drained = g.get();
  EXPECT_EQ(drained["status"], "completed");
  EXPECT_EQ(drained["steps_done"], 40);
  EXPECT_EQ(post_status("/resume"), 200);
  auto bad = post("/pause?wait_for_inflight_requests=maybe");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"],
            "wait_for_inflight_requests: \"maybe\" is not a boolean");
  EXPECT_EQ(get_json("/is_paused")["is_paused"], false);
  // Booleans in queries read as FastAPI reads them, here as for include_dp.
  for (const char* spelling : {"no", "OFF", "False", "0", "f", "N"}) {
    auto r = client().Get(("/get_world_size?include_dp=" + std::string(spelling)).c_str());
    ASSERT_TRUE(r) << spelling;
    EXPECT_EQ(r->status, 200) << spelling << ": " << r->body;
  }
  // Given empty, a parameter is not its default: "mode=" is not abort (which would end
  // generations in flight), "include_dp=" is not true.
  auto empty_mode = post("/pause?mode=");
  ASSERT_TRUE(empty_mode);
  EXPECT_EQ(empty_mode->status, 400);
  EXPECT_EQ(json::parse(empty_mode->body)["error"], "mode: \"\" is not one of abort, wait, keep");
  EXPECT_EQ(get_json("/is_paused")["is_paused"], false);
  auto empty_dp = client().Get("/get_world_size?include_dp=");
  ASSERT_TRUE(empty_dp);
  EXPECT_EQ(empty_dp->status, 400);
  auto absent = client().Get("/get_world_size");
  ASSERT_TRUE(absent);
  EXPECT_EQ(absent->status, 200) << absent->body;
}

// Bodies that cannot be read whole, chunked bodies where none is read, and paths a client made
// up: each gets a JSON error, and none changes the update in progress.
TEST_F(http_gateway_test, bodies_past_the_limit_and_odd_paths_get_json_errors_and_change_nothing) {
  ASSERT_EQ(install(1), 200);
  ASSERT_EQ(post_status("/start_weight_update"), 200);
  auto c = client();
  const std::string big((std::size_t{64} << 20) + 1, ' ');
  auto r = c.Post("/finish_weight_update", big, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413) << r->body;
  EXPECT_EQ(get_json("/status")["phase"], "started");      // not committed as a bare POST
  r = c.Post("/update_weights", big, "application/json");  // the service answers it
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413) << r->body;
  EXPECT_NE(r->body.find("exceeds 64 MiB; nothing was done (rank=0)"), std::string::npos)
      << r->body;
  EXPECT_EQ(get_json("/status")["phase"], "started");

  std::size_t sent = 0;
  r = c.Post(
      "/finish_weight_update",
      [&](std::size_t, httplib::DataSink& sink) {
        if (sent >= (std::size_t{96} << 20)) {
          sink.done();
          return true;
        }
        static const std::string block(std::size_t{1} << 20, ' ');
        sent += block.size();
        return sink.write(block.data(), block.size());
      },
      "application/json");
  if (r) {  // the server may close the connection as it refuses
    EXPECT_EQ(r->status, 413) << r->body;
  }
  EXPECT_LT(sent, std::size_t{96} << 20);
  EXPECT_EQ(get_json("/status")["phase"], "started");

  for (const char* spelling : {"chunked", "Chunked", "CHUNKED"}) {  // httplib ignores case
    httplib::Headers chunked = {{"Transfer-Encoding", spelling}};
    auto g = client().Get("/status", chunked);
    ASSERT_TRUE(g) << spelling;
    EXPECT_EQ(g->status, 411) << spelling;
    EXPECT_FALSE(json::parse(g->body, nullptr, false).is_discarded()) << g->body;
  }

  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  auto nested = c.Post("/update_weights", R"({"update_info": )" + deep + "}", "application/json");
  ASSERT_TRUE(nested);  // answered, not a crashed rank
  EXPECT_EQ(nested->status, 400);
  EXPECT_NE(nested->body.find("nested deeper than 64 levels"), std::string::npos);

  // A key given twice is refused, not read as its last value (another parser keeps the first).
  auto twice = c.Post("/update_weights", R"({"update_info": {}, "update_info": {"names": []}})",
                      "application/json");
  ASSERT_TRUE(twice);
  EXPECT_EQ(twice->status, 400);
  EXPECT_NE(json::parse(twice->body)
                .value("error", "")
                .find("body: \"update_info\" given twice in one object (rank=0)"),
            std::string::npos)
      << twice->body;

  for (const char* path : {"/%22", "/%ff", "/a\\b"}) {
    auto n = client().Get(path);
    ASSERT_TRUE(n) << path;
    EXPECT_EQ(n->status, 404) << path;
    auto j = json::parse(n->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << path << ": " << n->body;
    EXPECT_EQ(j["error"].get<std::string>().rfind("path: no route /", 0), 0u) << n->body;
  }
  // The update in progress still goes on.
  auto m = publisher_->publish(tensors_.fill(2), 2, {0});
  ASSERT_TRUE(m) << m.error().message;
  auto body = json{{"update_info", {{"manifest", json::parse(manifest_to_json(*m))}}}}.dump();
  EXPECT_EQ(post_status("/update_weights", body), 200);
  EXPECT_EQ(post_status("/finish_weight_update"), 200);
  if (previous_) (void)publisher_->release(*previous_);
  previous_ = m->update_id;
  EXPECT_EQ(get_json("/status")["active_weight_version"], 2);
}

// SGLang's clients read "message" of {"success": false, ...}: refusals made before any route
// (token, unknown path) and errors of handlers shared with vLLM's surface come in that shape on
// SGLang's routes, and on every route when only SGLang's surface is served.
TEST_F(http_gateway_test, errors_on_sglangs_routes_come_in_sglangs_shape) {
  for (const std::string api : {"both", "sglang"}) {
    http_options o;
    o.api = api;
    o.token = "secret";
    http_gateway g(service_, o);
    auto port = g.start();
    ASSERT_TRUE(port) << port.error().message;
    httplib::Client c("127.0.0.1", *port);
    auto unauthorised = c.Post("/update_weights_from_distributed", "{}", "application/json");
    ASSERT_TRUE(unauthorised);
    EXPECT_EQ(unauthorised->status, 401);
    auto j = json::parse(unauthorised->body);
    EXPECT_EQ(j["success"], false) << api << ": " << unauthorised->body;
    EXPECT_EQ(j["message"], "authorization: missing or wrong bearer token");
    c.set_bearer_token_auth("secret");
    auto missing = c.Get("/no_such_route");
    ASSERT_TRUE(missing);
    EXPECT_EQ(missing->status, 404);
    EXPECT_EQ(json::parse(missing->body).contains("success"), api == "sglang") << missing->body;
    if (api == "sglang") {
      auto relabel = c.Post("/update_weight_version", "{}", "application/json");
      ASSERT_TRUE(relabel);
      EXPECT_EQ(relabel->status, 400);
      auto r = json::parse(relabel->body);
      EXPECT_EQ(r["success"], false) << relabel->body;
      EXPECT_EQ(r["message"], "new_version: missing in request body");
    }
    // vLLM's routes keep theirs beside SGLang's.
    if (api == "both") {
      auto v = c.Post("/update_weights", "{}", "application/json");
      ASSERT_TRUE(v);
      EXPECT_TRUE(json::parse(v->body).contains("error")) << v->body;
    }
  }
}

// Generations held by a pause keep pool threads; past the limit /generate is refused so that
// /resume always finds one.
TEST_F(http_gateway_test, generations_held_by_a_pause_leave_room_for_resume) {
  ASSERT_EQ(install(1), 200);
  http_options few;
  few.threads = 4;  // at most 2 generations at once
  http_gateway small(service_, few);
  auto port = small.start();
  ASSERT_TRUE(port) << port.error().message;
  auto call = [&](const char* path, const std::string& body = "", int timeout_s = 30) {
    httplib::Client c("127.0.0.1", *port);
    c.set_read_timeout(timeout_s, 0);
    return c.Post(path, body, "application/json");
  };
  // Two generations run, then a pause holds them: each keeps a pool thread.
  std::vector<std::future<json>> held;
  for (int i = 0; i < 2; ++i) {
    held.push_back(std::async(std::launch::async, [&] {
      auto r = call("/generate", R"({"steps": 2000, "step_ms": 1})");
      return r ? json::parse(r->body) : json();
    }));
  }
  wait_in_flight(2);
  auto paused = call("/pause?mode=keep");
  EXPECT_TRUE(paused && paused->status == 200);
  // A third is refused, not queued behind them (asserts wait: the held ones must be resumed).
  auto third = call("/generate", R"({"steps": 1})", 5);
  EXPECT_TRUE(third && third->status == 503) << (third ? third->body : "no answer");
  if (third) {
    EXPECT_NE(third->body.find("2 generations"), std::string::npos) << third->body;
  }
  auto resumed = call("/resume");
  ASSERT_TRUE(resumed);
  EXPECT_EQ(resumed->status, 200);
  for (auto& h : held) EXPECT_EQ(h.get()["status"], "completed");
  small.stop();
}

// Shutting down while a pause holds generations: stop_waiting ends them, so the gateway's
// threads can be joined (a SIGTERM'd standalone rank does this).
TEST_F(http_gateway_test, stopping_ends_generations_a_pause_holds) {
  ASSERT_EQ(install(1), 200);
  auto running = generate(100000, 1);
  wait_in_flight(1);
  EXPECT_EQ(post_status("/pause?mode=keep"), 200);
  auto waiting = generate(5, 1);  // begins while paused: waits
  for (int i = 0; i < 5000 && service_metric("wsync_generations_waiting") < 1; ++i) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(service_metric("wsync_generations_waiting"), 1);  // the path this test is about
  service_.stop_waiting();
  EXPECT_EQ(running.get()["status"], "aborted");
  EXPECT_EQ(waiting.get()["status"], "aborted");
  auto stopped = std::async(std::launch::async, [&] { gateway_.stop(); });
  EXPECT_EQ(stopped.wait_for(10s), std::future_status::ready);
}

// A raw connection to the gateway, for what httplib's client will not send.
class raw_connection {
 public:
  explicit raw_connection(std::uint16_t port) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0;
    timeval t{20, 0};  // a reply that never comes fails the test, not the run
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t);
  }
  ~raw_connection() { ::close(fd_); }
  bool connected() const { return connected_; }
  bool send(std::string_view bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  // Everything the server sends until it closes the connection (or 20 s pass).
  std::string read_all() {
    std::string got;
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd_, buf, sizeof buf, 0)) > 0;) got.append(buf, n);
    return got;
  }

 private:
  int fd_;
  bool connected_ = false;
};

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Bodies no route reads are refused before they are read: a compressed one (httplib would
// inflate it with no limit but the compressed length) and one sent to a path no POST route
// serves. The connection then closes: what was not read is never taken for the next request.
TEST_F(http_gateway_test, a_body_no_route_reads_is_refused_unread_and_the_connection_closes) {
  httplib::Headers gzip = {{"Content-Encoding", "gzip"}};
  auto compressed =
      client().Post("/update_weights", gzip, std::string(64, 'z'), "application/json");
  ASSERT_TRUE(compressed);
  EXPECT_EQ(compressed->status, 415);
  EXPECT_NE(json::parse(compressed->body).value("error", "").find("Content-Encoding \"gzip\""),
            std::string::npos)
      << compressed->body;
  auto put = client().Put("/update_weights", "{}", "application/json");
  ASSERT_TRUE(put);
  EXPECT_EQ(put->status, 404);

  // A gigabyte announced, none of it sent: the refusal comes at once.
  raw_connection big(port_);
  ASSERT_TRUE(big.connected());
  ASSERT_TRUE(big.send("POST /nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"));
  const auto answer = big.read_all();
  EXPECT_EQ(answer.rfind("HTTP/1.1 404", 0), 0u) << answer;

  // A body with neither length nor chunks (httplib would read it until the client closes) for
  // no route: refused at once too.
  raw_connection lengthless(port_);
  ASSERT_TRUE(lengthless.connected());
  ASSERT_TRUE(lengthless.send("POST /nothing HTTP/1.1\r\nHost: x\r\n\r\nsome bytes"));
  const auto refused = lengthless.read_all();
  EXPECT_EQ(refused.rfind("HTTP/1.1 404", 0), 0u) << refused;

  // Two requests on one connection: one answer, then the close. The second would have been a
  // body's bytes after a reply that did not read them.
  raw_connection two(port_);
  ASSERT_TRUE(two.connected());
  ASSERT_TRUE(
      two.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
  const auto both = two.read_all();
  EXPECT_EQ(count_of(both, "HTTP/1.1 200"), 1u) << both;
  EXPECT_EQ(get_json("/status")["phase"], "ready");  // nothing changed
}

// A client that sends its request a byte at a time (httplib gives each read 5 s, however many
// there are) holds a pool thread; stopping shuts its connection after a grace instead of
// waiting until it ends.
TEST_F(http_gateway_test, stopping_does_not_wait_for_a_client_that_trickles_its_request) {
  std::atomic<bool> done{false};
  raw_connection slow(port_);
  ASSERT_TRUE(slow.connected());
  ASSERT_TRUE(slow.send("GET /health HTTP/1.1\r\n"));
  std::thread trickle([&] {
    for (int i = 0; i < 120 && !done; ++i) {  // a minute of it without the shutdown
      std::this_thread::sleep_for(500ms);
      if (!done && !slow.send("X-A: b\r\n")) break;  // refused once shut down
    }
  });
  std::this_thread::sleep_for(1s);  // the request is being read
  const auto start = std::chrono::steady_clock::now();
  gateway_.stop();
  const auto took = std::chrono::steady_clock::now() - start;
  done = true;
  trickle.join();
  EXPECT_LT(took, 15s) << "stop() waited for the trickling client";
}

// A request read whole is answered, even one still running when the grace ends: only
// connections whose request is still being sent are shut down.
TEST_F(http_gateway_test, stopping_lets_a_request_being_answered_finish) {
  ASSERT_EQ(install(1), 200);
  auto running = generate(300, 10);  // about three seconds, past the grace
  wait_in_flight(1);
  gateway_.stop();
  auto r = running.get();
  ASSERT_TRUE(r.is_object()) << "no answer: the connection was shut down";
  EXPECT_EQ(r["status"], "completed") << r.dump();
}

}  // namespace
}  // namespace wsync

namespace wsync {
namespace {

// vLLM's NCCL engine: init_info is checked field by field, then refused: where NCCL cannot run,
// with the reason (blocked); where it can, because this rank was initialised over shared memory.
// The NCCL flow itself: nccl_flow.test.cpp.
TEST_F(http_gateway_test, vllm_nccl_init_info_is_checked_then_refused_as_blocked) {
  const std::string id(171, 'A');  // 128 bytes, standard base64
  auto refusal = [&](const json& info) {
    auto r = post("/init_weight_transfer_engine", json{{"init_info", info}}.dump());
    EXPECT_TRUE(r);
    if (!r) return std::make_pair(0, std::string());
    // Every init error names the rank it was refused on: checked here, then left out below.
    auto message = json::parse(r->body).value("error", r->body);
    const std::string rank = " (rank=0)";
    const bool named = message.size() >= rank.size() &&
                       message.compare(message.size() - rank.size(), rank.size(), rank) == 0;
    EXPECT_TRUE(named) << message;
    if (named) message.resize(message.size() - rank.size());
    return std::make_pair(r->status, message);
  };
  auto good = json{{"nccl_unique_id_b64", id + "="},
                   {"rank_offset", 1},
                   {"world_size", 2},
                   {"packed", true},
                   {"packed_buffer_size_bytes", 1 << 30},
                   {"packed_num_buffers", 2}};
  auto [status, message] = refusal(good);
  EXPECT_EQ(status, 400);
  if (auto r = nccl::ready(); !r) {
    EXPECT_EQ(message, "init_info.nccl_unique_id_b64: " + r.error().message);
  } else {
    EXPECT_EQ(message,
              "init_info.nccl_unique_id_b64: NCCL mode differs from \"shared-memory\", which "
              "this rank was initialised with");
  }

  auto tcp = refusal({{"master_address", "10.0.0.1"},
                      {"master_port", 29500},
                      {"rank_offset", 1},
                      {"world_size", 2}});
  EXPECT_EQ(tcp.first, 400);
  EXPECT_EQ(tcp.second.rfind("init_info.master_address: blocked: torch's TCP-store rendezvous", 0),
            0u)
      << tcp.second;
  EXPECT_NE(tcp.second.find("nccl_unique_id_b64"), std::string::npos) << tcp.second;

  auto with = [&](const char* key, const json& value) {
    auto info = good;
    info[key] = value;
    return refusal(info).second;
  };
  auto without = [&](const char* key) {
    auto info = good;
    info.erase(key);
    return refusal(info).second;
  };
  EXPECT_EQ(with("master_address", "10.0.0.1")
                .rfind("init_info: master_address/master_port and "
                       "nccl_unique_id_b64 are two rendezvous modes",
                       0),
            0u);
  EXPECT_EQ(with("nccl_unique_id_b64", std::string(171, '_') + "=")
                .rfind("init_info.nccl_unique_id_b64: not standard base64", 0),
            0u);
  EXPECT_EQ(with("nccl_unique_id_b64", "AAAA"),
            "init_info.nccl_unique_id_b64: decodes to 3 bytes; an NCCL unique id has 128");
  EXPECT_EQ(without("rank_offset"), "init_info.rank_offset: missing");
  EXPECT_EQ(with("world_size", "2"), "init_info.world_size: must be an integer below 2^31");
  EXPECT_EQ(with("rank_offset", std::uint64_t{1} << 63),
            "init_info.rank_offset: must be an integer below 2^31");
  EXPECT_EQ(with("world_size", -1),
            "init_info.world_size: -1 leaves no rank for this worker "
            "after rank_offset 1");
  EXPECT_EQ(refusal({{"master_port", 29500}, {"rank_offset", 1}, {"world_size", 2}})
                .second.rfind("init_info.master_port: blocked: ", 0),
            0u);
  EXPECT_EQ(with("rank_offset", 0),
            "init_info.rank_offset: 0 would put a rollout rank on rank 0, the trainer's");
  EXPECT_EQ(with("world_size", 1),
            "init_info.world_size: 1 leaves no rank for this worker after rank_offset 1");
  EXPECT_EQ(with("packed", 1), "init_info.packed: must be a boolean");
  EXPECT_EQ(with("packed_num_buffers", 0),
            "init_info.packed_num_buffers: must be a positive integer");
  // Nothing changed: the shared-memory engine initialised in SetUp still takes updates.
  EXPECT_EQ(install(1), 200);
}

}  // namespace
}  // namespace wsync
