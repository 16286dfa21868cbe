// Shared pieces of the bindings (common.hpp).

#include "common.hpp"

#include <cstring>
#include <set>
#include <thread>

#include "wsync/manifest/log.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync::py {

namespace {

std::atomic<unsigned long> main_thread_ident{0};

// Never returns in a thread other than the main one while the interpreter shuts down: taking the
// GIL there would end the thread inside a noexcept frame (an abort). The exiting process ends
// it. Called right before taking the GIL back (gil_released, gil_taken).
void park_if_exiting() {
  if (interpreter_finalizing() && PyThread_get_thread_ident() != main_thread_ident.load()) {
    while (true) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

// Ctrl-C or sys.exit() raised inside a Python callback: kept and raised by the call that made it.
bool is_interrupt(pyb::error_already_set& e) {
  return e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit);
}

}  // namespace

void main_thread_remember() {
  main_thread_ident =
      pyb::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
}

gil_released::gil_released() : state_(PyEval_SaveThread()) {}

gil_released::~gil_released() {
  park_if_exiting();
  PyEval_RestoreThread(state_);
}

gil_taken::gil_taken() {
  park_if_exiting();
  gil_.emplace();
}

void errors_bind(pyb::module_& m) {
  (void)m;
  pyb::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const raised& e) {
      auto errors = pyb::module_::import("wsync._errors");
      pyb::object exc = errors.attr("error_for")(std::string(errc_name(e.err.code)), e.err.message);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
}

pyb::dict report_to_py(const rollout_report& r) {
  pyb::dict out;
  out["update_id"] = r.id;
  out["weight_version"] = r.weight_version;
  out["acknowledged"] = r.acknowledged;
  out["error_code"] = r.failure ? pyb::cast(std::string(errc_name(r.failure->code))) : pyb::none();
  out["error"] = r.failure ? pyb::cast(r.failure->message) : pyb::none();
  out["released"] = r.released;
  pyb::dict t;
  t["import"] = r.timings.import;
  t["verify"] = r.timings.verify;
  t["install"] = r.timings.install;
  t["ack"] = r.timings.ack;
  t["release"] = r.timings.release;
  t["total"] = r.timings.total;
  out["timings"] = t;
  return out;
}

std::vector<tensor_source> sources_from(const pyb::list& tensors) {
  std::vector<tensor_source> out;
  out.reserve(tensors.size());
  for (const auto& item : tensors) {
    auto t = item.cast<pyb::tuple>();
    // (name, dtype, shape, address, nbytes[, cuda_device, cudaStream_t]): a CUDA tensor adds
    // where it lives and the stream that produces it (0: the legacy default stream).
    if (t.size() != 5 && t.size() != 7) {
      raise(errc::invalid_argument, "tensor tuple must have 5 or 7 fields");
    }
    tensor_source s;
    s.name = t[0].cast<std::string>();
    auto dtype_text = t[1].cast<std::string>();
    auto parsed = dtype_parse(dtype_text);
    if (!parsed) {
      raise(errc::invalid_argument,
            "tensor " + s.name + ": field dtype: wsync cannot carry '" + dtype_text + "'");
    }
    s.dtype = *parsed;
    s.shape = t[2].cast<std::vector<std::int64_t>>();
    s.data = reinterpret_cast<const std::byte*>(t[3].cast<std::uintptr_t>());
    s.nbytes = t[4].cast<std::uint64_t>();
    if (t.size() == 7) {
      s.cuda_device = t[5].cast<int>();
      if (s.cuda_device < 0) {
        raise(errc::invalid_argument, "tensor " + s.name + ": field cuda_device: " +
                                          std::to_string(s.cuda_device) + " is not a device");
      }
      s.stream = reinterpret_cast<void*>(t[6].cast<std::uintptr_t>());
    }
    out.push_back(std::move(s));
  }
  return out;
}

pyb::list segments_to_py(const update_id& id, const std::vector<std::span<const std::byte>>& segs,
                         memory_location where) {
  auto lease = std::make_shared<view_lease>(id);
  pyb::list out;
  for (const auto& s : segs) {
    if (where.host()) {
      out.append(segment{s.data(), s.size(), lease});
    } else {
      out.append(device_segment{s.data(), s.size(), where.cuda_device, lease});
    }
  }
  return out;
}

double gate_meter::enter() {
  // The wait is the time an install held this step back at the gate; taking the GIL back, or
  // the CPU being busy elsewhere, are not the install's pause.
  std::chrono::nanoseconds held_back{0};
  {
    gil_released unlocked;
    held_back = gate.lock_shared_timed();
  }
  auto w = static_cast<std::uint64_t>(held_back.count());
  auto prev = longest_wait_ns.load();
  while (w > prev && !longest_wait_ns.compare_exchange_weak(prev, w)) {
  }
  ++readers_total;
  return static_cast<double>(w) / 1e9;
}

void gate_ticket_bind(pyb::module_& m) {
  pyb::class_<gate_ticket>(m, "GateTicket", "One generation step's hold on the gate.")
      .def("exit", &gate_ticket::exit, "Leaves the gate (once; later calls do nothing).")
      .def_property_readonly("waited", &gate_ticket::waited,
                             "Seconds an install held this step back.");
}

python_adapter::python_adapter(pyb::object target) : target_(std::move(target)) {
  references_import_ = pyb::bool_(target_.attr("references_import"));
  swaps_slots_ = pyb::hasattr(target_, "slots");
  swaps_views_ = !swaps_slots_ && pyb::hasattr(target_, "_switch_views");
}

python_adapter::~python_adapter() {
  gil_taken gil;
  interrupt_.reset();
  target_ = pyb::object();
}

void python_adapter::take_interrupt() {
  if (!interrupt_) return;
  auto e = std::move(*interrupt_);
  interrupt_.reset();
  throw e;
}

void python_adapter::swap_slots(const update_id& id) {
  // C API calls only (dict.pop, getattr and setattr of C properties): no bytecode, so no
  // signal handler can run in the middle.
  pyb::list slots = target_.attr("slots");
  pyb::list staged = target_.attr("_staged").attr("pop")(id);
  pyb::object active = target_.attr("_active");
  if (active.is_none()) {
    pyb::list own;
    for (const auto& t : slots) own.append(t.attr("data"));
    active = own;
  }
  const auto n = std::min(pyb::len(slots), pyb::len(staged));
  for (std::size_t i = 0; i < n; ++i) slots[i].attr("data") = staged[i];
  target_.attr("_spare") = active;
  target_.attr("_active") = staged;
  target_.attr("active_update") = pyb::str(id);
}

void python_adapter::swap_views(const update_id& id) {
  // As swap_slots: dict.pop and a plain setattr run no bytecode, so a Ctrl-C that arrived while
  // the switch waited for the gate fires after it, never between the ack and the switch.
  target_.attr("active") = target_.attr("_staged").attr("pop")(id);
}

namespace {
std::string python_failure(const std::string& what, pyb::error_already_set& e) {
  std::string text = e.what();
  e.restore();
  PyErr_Clear();
  return what + ": " + text;
}
}  // namespace

namespace {

// One copy the installer asked for: manifest tensor bytes into its own (spare) memory, in host
// memory (dest_device -1) or on a CUDA device.
struct copy_job {
  std::byte* dest = nullptr;
  std::size_t shard = 0, segment = 0;
  std::uint64_t offset = 0, nbytes = 0;
  int dest_device = -1;
};

// Copies from or to device memory: on a stream of the device that holds the destination (else
// the source's), queued after the work already on the legacy default stream (torch's default) of
// that device, where kernels of the previous generation may still read the spare being
// overwritten, and of the source's device, where the import is ready. Waited for, failures
// included (the caller then frees the spares).
result<void> run_device_copies(std::span<const imported_update* const> shards,
                               const std::vector<const copy_job*>& jobs) {
  gpu::device_kept kept;  // torch's current device is the caller's again afterwards
  std::map<int, gpu::stream> streams;
  std::set<std::pair<int, int>> waited;  // (stream's device, device waited for)
  auto finish = [&](result<void> r) {
    for (auto& [device, s] : streams) {
      if (auto ok = s.synchronize(); !ok && r) r = ok.error();
    }
    return r;
  };
  for (const auto* j : jobs) {
    const auto& from = *shards[j->shard];
    const int device = j->dest_device >= 0 ? j->dest_device : from.memory.cuda_device;
    auto it = streams.find(device);
    if (it == streams.end()) {
      auto s = gpu::stream::make(device);
      if (!s) return finish(s.error());
      it = streams.emplace(device, std::move(*s)).first;
    }
    for (int producer : {device, from.memory.cuda_device}) {
      if (producer < 0 || !waited.emplace(device, producer).second) continue;
      if (auto ok = it->second.wait_for(nullptr, producer); !ok) return finish(ok.error());
    }
    if (auto ok = it->second.copy(j->dest, from.segments[j->segment].data() + j->offset, j->nbytes);
        !ok) {
      return finish(ok.error());
    }
  }
  return finish({});
}

// Runs the copies without the GIL, split over two threads when there is much to copy.
result<void> run_copies(std::span<const imported_update* const> shards,
                        const std::vector<copy_job>& jobs) {
  std::uint64_t total = 0;
  for (const auto& j : jobs) {
    if (j.shard >= shards.size() || j.segment >= shards[j.shard]->segments.size() ||
        j.offset > shards[j.shard]->segments[j.segment].size() ||
        j.nbytes > shards[j.shard]->segments[j.segment].size() - j.offset || !j.dest) {
      return make_error(errc::install_failed,
                        "install: the installer asked for a copy outside the update (shard " +
                            std::to_string(j.shard) + ", segment " + std::to_string(j.segment) +
                            ", offset " + std::to_string(j.offset) + ")");
    }
    total += j.nbytes;
  }
  std::vector<const copy_job*> on_device;
  std::vector<const copy_job*> on_host;
  for (const auto& j : jobs) {
    (j.dest_device >= 0 || !shards[j.shard]->memory.host() ? on_device : on_host).push_back(&j);
  }
  if (!on_device.empty()) {
    if (auto ok = run_device_copies(shards, on_device); !ok) {
      return make_error(errc::install_failed, "install failed: " + ok.error().message + " (" +
                                                  update_context(shards.front()->manifest) + ")");
    }
  }
  auto copy = [&](std::size_t first, std::size_t step) {
    for (std::size_t i = first; i < on_host.size(); i += step) {
      const auto& j = *on_host[i];
      std::memcpy(j.dest, shards[j.shard]->segments[j.segment].data() + j.offset, j.nbytes);
    }
  };
  if (total < (std::uint64_t{64} << 20) || on_host.size() < 2) {
    copy(0, 1);
  } else {
    std::thread other(copy, 1, 2);
    copy(0, 2);
    other.join();
  }
  return {};
}

}  // namespace

result<void> python_adapter::stage(std::span<const imported_update* const> shards) {
  const auto& id = shards.front()->manifest.update_id;
  std::vector<copy_job> jobs;
  {
    gil_taken gil;
    // Once stage() is called, any failure discards: a stage interrupted (Ctrl-C) between its
    // own steps may have staged already, and a staged copy of the model would stay for good.
    bool asked = false;
    try {
      pyb::list parts;
      for (const auto* u : shards) {
        parts.append(pyb::make_tuple(
            pyb::cast(u->manifest), segments_to_py(u->manifest.update_id, u->segments, u->memory)));
      }
      asked = true;
      pyb::object jobs_asked = target_.attr("stage")(id, parts);
      if (!jobs_asked.is_none()) {
        for (const auto& item : jobs_asked) {
          auto t = item.cast<pyb::tuple>();
          copy_job j{reinterpret_cast<std::byte*>(t[0].cast<std::uintptr_t>()),
                     t[1].cast<std::size_t>(),
                     t[2].cast<std::size_t>(),
                     t[3].cast<std::uint64_t>(),
                     t[4].cast<std::uint64_t>(),
                     t.size() > 5 ? t[5].cast<int>() : -1};
          if (j.nbytes > 0) jobs.push_back(j);
        }
      }
    } catch (pyb::error_already_set& e) {
      if (asked) discard(id);
      if (is_interrupt(e)) {
        interrupt_.emplace(std::move(e));
        return make_error(errc::install_failed, "install interrupted (" + std::string(id) + ")");
      }
      // A WeightSyncError from the installer carries its own text; anything else is named.
      if (e.matches(pyb::module_::import("wsync._errors").attr("WeightSyncError"))) {
        std::string message = pyb::str(e.value());
        return make_error(errc::install_failed, message);
      }
      return make_error(errc::install_failed, python_failure("install failed", e));
    } catch (const std::exception& e) {
      if (asked) discard(id);
      return make_error(errc::install_failed,
                        std::string("install failed: the installer's copy jobs: ") + e.what());
    }
  }
  if (jobs.empty()) return {};
  auto copied = run_copies(shards, jobs);
  if (!copied) discard(id);
  return copied;
}

void python_adapter::activate(const update_id& id) noexcept {
  gil_taken gil;
  try {
    if (swaps_slots_) {
      swap_slots(id);
      return;
    }
    if (swaps_views_) {
      swap_views(id);
      return;
    }
    target_.attr("activate")(id);
  } catch (pyb::error_already_set& e) {
    // A custom installer's activate is Python: a Ctrl-C may stop it. The executor has switched
    // already; the interrupt is raised once update_weights returns, never swallowed.
    if (is_interrupt(e) && !interrupt_) {
      log_error("activate of " + std::string(id) +
                " was interrupted: the installer's switch may be incomplete");
      interrupt_.emplace(std::move(e));
      return;
    }
    log_error(
        python_failure("activate of update_id=" + std::string(id) + " raised (it must not)", e));
  } catch (...) {
    log_error("activate of update_id=" + std::string(id) + " raised (it must not)");
  }
}

void python_adapter::discard(const update_id& id) noexcept {
  gil_taken gil;
  // A Ctrl-C pending as the installer's discard starts stops it at its first line, before it
  // let go of anything: a staged copy (or views, holding the import) would stay for good. The
  // interrupt is kept, raised once update_weights returns, and the discard runs again.
  for (int attempt = 0; attempt < 3; ++attempt) {
    try {
      target_.attr("discard")(id);
      return;
    } catch (pyb::error_already_set& e) {
      if (is_interrupt(e)) {
        if (!interrupt_) interrupt_.emplace(std::move(e));
        continue;
      }
      log_error(python_failure("discard of update_id=" + std::string(id) + " raised", e));
      return;
    } catch (...) {
      log_error("discard of update_id=" + std::string(id) + " raised");
      return;
    }
  }
  log_error("discard of update_id=" + std::string(id) +
            " was interrupted three times: what it staged may stay");
}

bool python_adapter::deactivate() noexcept {
  gil_taken gil;
  try {
    if (swaps_views_) {
      // A plain setattr, as swap_views: readers after this find no weights. The views dropped
      // here only drop their leases; the executor releases the imports right after.
      target_.attr("active") = pyb::dict();
      return true;
    }
    if (swaps_slots_ || !pyb::hasattr(target_, "deactivate")) return false;
    return pyb::bool_(target_.attr("deactivate")());
  } catch (pyb::error_already_set& e) {
    // A Ctrl-C in a custom installer's deactivate: kept, raised once release_weights returns
    // (its weights stay as they were; the views' leases keep the memory they point into).
    if (is_interrupt(e) && !interrupt_) {
      interrupt_.emplace(std::move(e));
      return false;
    }
    log_error(python_failure("deactivate raised", e));
  } catch (...) {
    log_error("deactivate raised");
  }
  return false;
}

}  // namespace wsync::py
