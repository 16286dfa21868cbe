// vLLM's NCCL mode on the weight-transfer surface, call by call, with an in-process trainer as
// rank 0 (tests/support/host_trainer.hpp) in place of NCCL: what a torch trainer written for
// vLLM (rlhf_http_nccl_no_vllm.py) does, and what the rank answers when the trainer misbehaves.
// The same flow over a real NCCL group needs two GPUs (docs/http.md#nccl says what is untested).

#include <gtest/gtest.h>

#include <openssl/evp.h>
#include <future>

#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "host_trainer.hpp"
#include "random_bytes.hpp"
#include "wsync/http/weight_transfer.hpp"

namespace wsync {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string sha256_of(const std::vector<std::byte>& b) {
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned n = 0;
  EVP_Digest(b.data(), b.size(), d, &n, EVP_sha256(), nullptr);
  std::string hex;
  char c[3];
  for (unsigned i = 0; i < n; ++i) {
    std::snprintf(c, sizeof c, "%02x", d[i]);
    hex += c;
  }
  return hex;
}

// One model's tensors at one step, as a trainer holds them.
struct model_step {
  std::vector<std::string> names = {"embed", "layers.0.w", "layers.0.b", "norm", "head"};
  std::vector<std::string> dtypes = {"bfloat16", "float32", "float32", "torch.float16", "int8"};
  std::vector<std::vector<std::int64_t>> shapes = {{7, 3}, {64, 33}, {33}, {5}, {1001}};
  std::vector<std::vector<std::byte>> bytes;

  explicit model_step(std::uint64_t step) {
    const std::size_t item[] = {2, 4, 4, 2, 1};
    for (std::size_t i = 0; i < names.size(); ++i) {
      std::size_t n = item[i];
      for (auto d : shapes[i]) n *= static_cast<std::size_t>(d);
      auto raw = test::random_bytes(n, step * 10 + i);
      std::vector<std::byte> b(n);
      std::memcpy(b.data(), raw.data(), n);
      bytes.push_back(std::move(b));
    }
  }
  // update_info for tensors [first, last).
  json update_info(std::size_t first = 0, std::size_t last = 5) const {
    json info = {
        {"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}};
    for (std::size_t i = first; i < last; ++i) {
      info["names"].push_back(names[i]);
      info["dtype_names"].push_back(dtypes[i]);
      info["shapes"].push_back(shapes[i]);
    }
    return info;
  }
  std::vector<std::vector<std::byte>> slice(std::size_t first, std::size_t last) const {
    return {bytes.begin() + static_cast<std::ptrdiff_t>(first),
            bytes.begin() + static_cast<std::ptrdiff_t>(last)};
  }
};

class nccl_flow_test : public ::testing::Test {
 protected:
  nccl_flow_test() : service_(config()) {}

  weight_transfer_config config() {
    weight_transfer_config c;
    c.rank = 0;
    c.nccl_timeout = 2s;
    c.nccl_join = [this](const nccl::unique_id& id, int world, int rank, int device,
                         std::chrono::milliseconds, const std::atomic<bool>* cancel) {
      join_cancel = cancel;
      if (!join_error.empty()) {
        return result<std::unique_ptr<nccl::broadcast_endpoint>>(
            make_error(errc::io_error, join_error));
      }
      joined_id = id;
      joined_world = world;
      joined_rank = rank;
      joined_device = device;
      auto t = std::make_unique<testing::host_trainer>();
      t->on_end = &ended;
      trainer = t.get();
      return result<std::unique_ptr<nccl::broadcast_endpoint>>(std::move(t));
    };
    return c;
  }

  testing::host_trainer::ending ended;             // the last trainer the rank dropped
  std::string join_error;                          // when set, joining fails with it
  const std::atomic<bool>* join_cancel = nullptr;  // the flag the last join was handed

  json init_info(bool packed = false, std::uint64_t buffer = 1 << 30) const {
    nccl::unique_id id{};
    id.fill(std::byte{0x5a});
    return {{"nccl_unique_id_b64", nccl::unique_id_to_base64(id)},
            {"rank_offset", 1},
            {"world_size", 2},
            {"packed", packed},
            {"packed_buffer_size_bytes", buffer},
            {"packed_num_buffers", 2}};
  }

  // One whole update through the current group: the trainer broadcasts `m`, then start,
  // update and finish each answer 200.
  void install_step(const model_step& m) {
    trainer->sends = testing::trainer_broadcasts(m.bytes, false, 0);
    ASSERT_EQ(service_.start("").status, 200);
    ASSERT_EQ(update(m.update_info()).status, 200);
    auto r = service_.finish("");
    ASSERT_EQ(r.status, 200) << r.body;
  }

  // install_step on another service of this fixture's joins.
  void install_on(weight_transfer_service& service, const model_step& m) {
    trainer->sends = testing::trainer_broadcasts(m.bytes, false, 0);
    ASSERT_EQ(service.start("").status, 200);
    auto r = service.update(json{{"update_info", m.update_info()}}.dump());
    ASSERT_EQ(r.status, 200) << r.body;
    r = service.finish("");
    ASSERT_EQ(r.status, 200) << r.body;
  }

  static json body(const http_reply& r) { return json::parse(r.body); }
  static std::string error_of(const http_reply& r) { return body(r).value("error", r.body); }

  http_reply init(const json& info) { return service_.init(json{{"init_info", info}}.dump()); }
  http_reply update(const json& info) {
    return service_.update(json{{"update_info", info}}.dump());
  }

  // The per-tensor SHA-256 of the weights the rank serves now.
  json served() {
    auto r = service_.weight_checker(R"({"action": "checksum"})");
    EXPECT_EQ(r.status, 200) << r.body;
    return body(r)["checksums"];
  }

  void expect_serving(const model_step& m) {
    auto now = served();
    ASSERT_EQ(now.size(), m.names.size()) << now.dump();
    for (std::size_t i = 0; i < m.names.size(); ++i) {
      EXPECT_EQ(now.value(m.names[i], ""), sha256_of(m.bytes[i])) << m.names[i];
    }
  }

  testing::host_trainer* trainer = nullptr;
  nccl::unique_id joined_id{};
  int joined_world = 0, joined_rank = -1, joined_device = -1;
  weight_transfer_service service_;
};

TEST_F(nccl_flow_test, a_torch_trainer_flow_installs_what_rank_0_broadcast) {
  auto r = init(init_info(/*packed=*/true, /*buffer=*/300));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["message"], "Weight transfer initialized");
  ASSERT_NE(trainer, nullptr);
  EXPECT_EQ(joined_rank, 1);  // rank_offset + this server's only worker
  EXPECT_EQ(joined_world, 2);
  EXPECT_EQ(joined_device, 0);
  nccl::unique_id want{};
  want.fill(std::byte{0x5a});
  EXPECT_EQ(joined_id, want);

  // Step 1, packed in groups of > 300 bytes, sent in two /update_weights calls.
  model_step one(1);
  trainer->sends = testing::trainer_broadcasts(one.slice(0, 2), true, 300);
  for (auto& b : testing::trainer_broadcasts(one.slice(2, 5), true, 300)) {
    trainer->sends.push_back(std::move(b));
  }
  ASSERT_EQ(service_.start("").status, 200);
  r = update(one.update_info(0, 2));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["message"], "Weights updated");
  r = update(one.update_info(2, 5));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(trainer->sends.empty());
  r = service_.finish(R"({"weight_version": "step-1"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["weight_version"], 1);
  expect_serving(one);
  EXPECT_EQ(body(service_.weight_info())["weight_version"], "step-1");

  // Step 2, one broadcast per tensor (packed=false in update_info, as older vLLM sends it).
  model_step two(2);
  trainer->sends = testing::trainer_broadcasts(two.bytes, false, 0);
  ASSERT_EQ(service_.start("").status, 200);
  auto info = two.update_info();
  info["packed"] = false;
  r = update(info);
  ASSERT_EQ(r.status, 200) << r.body;
  r = service_.finish("");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["weight_version"], 2);
  expect_serving(two);
  EXPECT_EQ(service_.active_version(), 2u);
}

TEST_F(nccl_flow_test, update_info_is_checked_before_a_byte_moves) {
  ASSERT_EQ(init(init_info()).status, 200);
  model_step m(3);
  trainer->sends = testing::trainer_broadcasts(m.bytes, false, 0);
  ASSERT_EQ(service_.start("").status, 200);
  // A refused call drops the group (the trainer's broadcasts for it would otherwise be taken
  // by the next call) having received nothing; the rank joins again for the next case. The
  // answer is the field's problem, then why the group went.
  const std::string dropped =
      "; the trainer's broadcasts for this call have no receiver, so the "
      "NCCL group is aborted and the update dropped: call "
      "/init_weight_transfer_engine again";
  auto refused = [&](const json& info) {
    const auto before = trainer->receives_done;
    auto r = update(info);
    EXPECT_EQ(r.status, 400) << r.body;
    EXPECT_EQ(ended.receives_done, before) << r.body;
    EXPECT_NE(ended.aborted.find("update_weights was refused"), std::string::npos) << r.body;
    ended = {};
    auto why = error_of(r);
    const auto at = why.size() >= dropped.size() ? why.size() - dropped.size() : 0;
    EXPECT_EQ(why.substr(at), dropped) << r.body;
    EXPECT_NE(why.find("rank=0"), std::string::npos) << r.body;  // names this rank
    EXPECT_EQ(init(init_info()).status, 200);
    trainer->sends = testing::trainer_broadcasts(m.bytes, false, 0);
    EXPECT_EQ(service_.start("").status, 200);
    const std::string rank = " (rank=0)";  // the field's problem without it
    const bool suffix = at >= rank.size() && why.compare(at - rank.size(), rank.size(), rank) == 0;
    return why.substr(0, suffix ? at - rank.size() : at);
  };
  auto with = [&](const char* key, std::size_t i, const json& v) {
    auto info = m.update_info();
    info[key][i] = v;
    return refused(info);
  };
  auto info = m.update_info();
  info.erase("dtype_names");
  EXPECT_EQ(refused(info).rfind("update_info.dtype_names: missing", 0), 0u);
  info = m.update_info();
  info["shapes"].erase(1);
  EXPECT_EQ(refused(info), "update_info.shapes: has 4 entries, names has 5");
  EXPECT_EQ(with("dtype_names", 2, "complex64")
                .rfind("update_info.dtype_names[2]: \"complex64\" is not a dtype wsync knows", 0),
            0u);
  EXPECT_EQ(with("shapes", 1, json::array({64, -1})),
            "update_info.shapes[1]: must be a list of non-negative integers");
  EXPECT_EQ(with("names", 3, "embed"), "update_info.names[3]: \"embed\" is named twice");
  EXPECT_EQ(with("names", 0, 7), "update_info.names[0]: must be a string");
  EXPECT_EQ(
      refused(json{
          {"names", json::array()}, {"dtype_names", json::array()}, {"shapes", json::array()}}),
      "update_info.names: empty; name at least one tensor");
  info = m.update_info();
  info["manifest"] = json::object();
  EXPECT_EQ(refused(info).rfind("update_info.manifest: this rank was initialised in NCCL mode", 0),
            0u);
  info = m.update_info();
  info["packed_buffer_size_bytes"] = 0;
  EXPECT_EQ(refused(info), "update_info.packed_buffer_size_bytes: must be a positive integer");

  // A list is checked whole before its first entry is received: a bad later entry, or a name
  // two entries share, refuses the call with nothing received.
  auto bad_second = m.update_info(2, 5);
  bad_second["dtype_names"][1] = "complex64";
  EXPECT_EQ(refused(json::array({m.update_info(0, 2), bad_second}))
                .rfind("update_info[1].dtype_names[1]: \"complex64\"", 0),
            0u);
  EXPECT_EQ(refused(json::array({m.update_info(0, 2), m.update_info(1, 5)})),
            "update_info[1].names[0]: \"layers.0.w\" is already in this update");

  // The good call still works, and a name cannot come twice in one update.
  ASSERT_EQ(update(m.update_info(0, 2)).status, 200);
  trainer->sends.push_front(m.bytes[0]);
  EXPECT_EQ(refused(m.update_info(0, 1)),
            "update_info.names[0]: \"embed\" is already in this update");
}

TEST_F(nccl_flow_test, an_update_call_out_of_order_drops_the_group) {
  // The trainer broadcasts while its /update_weights is in flight, so a call refused for its
  // phase leaves broadcasts behind just as a malformed one does.
  ASSERT_EQ(init(init_info()).status, 200);
  model_step one(1);
  trainer->sends = testing::trainer_broadcasts(one.bytes, false, 0);
  auto r = update(one.update_info());
  EXPECT_EQ(r.status, 409) << r.body;
  EXPECT_EQ(error_of(r).rfind("update_weights: out of order: the weight transfer is 'ready'", 0),
            0u)
      << r.body;
  EXPECT_NE(error_of(r).find("NCCL group is aborted"), std::string::npos) << r.body;
  EXPECT_EQ(ended.receives_done, 0u);
  EXPECT_FALSE(ended.aborted.empty());
  r = service_.start("");
  EXPECT_EQ(r.status, 409);
  EXPECT_NE(error_of(r).find("call /init_weight_transfer_engine first"), std::string::npos);
}

// A body the gateway could not read (past 64 MiB, or cut off) never reached the service's
// checks, yet the trainer broadcasts all the same: the group goes as for any refused call.
TEST_F(nccl_flow_test, an_update_whose_body_was_not_read_drops_the_group) {
  ASSERT_EQ(init(init_info()).status, 200);
  model_step one(1);
  trainer->sends = testing::trainer_broadcasts(one.bytes, false, 0);
  ASSERT_EQ(service_.start("").status, 200);
  auto r =
      service_.update_unread(413, "request: the body of POST /update_weights could not be read");
  EXPECT_EQ(r.status, 413) << r.body;
  EXPECT_NE(error_of(r).find("could not be read (rank=0); the trainer's broadcasts"),
            std::string::npos)
      << r.body;
  EXPECT_EQ(ended.receives_done, 0u);
  EXPECT_NE(ended.aborted.find("update_weights was refused"), std::string::npos);
}

// A trainer that died mid-broadcast leaves the rank's receive waiting for NCCL's deadline
// (minutes). The restarted trainer's init must not wait that out: it ends the receive, the
// update fails with the reason, and the rank joins the new group.
TEST_F(nccl_flow_test, an_init_ends_a_receive_the_old_trainer_will_never_feed) {
  auto c = config();
  c.nccl_timeout = 120s;
  weight_transfer_service service(c);
  auto init_call = [&] {
    return service.init(json{{"init_info", init_info()}}.dump());
  };
  ASSERT_EQ(init_call().status, 200);
  model_step m(1);
  testing::host_trainer* old = trainer;
  old->sends = testing::trainer_broadcasts(m.bytes, false, 0);
  old->sends.pop_back();  // the trainer died before its last broadcast
  old->hang_when_empty = true;
  old->cancel = join_cancel;
  ASSERT_EQ(service.start("").status, 200);
  auto stuck = std::async(std::launch::async, [&] {
    return service.update(json{{"update_info", m.update_info()}}.dump());
  });
  while (!old->hanging) std::this_thread::sleep_for(1ms);
  const auto begin = std::chrono::steady_clock::now();
  auto again = init_call();
  const auto took = std::chrono::steady_clock::now() - begin;
  EXPECT_EQ(again.status, 200) << again.body;
  EXPECT_LT(took, 60s) << "the init waited for the old group's receive";
  auto u = stuck.get();
  EXPECT_EQ(u.status, 500) << u.body;
  EXPECT_NE(error_of(u).find("cancelled"), std::string::npos) << u.body;
  install_on(service, model_step(2));  // through the new group
  service.stop_waiting();
}

TEST_F(nccl_flow_test, a_trainer_that_stops_fails_the_update_and_the_rank_must_join_again) {
  ASSERT_EQ(init(init_info()).status, 200);
  model_step one(1);
  install_step(one);

  model_step two(2);
  trainer->sends = testing::trainer_broadcasts(two.bytes, false, 0);
  trainer->sends.pop_back();  // the trainer dies before its last broadcast
  ASSERT_EQ(service_.start("").status, 200);
  auto r = update(two.update_info());
  EXPECT_EQ(r.status, 500) << r.body;
  EXPECT_EQ(
      error_of(r).rfind("update_weights: rank 0 receiving 5 tensors from the trainer failed: ", 0),
      0u)
      << r.body;
  EXPECT_NE(error_of(r).find("call /init_weight_transfer_engine again"), std::string::npos);
  // Step 1 is still served, whole; the rank waits for a new group.
  expect_serving(one);
  EXPECT_EQ(service_.active_version(), 1u);
  r = service_.start("");
  EXPECT_EQ(r.status, 409);
  EXPECT_NE(error_of(r).find("call /init_weight_transfer_engine first"), std::string::npos);

  ASSERT_EQ(init(init_info()).status, 200);  // a new trainer, a new group
  trainer->sends = testing::trainer_broadcasts(two.bytes, false, 0);
  ASSERT_EQ(service_.start("").status, 200);
  ASSERT_EQ(update(two.update_info()).status, 200);
  r = service_.finish("");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(body(r)["weight_version"], 2);
  expect_serving(two);
}

TEST_F(nccl_flow_test, a_failed_re_init_leaves_the_rank_waiting_for_a_group_not_ready) {
  ASSERT_EQ(init(init_info()).status, 200);
  model_step one(1);
  install_step(one);

  // The trainer makes a new group; joining it fails. The old group was left for it, so the
  // rank has none: start must say so, not answer 200 for an update that cannot arrive.
  join_error = "ncclCommInitRank: remote process exited";
  auto r = init(init_info());
  EXPECT_EQ(r.status, 500) << r.body;
  EXPECT_NE(error_of(r).find("remote process exited"), std::string::npos) << r.body;
  r = service_.start("");
  EXPECT_EQ(r.status, 409) << r.body;
  EXPECT_NE(error_of(r).find("call /init_weight_transfer_engine first"), std::string::npos)
      << r.body;
  expect_serving(one);  // the active version stays whole

  join_error.clear();
  ASSERT_EQ(init(init_info()).status, 200);
  model_step two(2);
  install_step(two);
  expect_serving(two);
}

// A trainer that dies between two /update_weights calls and restarts calls init: the half it
// had sent is dropped, not installed (a first install fixes the model's tensor set), and the
// new group's whole update installs.
TEST_F(nccl_flow_test, an_init_while_an_update_is_started_drops_the_half_received) {
  ASSERT_EQ(init(init_info()).status, 200);
  model_step one(1);
  trainer->sends = testing::trainer_broadcasts(one.slice(0, 2), false, 0);
  ASSERT_EQ(service_.start("").status, 200);
  ASSERT_EQ(update(one.update_info(0, 2)).status, 200);
  ASSERT_EQ(init(init_info()).status, 200);  // the restarted trainer's new group
  EXPECT_EQ(service_.finish("").status, 409);
  trainer->sends = testing::trainer_broadcasts(one.bytes, false, 0);
  ASSERT_EQ(service_.start("").status, 200);
  ASSERT_EQ(update(one.update_info()).status, 200);
  auto r = service_.finish("");
  ASSERT_EQ(r.status, 200) << r.body;
  expect_serving(one);
}

// Shutting down must not wait out --nccl-timeout-ms behind a join or receive: the group is
// joined with a flag that stop_waiting sets (the communicator then fails its waits at once).
TEST_F(nccl_flow_test, stop_waiting_cancels_the_groups_waits) {
  ASSERT_EQ(init(init_info()).status, 200);
  ASSERT_NE(join_cancel, nullptr);
  EXPECT_FALSE(join_cancel->load());
  service_.stop_waiting();
  EXPECT_TRUE(join_cancel->load());
}

TEST_F(nccl_flow_test, a_server_that_reports_several_workers_refuses_nccl_mode) {
  auto c = config();
  c.world_size = 2;
  c.data_parallel = 2;
  weight_transfer_service wide(c);
  auto r = wide.init(json{{"init_info", init_info()}}.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_of(r),
            "init_info.nccl_unique_id_b64: NCCL mode joins one rank per server, but this server "
            "answers /get_world_size 4 (--world-size 2 x --data-parallel 2); serve NCCL mode with "
            "--world-size 1 --data-parallel 1 (rank=0)");
  EXPECT_EQ(trainer, nullptr);  // nothing joined

  // At the CLI's bounds the product is past 32 bits: it is answered whole, and still refused.
  c.world_size = c.data_parallel = 1 << 20;
  weight_transfer_service widest(c);
  EXPECT_EQ(body(widest.world_size("true"))["world_size"], std::int64_t{1} << 40);
  EXPECT_EQ(body(widest.world_size("false"))["world_size"], 1 << 20);
  r = widest.init(json{{"init_info", init_info()}}.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(error_of(r).find("answers /get_world_size 1099511627776 "), std::string::npos)
      << r.body;
}

TEST_F(nccl_flow_test, nccl_mode_and_manifest_transports_do_not_mix) {
  ASSERT_EQ(init(init_info()).status, 200);
  auto r = init({{"transport", "shared-memory"}});
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_of(r),
            "init_info.transport: \"shared-memory\" differs from NCCL mode, which this rank was "
            "initialised with (rank=0)");

  // wsync's own nccl transport takes its group from a coordinator: over HTTP, NCCL is vLLM's mode.
  weight_transfer_service named(config());
  r = named.init(R"({"init_info": {"transport": "nccl"}})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_of(r).rfind("init_info.transport: \"nccl\" over HTTP is vLLM's NCCL mode", 0), 0u)
      << r.body;

  weight_transfer_service other(config());
  ASSERT_EQ(other.init(R"({"init_info": {}})").status, 200);  // shared memory
  r = other.init(json{{"init_info", init_info()}}.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(error_of(r),
            "init_info.nccl_unique_id_b64: NCCL mode differs from \"shared-memory\", which this "
            "rank was initialised with (rank=0)");
}

}  // namespace
}  // namespace wsync
