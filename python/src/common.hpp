#pragma once
// What the bindings share: errors raised as wsync.WeightSyncError subclasses, tensors passed in
// from Python, imported segments passed out, and the install adapter that calls back into
// Python under the generation gate.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "views.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/runtime/generation_gate.hpp"
#include "wsync/runtime/install_adapter.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync::py {

namespace pyb = pybind11;

/// Gives up the GIL for C++ work, like pybind11's gil_scoped_release, but never takes it back
/// in another thread while the interpreter shuts down. A call that Ctrl-C abandoned goes on in a
/// daemon thread (python/wsync/_cluster.py); should it return then, Python would end the thread
/// inside this destructor (pthread_exit through a noexcept frame), and the exiting process would
/// abort with a core dump instead of exiting. Such a thread parks; the exiting process ends it.
/// The main thread, which runs the shutdown (and destructors during it), takes the GIL back.
class gil_released {
 public:
  gil_released();
  ~gil_released();
  gil_released(const gil_released&) = delete;
  gil_released& operator=(const gil_released&) = delete;

 private:
  PyThreadState* state_;
};
/// Takes the GIL back in a thread that gave it up, like pybind11's gil_scoped_acquire, with the
/// same care as gil_released: while the interpreter shuts down, a thread other than the main one
/// parks here instead (taking the GIL would end it inside a noexcept frame: an abort).
class gil_taken {
 public:
  gil_taken();
  gil_taken(const gil_taken&) = delete;
  gil_taken& operator=(const gil_taken&) = delete;

 private:
  std::optional<pyb::gil_scoped_acquire> gil_;
};
/// Called once at import: which thread is the main one (threading.main_thread()).
void main_thread_remember();

/// A wsync error on its way to Python; translated to wsync._errors.error_for(code, message).
struct raised {
  wsync::error err;
};

/// Throws `raised` for an error result, returns the value otherwise.
template <class T>
T unwrap(result<T> r) {
  if (!r) throw raised{r.error()};
  return std::move(r).value();
}
inline void unwrap(result<void> r) {
  if (!r) throw raised{r.error()};
}
[[noreturn]] inline void raise(errc code, std::string message) {
  throw raised{make_error(code, std::move(message))};
}

/// What an executor did with one update, as a dict: update_id, weight_version, acknowledged,
/// error_code and error (None when acknowledged), released, and timings (seconds per stage).
pyb::dict report_to_py(const rollout_report& r);

/// Registers the translator (module init).
void errors_bind(pyb::module_& m);

/// Python's tensor tuples (name, dtype name, shape, data pointer, nbytes[, CUDA device, CUDA
/// stream]) as publish sources. The tensors must be contiguous (wsync/_torch.py makes them so)
/// and stay alive during the call.
std::vector<tensor_source> sources_from(const pyb::list& tensors);

/// The imported segments of one update, all holding one lease: `Segment` objects (buffer
/// protocol) for host memory, `DeviceSegment` objects (__cuda_array_interface__) for a device's.
pyb::list segments_to_py(const update_id& id, const std::vector<std::span<const std::byte>>& segs,
                         memory_location where);

/// The generation gate plus the longest any reader waited at it (the install pause).
struct gate_meter {
  generation_gate gate;
  std::atomic<std::uint64_t> longest_wait_ns{0};
  std::atomic<std::uint64_t> readers_total{0};
  /// Enters the shared side with the GIL released; returns the seconds an install held it
  /// back (generation_gate::lock_shared_timed).
  double enter();
  void exit() { gate.unlock_shared(); }
  void reset() { longest_wait_ns = 0; }
};

/// One generation step's hold on the gate, as a Python object: leaving it twice is harmless,
/// and an object dropped without leaving (Ctrl-C between entering and the `try`) leaves in its
/// destructor, so the gate is never held forever.
class gate_ticket {
 public:
  explicit gate_ticket(gate_meter& meter) : meter_(&meter), waited_(meter.enter()) {}
  ~gate_ticket() { exit(); }
  gate_ticket(const gate_ticket&) = delete;
  gate_ticket& operator=(const gate_ticket&) = delete;
  void exit() {
    if (meter_) std::exchange(meter_, nullptr)->exit();
  }
  double waited() const { return waited_; }

 private:
  gate_meter* meter_;
  double waited_;
};

/// Binds gate_ticket (module init).
void gate_ticket_bind(pyb::module_& m);

/// An install_adapter whose stage/activate/discard are a Python object's methods:
/// stage(update_id, shards) with shards a list of (Manifest, [Segment]), activate(update_id),
/// discard(update_id), and the attribute references_import (bool). stage() may return copy
/// jobs, (dest address, shard index, segment index, offset, nbytes) each, which the adapter runs
/// after giving the GIL back: the bulk of an install never holds up other Python threads.
/// An installer with a `slots` attribute (a list of tensors) is switched by the adapter itself,
/// through the C API: each slot's `.data` becomes the staged list `_staged.pop(update_id)`, the
/// previous tensors go to `_spare`. One with `_switch_views` (ViewInstaller) gets
/// `active = _staged.pop(update_id)` the same way. No Python bytecode runs, so a Ctrl-C cannot
/// stop a switch half-way. A KeyboardInterrupt raised while staging fails the update, and one
/// that stops a custom installer's activate (after the executor switched) is kept too: the
/// caller re-raises it (take_interrupt).
class python_adapter final : public install_adapter {
 public:
  explicit python_adapter(pyb::object target);
  ~python_adapter() override;
  result<void> stage(std::span<const imported_update* const> shards) override;
  void activate(const update_id& id) noexcept override;
  void discard(const update_id& id) noexcept override;
  bool references_import() const override { return references_import_; }
  /// ViewInstaller: `active = {}` (the executor releases the imports next); a custom installer
  /// whose weights reference the import: its `deactivate()`, if it has one, true when it
  /// returns a true value. Others keep their weights (false).
  bool deactivate() noexcept override;

  /// Throws the KeyboardInterrupt (or SystemExit) that stopped the last stage, activate or
  /// deactivate, if any. GIL held.
  void take_interrupt();

 private:
  void swap_slots(const update_id& id);
  void swap_views(const update_id& id);

  pyb::object target_;
  bool references_import_ = false;
  bool swaps_slots_ = false;
  bool swaps_views_ = false;  ///< ViewInstaller: `active = _staged.pop(id)`, done here
  std::optional<pyb::error_already_set> interrupt_;
};

/// Runs `fn` with SIGINT and SIGTERM left as they were in the calling thread: the cluster's
/// actor system blocks them for its threads (so a signal reaches Python's main thread), but
/// must not take Ctrl-C away from the interpreter.
template <class F>
decltype(auto) keeping_signal_mask(F&& fn);

}  // namespace wsync::py

#include <signal.h>

template <class F>
decltype(auto) wsync::py::keeping_signal_mask(F&& fn) {
  sigset_t old;
  pthread_sigmask(SIG_SETMASK, nullptr, &old);
  struct restore {
    sigset_t mask;
    ~restore() { pthread_sigmask(SIG_SETMASK, &mask, nullptr); }
  } r{old};
  return fn();
}
