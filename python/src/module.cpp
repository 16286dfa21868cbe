// The _wsync extension: the manifest, the publisher and consumer halves over any transport, and
// the rollout executor, for the pure-Python layer in python/wsync/ (which is the public API).
// Every blocking call releases the GIL.

#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <mutex>
#include <set>

#include "common.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/validate.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync::py {

void cluster_bind(pyb::module_& m);

namespace {

std::string default_worker() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return std::string(host) + ":" + std::to_string(::getpid());
}

// One transport object per name and options in the process, shared by every bridge: halves made
// by one object can always talk (local-clone's registry is per object), and it lives as long as
// the process, so a deferred release never outlives it.
transport& transport_make(const std::string& name, const transport_options& o) {
  static std::mutex mutex;
  static auto* made =
      new std::map<std::pair<std::string, transport_options>, std::unique_ptr<transport>>;
  std::lock_guard lock(mutex);
  auto& slot = (*made)[{name, o}];
  if (!slot) slot = unwrap(make_transport(name, o));
  return *slot;
}

// The publisher half of a bridge.
class publisher_half {
 public:
  publisher_half(const std::string& transport_name, const transport_options& options,
                 publisher_config config)
      : publisher_(lease_aware(unwrap(transport_make(transport_name, options).make_publisher())),
                   transport_name, std::move(config)) {}

  weight_update_manifest publish(const pyb::list& tensors, std::uint64_t version,
                                 std::vector<std::int32_t> expected,
                                 std::map<std::string, std::string> metadata) {
    auto sources = sources_from(tensors);
    gil_released unlocked;
    return unwrap(publisher_.publish(sources, version, std::move(expected), std::move(metadata)));
  }
  void release(const update_id& id) {
    gil_released unlocked;
    unwrap(publisher_.release(id));
  }
  // Without the GIL: the publisher's lock may be held by a publish in another thread waiting
  // on its transport (file-mmap syncs CURRENT to disk), and every Python thread would wait too.
  std::uint64_t last_version() const {
    gil_released unlocked;
    return publisher_.last_version();
  }
  std::vector<update_id> held() const {
    gil_released unlocked;
    return publisher_.held_updates();
  }

 private:
  weight_publisher publisher_;
};

// `f()` with the GIL released (for a call that may wait on a lock and touches no Python).
template <class F>
auto without_gil(F&& f) {
  gil_released released;
  return f();
}

// The consumer half of a bridge; its weight_consumer is also what an executor drives.
class consumer_half {
 public:
  consumer_half(const std::string& transport_name, const transport_options& options,
                std::int32_t rank, unsigned verify_threads)
      : consumer_(lease_aware(unwrap(transport_make(transport_name, options).make_consumer())),
                  consumer_config{rank, verify_threads}) {}

  // weight_consumer reads an update's bytes without its lock while importing and verifying,
  // so a release from another Python thread must wait for those: ops_ serialises them. Always
  // taken with the GIL released; the GIL may be taken under it (ops_, then the GIL).
  pyb::list import_update(const weight_update_manifest& m) {
    gil_released unlocked;
    std::lock_guard op(ops_);
    const imported_update* u = unwrap(consumer_.import_update(m));
    gil_taken gil;
    return segments_to_py(m.update_id, u->segments, u->memory);
  }
  void verify(const update_id& id) {
    gil_released unlocked;
    std::lock_guard op(ops_);
    unwrap(consumer_.verify(id));
  }
  // The consumer's lock may be held by a release unmapping an update: wait for it without the
  // GIL. (unwrap raises, so it runs with the GIL again.)
  void mark_installed(const update_id& id) {
    unwrap(without_gil([&] { return consumer_.mark_installed(id); }));
  }
  void acknowledge(const update_id& id) {
    unwrap(without_gil([&] { return consumer_.acknowledge(id); }));
  }
  void reject(const update_id& id, std::string reason) {
    unwrap(without_gil([&] { return consumer_.reject(id, std::move(reason)); }));
  }
  void release(const update_id& id) {
    gil_released unlocked;
    std::lock_guard op(ops_);
    if (installing_.count(id) > 0) {
      unwrap(make_error(errc::illegal_transition,
                        "cannot release update_id=" + id + " while an executor installs it (rank " +
                            std::to_string(consumer_.rank()) +
                            "): the executor releases it itself if the install fails"));
    }
    unwrap(consumer_.release(id));
  }
  std::string state(const update_id& id) const {
    return std::string(update_state_name(unwrap(without_gil([&] { return consumer_.state(id); }))));
  }
  weight_consumer& get() { return consumer_; }

  // An executor's updates in flight: the executor reads their bytes without ops_, so release()
  // refuses them rather than unmapping what it verifies or copies. Refuses, not waits: the
  // install may itself wait for a generation step that is the caller.
  void installing(std::span<const weight_update_manifest> shards, bool begin) {
    std::lock_guard op(ops_);
    for (const auto& m : shards) {
      if (begin) {
        installing_.insert(m.update_id);
      } else if (auto it = installing_.find(m.update_id); it != installing_.end()) {
        installing_.erase(it);  // one mark: two installs of one update may overlap
      }
    }
  }

 private:
  std::mutex ops_;
  std::multiset<update_id> installing_;  // under ops_
  weight_consumer consumer_;
};

// The rollout executor over a consumer half, installing through a Python installer object.
class executor_handle {
 public:
  executor_handle(consumer_half& consumer, pyb::object installer, bool verify)
      : consumer_(consumer),
        adapter_(std::move(installer)),
        executor_(consumer.get(), adapter_, meter_.gate, executor_config{verify}) {}
  ~executor_handle() {
    gil_released unlocked;
    executor_.release_active();
  }

  // The shards are marked as being installed for the whole call: a bridge.release() of one
  // from another thread is refused instead of unmapping what the executor verifies or copies.
  pyb::dict update_weights(const std::vector<weight_update_manifest>& shards) {
    rollout_report r;
    {
      gil_released unlocked;
      consumer_.installing(shards, true);
      struct unmark {
        consumer_half& c;
        const std::vector<weight_update_manifest>& s;
        ~unmark() { c.installing(s, false); }
      } done{consumer_, shards};
      r = executor_.update_weights(shards);
    }
    adapter_.take_interrupt();  // Ctrl-C while staging: the update was rejected; now raise it
    return report_to_py(r);
  }
  // The executor's lock may be held by an install that waits for the GIL: never wait for it
  // while holding the GIL.
  std::optional<std::uint64_t> active_version() const {
    gil_released unlocked;
    return executor_.active_weight_version();
  }
  std::vector<update_id> release_active() {
    auto released = without_gil([&] { return executor_.release_active(); });
    adapter_.take_interrupt();  // Ctrl-C in a custom installer's deactivate: raised now
    return released;
  }
  gate_meter& meter() { return meter_; }

 private:
  consumer_half& consumer_;
  gate_meter meter_;
  python_adapter adapter_;
  rollout_executor executor_;
};

void manifest_bind(pyb::module_& m) {
  pyb::class_<tensor_descriptor>(m, "TensorInfo", "Where one tensor lies in an update.")
      .def_readonly("name", &tensor_descriptor::name)
      .def_property_readonly("dtype",
                             [](const tensor_descriptor& d) { return dtype_name(d.dtype); })
      .def_readonly("shape", &tensor_descriptor::shape)
      .def_readonly("strides", &tensor_descriptor::strides)
      .def_readonly("nbytes", &tensor_descriptor::nbytes)
      .def_readonly("device", &tensor_descriptor::device)
      .def_readonly("segment", &tensor_descriptor::segment)
      .def_readonly("offset", &tensor_descriptor::offset)
      .def_readonly("checksum", &tensor_descriptor::checksum)
      .def("__repr__", [](const tensor_descriptor& d) {
        return "TensorInfo(" + d.name + ", " + std::string(dtype_name(d.dtype)) + ", " +
               std::to_string(d.nbytes) + " bytes)";
      });

  pyb::class_<weight_update_manifest>(
      m, "Manifest",
      "One published update (one publisher rank's shard of one version): immutable. Converts to "
      "and from JSON and pickles, so it can reach rollout processes any way the trainer likes.")
      .def_readonly("update_id", &weight_update_manifest::update_id)
      .def_readonly("model_id", &weight_update_manifest::model_id)
      .def_readonly("weight_version", &weight_update_manifest::weight_version)
      .def_readonly("source_worker", &weight_update_manifest::source_worker)
      .def_readonly("source_rank", &weight_update_manifest::source_rank)
      .def_readonly("transport", &weight_update_manifest::transport)
      .def_readonly("transport_handle", &weight_update_manifest::transport_handle)
      .def_readonly("tensors", &weight_update_manifest::tensors)
      .def_readonly("metadata", &weight_update_manifest::metadata)
      .def_readonly("total_bytes", &weight_update_manifest::total_bytes)
      .def_property_readonly("segment_bytes",
                             [](const weight_update_manifest& x) {
                               std::vector<std::uint64_t> out;
                               for (const auto& s : x.segments) out.push_back(s.nbytes);
                               return out;
                             })
      .def(
          "view_plan",
          [](const weight_update_manifest& x) {
            // Everything views_of() needs, in one call: a property access per field and tensor
            // costs more than the views themselves.
            pyb::list out;
            for (const auto& d : x.tensors) {
              out.append(pyb::make_tuple(
                  d.name, std::string(dtype_name(d.dtype)), pyb::tuple(pyb::cast(d.shape)),
                  pyb::tuple(pyb::cast(d.strides)), d.segment, d.offset, d.nbytes));
            }
            return out;
          },
          "(name, dtype, shape, strides, segment, offset, nbytes) of every tensor.")
      .def("to_json", &manifest_to_json, "The manifest as compact JSON text (every field).")
      .def_static(
          "from_json",
          [](const std::string& text) {
            auto parsed = unwrap(manifest_from_json(text));
            unwrap(manifest_validate(parsed));
            return parsed;
          },
          pyb::arg("text"), "Parses and validates JSON text made by to_json().")
      .def("validate", [](const weight_update_manifest& x) { unwrap(manifest_validate(x)); })
      .def(pyb::self == pyb::self)  // NOLINT: pybind11 operator idiom
      .def(pyb::pickle([](const weight_update_manifest& x) { return manifest_to_json(x); },
                       [](const std::string& text) { return unwrap(manifest_from_json(text)); }))
      .def("__repr__", [](const weight_update_manifest& x) {
        return "Manifest(update_id=" + x.update_id + ", model_id=" + x.model_id +
               ", weight_version=" + std::to_string(x.weight_version) +
               ", transport=" + x.transport + ", tensors=" + std::to_string(x.tensors.size()) +
               ", total_bytes=" + std::to_string(x.total_bytes) + ")";
      });
}

void halves_bind(pyb::module_& m) {
  pyb::class_<segment>(m, "Segment", pyb::buffer_protocol(),
                       "Imported bytes (read-only); keeps its update's memory while it lives.")
      .def_buffer([](segment& s) {
        return pyb::buffer_info(const_cast<std::byte*>(s.data), 1,  // NOLINT: read-only buffer
                                pyb::format_descriptor<std::uint8_t>::format(), 1,
                                {static_cast<pyb::ssize_t>(s.nbytes)}, {1}, true);
      })
      .def_property_readonly(
          "address", [](const segment& s) { return reinterpret_cast<std::uintptr_t>(s.data); })
      .def_property_readonly("nbytes", [](const segment& s) { return s.nbytes; })
      .def("__len__", [](const segment& s) { return s.nbytes; });

  pyb::class_<device_segment>(
      m, "DeviceSegment",
      "Imported bytes in CUDA device memory; keeps its update's memory while it lives. "
      "torch.as_tensor(s, device=f'cuda:{s.device}') views it without a copy. Treat it as "
      "read-only: CUDA maps it writable, and a write changes the publisher's slot.")
      .def_property_readonly("__cuda_array_interface__",
                             [](const device_segment& s) {
                               pyb::dict d;
                               d["shape"] = pyb::make_tuple(s.nbytes);
                               d["typestr"] = "|u1";
                               // Read-only by convention only: torch refuses the flag set.
                               d["data"] =
                                   pyb::make_tuple(reinterpret_cast<std::uintptr_t>(s.data), false);
                               d["strides"] = pyb::none();
                               // Imports are ready on the legacy default stream (1).
                               d["stream"] = 1;
                               d["version"] = 3;
                               return d;
                             })
      .def_property_readonly(
          "address",
          [](const device_segment& s) { return reinterpret_cast<std::uintptr_t>(s.data); })
      .def_property_readonly("nbytes", [](const device_segment& s) { return s.nbytes; })
      .def_property_readonly("device", [](const device_segment& s) { return s.device; })
      .def("__len__", [](const device_segment& s) { return s.nbytes; });

  pyb::class_<publisher_half>(m, "Publisher")
      .def(pyb::init([](const std::string& transport, const transport_options& options,
                        const std::string& model_id, const std::string& source_worker,
                        std::int32_t source_rank, std::uint64_t max_segment_bytes,
                        unsigned copy_threads, std::int64_t slot_wait_ms,
                        std::uint64_t checksum_chunk_bytes) {
             publisher_config c;
             if (checksum_chunk_bytes > 0) {
               c.checksum = {checksum_algorithm::xxh3_64_chunked, checksum_chunk_bytes};
             }
             c.model_id = model_id;
             c.source_worker = source_worker.empty() ? default_worker() : source_worker;
             c.source_rank = source_rank;
             c.max_segment_bytes = max_segment_bytes;
             c.copy_threads = copy_threads;
             c.slot_wait = std::chrono::milliseconds(slot_wait_ms);
             c.release_when_answered = false;  // the bridge's caller releases explicitly
             return std::make_unique<publisher_half>(transport, options, c);
           }),
           pyb::arg("transport"), pyb::arg("options"), pyb::arg("model_id"),
           pyb::arg("source_worker"), pyb::arg("source_rank"), pyb::arg("max_segment_bytes"),
           pyb::arg("copy_threads"), pyb::arg("slot_wait_ms"), pyb::arg("checksum_chunk_bytes"))
      .def("publish", &publisher_half::publish)
      .def("release", &publisher_half::release)
      .def("last_version", &publisher_half::last_version)
      .def("held", &publisher_half::held);

  pyb::class_<consumer_half>(m, "Consumer")
      .def(pyb::init<const std::string&, const transport_options&, std::int32_t, unsigned>(),
           pyb::arg("transport"), pyb::arg("options"), pyb::arg("rank"), pyb::arg("verify_threads"))
      .def("import_update", &consumer_half::import_update)
      .def("verify", &consumer_half::verify)
      .def("mark_installed", &consumer_half::mark_installed)
      .def("acknowledge", &consumer_half::acknowledge)
      .def("reject", &consumer_half::reject)
      .def("release", &consumer_half::release)
      .def("state", &consumer_half::state);

  pyb::class_<executor_handle>(m, "Executor")
      .def(pyb::init<consumer_half&, pyb::object, bool>(), pyb::keep_alive<1, 2>(),
           pyb::arg("consumer"), pyb::arg("installer"), pyb::arg("verify"))
      .def("update_weights", &executor_handle::update_weights)
      .def("active_version", &executor_handle::active_version)
      .def("release_active", &executor_handle::release_active)
      .def(
          "gate_enter", [](executor_handle& e) { return std::make_unique<gate_ticket>(e.meter()); },
          pyb::keep_alive<0, 1>())
      .def("longest_wait",
           [](executor_handle& e) {
             return static_cast<double>(e.meter().longest_wait_ns.load()) / 1e9;
           })
      .def("reset_longest_wait", [](executor_handle& e) { e.meter().reset(); })
      .def("gate_waiting_installs",
           [](executor_handle& e) { return e.meter().gate.waiting_writers(); });
}

}  // namespace
}  // namespace wsync::py

PYBIND11_MODULE(_wsync, m) {
  using namespace wsync::py;
  m.doc() = "wsync's C++ core; use the `wsync` package, not this module.";
  main_thread_remember();
  errors_bind(m);
  manifest_bind(m);
  halves_bind(m);
  gate_ticket_bind(m);
  cluster_bind(m);
  m.def(
      "transports", [] { return wsync::builtin_transports().names(); },
      "Names of the transports built into this module.");
  m.def(
      "layout",
      [](const std::string& name) {
        auto l = unwrap(wsync::layout_parse(name));
        pybind11::list out;
        for (const auto& t : l.tensors) {
          out.append(
              pybind11::make_tuple(t.name, std::string(wsync::dtype_name(t.dtype)), t.shape));
        }
        return out;
      },
      pybind11::arg("name"),
      "A model layout's tensors as (name, dtype, shape): a real checkpoint's (\"qwen2.5-0.5b\", "
      "...) or \"synthetic:<bytes>:<tensors>\".");
  m.def(
      "dtype_parse",
      [](const std::string& name) -> std::optional<std::string> {
        auto t = wsync::dtype_parse(name);
        if (!t) return std::nullopt;
        return std::string(wsync::dtype_name(*t));
      },
      pybind11::arg("name"), "The wire name of a dtype spelled the wsync or the torch way; None.");
  m.def(
      "dtype_torch_name",
      [](const std::string& wire) {
        auto t = wsync::dtype_parse(wire);
        return t ? std::string(wsync::dtype_torch_name(*t)) : wire;
      },
      pybind11::arg("wire"),
      "torch's attribute name for a wire dtype name (\"bf16\" -> "
      "\"bfloat16\").");
  m.def(
      "dtype_names",
      [] {
        std::vector<std::string> out;
        for (auto t : wsync::dtype_all()) out.emplace_back(wsync::dtype_name(t));
        return out;
      },
      "Every wire dtype name wsync carries.");
  m.def(
      "gpu_ready",
      [] {
        auto r = wsync::gpu::ready();
        return r ? std::string() : r.error().message;
      },
      "\"\" when this module can drive a CUDA device; otherwise why not (\"blocked: ...\").");
  m.def("releases_pending", &releases_pending,
        "Update ids whose release waits for views still alive in this process.");
}
