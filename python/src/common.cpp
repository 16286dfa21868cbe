// Shared pieces of the bindings (common.hpp).

#include "common.hpp"

#include "wsync/manifest/log.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync::py {

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

std::vector<tensor_source> sources_from(const pyb::list& tensors) {
  std::vector<tensor_source> out;
  out.reserve(tensors.size());
  for (const auto& item : tensors) {
    auto t = item.cast<pyb::tuple>();
    if (t.size() != 5) raise(errc::invalid_argument, "tensor tuple must have 5 fields");
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
    out.push_back(std::move(s));
  }
  return out;
}

pyb::list segments_to_py(const update_id& id, const std::vector<std::span<const std::byte>>& segs) {
  auto lease = std::make_shared<view_lease>(id);
  pyb::list out;
  for (const auto& s : segs) out.append(segment{s.data(), s.size(), lease});
  return out;
}

double gate_meter::enter() {
  const auto t0 = std::chrono::steady_clock::now();
  {
    pyb::gil_scoped_release unlocked;
    gate.lock_shared();
  }
  const auto waited =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  auto w = static_cast<std::uint64_t>(waited);
  auto prev = longest_wait_ns.load();
  while (w > prev && !longest_wait_ns.compare_exchange_weak(prev, w)) {
  }
  ++readers_total;
  return static_cast<double>(waited) / 1e9;
}

python_adapter::python_adapter(pyb::object target) : target_(std::move(target)) {
  references_import_ = pyb::bool_(target_.attr("references_import"));
}

python_adapter::~python_adapter() {
  pyb::gil_scoped_acquire gil;
  target_ = pyb::object();
}

namespace {
std::string python_failure(const char* what, pyb::error_already_set& e) {
  std::string text = e.what();
  e.restore();
  PyErr_Clear();
  return std::string(what) + ": " + text;
}
}  // namespace

result<void> python_adapter::stage(std::span<const imported_update* const> shards) {
  pyb::gil_scoped_acquire gil;
  try {
    pyb::list parts;
    for (const auto* u : shards) {
      parts.append(pyb::make_tuple(pyb::cast(u->manifest),
                                   segments_to_py(u->manifest.update_id, u->segments)));
    }
    target_.attr("stage")(shards.front()->manifest.update_id, parts);
    return {};
  } catch (pyb::error_already_set& e) {
    // A WeightSyncError from the installer carries its own text; anything else is named.
    if (e.matches(pyb::module_::import("wsync._errors").attr("WeightSyncError"))) {
      std::string message = pyb::str(e.value());
      PyErr_Clear();
      return make_error(errc::install_failed, message);
    }
    return make_error(errc::install_failed, python_failure("install failed", e));
  }
}

void python_adapter::activate(const update_id& id) noexcept {
  pyb::gil_scoped_acquire gil;
  try {
    target_.attr("activate")(id);
  } catch (pyb::error_already_set& e) {
    log_error(python_failure("activate raised (it must not)", e));
  } catch (...) {
    log_error("activate raised (it must not)");
  }
}

void python_adapter::discard(const update_id& id) noexcept {
  pyb::gil_scoped_acquire gil;
  try {
    target_.attr("discard")(id);
  } catch (pyb::error_already_set& e) {
    log_error(python_failure("discard raised", e));
  } catch (...) {
    log_error("discard raised");
  }
}

}  // namespace wsync::py
