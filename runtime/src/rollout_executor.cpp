#include "wsync/runtime/rollout_executor.hpp"

#include <chrono>

#include "wsync/manifest/log.hpp"

namespace wsync {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point& t) {
  auto now = clock_type::now();
  double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

}  // namespace

rollout_executor::rollout_executor(weight_consumer& consumer, install_adapter& adapter,
                                   generation_gate& gate, executor_config config)
    : consumer_(consumer), adapter_(adapter), gate_(gate), config_(config) {}

rollout_executor::~rollout_executor() {
  release_active();
}

rollout_report rollout_executor::update_weights(const weight_update_manifest& manifest) {
  std::lock_guard lock(mutex_);
  rollout_report report;
  report.id = manifest.update_id;
  report.weight_version = manifest.weight_version;
  auto start = clock_type::now();
  auto t = start;

  // Any failure: reject with the reason, give the new update back, keep the previous version.
  auto fail = [&](wsync::error err, bool imported) {
    log_warn("rejecting update: " + err.message);
    if (imported) {
      (void)consumer_.reject(report.id, err.message);
      (void)consumer_.release(report.id);
      report.released_self = true;
    }
    report.failure = std::move(err);
    report.timings.total = std::chrono::duration<double>(clock_type::now() - start).count();
    return report;
  };

  auto imported = consumer_.import_update(manifest);
  report.timings.import = seconds_since(t);
  if (!imported) return fail(imported.error(), false);

  if (config_.verify) {
    auto verified = consumer_.verify(report.id);
    report.timings.verify = seconds_since(t);
    if (!verified) return fail(verified.error(), true);
  }

  if (auto staged = adapter_.stage(**imported); !staged) return fail(staged.error(), true);
  if (auto installed = consumer_.mark_installed(report.id); !installed) {
    adapter_.discard(report.id);
    return fail(installed.error(), true);
  }
  {
    std::unique_lock exclusive(gate_);
    adapter_.activate(report.id);
  }
  report.timings.install = seconds_since(t);

  if (auto acked = consumer_.acknowledge(report.id); !acked) {
    // Only a concurrent caller touching this update can cause this; readers already see it.
    log_error("acknowledge after install failed: " + acked.error().message);
  } else {
    report.acknowledged = true;
  }
  report.timings.ack = seconds_since(t);

  active_version_ = manifest.weight_version;
  active_id_ = report.id;
  // The previous import is no longer read by anyone: the gate was held exclusively above.
  if (held_) {
    if (auto released = consumer_.release(*held_); !released) {
      log_error("release of the previous update failed: " + released.error().message);
    }
    report.released = held_;
    held_.reset();
  }
  if (adapter_.references_import()) {
    held_ = report.id;
  } else {
    (void)consumer_.release(report.id);
    report.released_self = true;
  }
  report.timings.release = seconds_since(t);
  report.timings.total = std::chrono::duration<double>(clock_type::now() - start).count();
  return report;
}

std::optional<std::uint64_t> rollout_executor::active_weight_version() const {
  std::lock_guard lock(mutex_);
  return active_version_;
}

std::optional<update_id> rollout_executor::active_update() const {
  std::lock_guard lock(mutex_);
  return active_id_;
}

void rollout_executor::release_active() {
  std::lock_guard lock(mutex_);
  if (held_) {
    (void)consumer_.release(*held_);
    held_.reset();
  }
}

}  // namespace wsync
