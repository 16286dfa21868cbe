// Cluster bindings: a trainer rank that publishes through the coordinator, a rollout rank that
// installs what the coordinator sends into a Python installer in the background, and the
// coordinator's status table.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>

#include "common.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/runtime/rollout_executor.hpp"

namespace wsync::py {
namespace {

endpoint endpoint_make(const std::string& host, std::uint16_t port, const std::string& token,
                       const std::vector<std::string>& tls) {
  endpoint e;
  e.host = host;
  e.port = port;
  e.token = token;
  if (tls.size() == 3) e.tls = tls_settings{tls[0], tls[1], tls[2]};
  return e;
}

class trainer_handle {
 public:
  explicit trainer_handle(const trainer_options& o) {
    gil_released unlocked;
    rank_ = keeping_signal_mask([&] { return unwrap(trainer_rank::connect(o)); });
  }
  ~trainer_handle() {
    gil_released unlocked;
    rank_.reset();
  }
  pyb::dict publish(const pyb::list& tensors, std::uint64_t version,
                    std::map<std::string, std::string> metadata) {
    // A local reference: close() from another thread (after a Ctrl-C left this call running)
    // drops the handle's, and the rank goes when this call is done with it.
    auto rank = rank_;
    if (!rank) raise(errc::illegal_transition, "TrainerRank: closed");
    auto sources = sources_from(tensors);
    publish_outcome out;
    {
      gil_released unlocked;
      out = rank->publish(sources, version, std::move(metadata));
      rank.reset();  // may be the last reference: the rank stops here, without the GIL
    }
    pyb::dict d;
    d["committed"] = out.committed;
    d["error"] = out.error;
    d["error_code"] = out.error_code;
    d["outcome_json"] = out.outcome_json;
    d["publish_s"] = out.publish_s;
    return d;
  }
  std::vector<std::uint64_t> held_versions() {
    auto rank = rank_;
    if (!rank) raise(errc::illegal_transition, "TrainerRank: closed");
    gil_released unlocked;  // the rank's lock: an endpoint thread may hold it
    auto versions = rank->held_versions();
    rank.reset();  // may be the last reference (close() ran meanwhile): stops without the GIL
    return versions;
  }
  void close() {
    auto rank = std::move(rank_);
    gil_released unlocked;
    rank.reset();
  }

 private:
  std::shared_ptr<trainer_rank> rank_;
};

// What the rank did with each update, for status().
class report_keeper final : public consumer_observer {
 public:
  void rank_started(std::int32_t, reference_runtime&) override {}
  void update_done(std::int32_t, const std::string& key, const rollout_report& r,
                   std::uint64_t bytes) override {
    std::lock_guard lock(mutex_);
    last_key_ = key;
    last_ = r;
    last_bytes_ = bytes;
    ++updates_;
    if (r.acknowledged)
      ++installed_;
    else
      ++rejected_;
  }
  void stopping() override {}

  pyb::dict snapshot() const {
    // Copied under the lock, made into Python objects after it: building them may run Python
    // code (a collection, a __del__) that lets the GIL go, and a thread holding the GIL must
    // never wait for this lock meanwhile (installs take it in update_done).
    std::string key;
    rollout_report last;
    std::uint64_t bytes = 0, updates = 0, installed = 0, rejected = 0;
    {
      std::lock_guard lock(mutex_);
      key = last_key_;
      last = last_;
      bytes = last_bytes_;
      updates = updates_;
      installed = installed_;
      rejected = rejected_;
    }
    pyb::dict d;
    d["updates"] = updates;
    d["installed"] = installed;
    d["rejected"] = rejected;
    if (updates > 0) {
      pyb::dict l = report_to_py(last);
      l["key"] = key;
      l["bytes"] = bytes;
      d["last_update"] = l;
    } else {
      d["last_update"] = pyb::none();
    }
    return d;
  }

 private:
  mutable std::mutex mutex_;
  std::string last_key_;
  rollout_report last_;
  std::uint64_t last_bytes_ = 0;
  std::uint64_t updates_ = 0, installed_ = 0, rejected_ = 0;
};

class rollout_handle {
 public:
  rollout_handle(const rollout_options& o, pyb::object installer) : adapter_(std::move(installer)) {
    gil_released unlocked;
    rank_ = keeping_signal_mask(
        [&] { return unwrap(rollout_rank::connect(o, adapter_, meter_.gate, &reports_)); });
  }
  ~rollout_handle() { close(); }
  void close() {
    auto rank = std::move(rank_);
    gil_released unlocked;  // an install in flight needs the GIL to finish
    rank.reset();
  }
  // The executor's lock may be held by an install that waits for the GIL: never wait for it
  // while holding the GIL.
  std::uint64_t active_version() const {
    // A local reference, dropped without the GIL: if close() ran meanwhile, the rank stops
    // here, and stopping may wait for an install that needs the GIL.
    auto rank = rank_;
    gil_released unlocked;
    const std::uint64_t v = rank ? rank->active_weight_version() : 0;
    rank.reset();
    return v;
  }
  bool joined() const { return rank_ && rank_->joined(); }  // GIL held: close() cannot run
  pyb::dict status() const {
    const auto version = active_version();
    auto d = reports_.snapshot();
    d["active_weight_version"] = version;
    d["joined"] = joined();
    d["longest_gate_wait_s"] = static_cast<double>(meter_.longest_wait_ns.load()) / 1e9;
    d["generations"] = meter_.readers_total.load();
    return d;
  }
  gate_meter& meter() { return meter_; }

 private:
  gate_meter meter_;
  python_adapter adapter_;
  report_keeper reports_;
  std::shared_ptr<rollout_rank> rank_;  // last: stops before what it uses goes
};

}  // namespace

void cluster_bind(pyb::module_& m) {
  pyb::class_<trainer_handle>(m, "TrainerRank")
      .def(pyb::init([](const std::string& host, std::uint16_t port, const std::string& token,
                        std::int32_t rank, std::int32_t ranks, const std::string& node,
                        const std::string& transport, const transport_options& options,
                        const std::string& model_id, std::int64_t outcome_timeout_ms,
                        const std::vector<std::string>& tls) {
             trainer_options o;
             o.coordinator = endpoint_make(host, port, token, tls);
             o.rank = rank;
             o.ranks = ranks;
             o.node = node;
             o.transport = transport;
             o.transport_settings = options;
             o.model_id = model_id;
             o.outcome_timeout = std::chrono::milliseconds(outcome_timeout_ms);
             return std::make_unique<trainer_handle>(o);
           }),
           pyb::arg("host"), pyb::arg("port"), pyb::arg("token"), pyb::arg("rank"),
           pyb::arg("ranks"), pyb::arg("node"), pyb::arg("transport"), pyb::arg("options"),
           pyb::arg("model_id"), pyb::arg("outcome_timeout_ms"), pyb::arg("tls"))
      .def("publish", &trainer_handle::publish)
      .def("held_versions", &trainer_handle::held_versions)
      .def("close", &trainer_handle::close);

  pyb::class_<rollout_handle>(m, "RolloutRank")
      .def(pyb::init([](const std::string& host, std::uint16_t port, const std::string& token,
                        std::int32_t rank, const std::string& node, const std::string& transport,
                        const transport_options& options, const std::string& model_id, bool verify,
                        std::int64_t join_timeout_ms, const std::vector<std::string>& tls,
                        pyb::object installer) {
             rollout_options o;
             o.coordinator = endpoint_make(host, port, token, tls);
             o.rank = rank;
             o.node = node;
             o.transport = transport;
             o.transport_settings = options;
             o.model_id = model_id;
             o.verify = verify;
             o.join_timeout = std::chrono::milliseconds(join_timeout_ms);
             return std::make_unique<rollout_handle>(o, std::move(installer));
           }),
           pyb::arg("host"), pyb::arg("port"), pyb::arg("token"), pyb::arg("rank"),
           pyb::arg("node"), pyb::arg("transport"), pyb::arg("options"), pyb::arg("model_id"),
           pyb::arg("verify"), pyb::arg("join_timeout_ms"), pyb::arg("tls"), pyb::arg("installer"))
      .def("active_version", &rollout_handle::active_version)
      .def("joined", &rollout_handle::joined)
      .def("status", &rollout_handle::status)
      .def("close", &rollout_handle::close)
      .def(
          "gate_enter", [](rollout_handle& r) { return std::make_unique<gate_ticket>(r.meter()); },
          pyb::keep_alive<0, 1>())
      .def("reset_longest_wait", [](rollout_handle& r) { r.meter().reset(); });

  m.def(
      "coordinator_status",
      [](const std::string& host, std::uint16_t port, const std::string& token,
         const std::vector<std::string>& tls) {
        std::string error;
        std::string text;
        {
          gil_released unlocked;
          text = keeping_signal_mask(
              [&] { return coordinator_status(endpoint_make(host, port, token, tls), error); });
        }
        if (text.empty()) raise(errc::io_error, "coordinator status: " + error);
        return text;
      },
      pyb::arg("host"), pyb::arg("port"), pyb::arg("token"), pyb::arg("tls"));
}

}  // namespace wsync::py
