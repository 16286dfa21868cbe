#include "wsync/runtime/rollout_executor.hpp"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

#include "wsync/manifest/log.hpp"
#include "wsync/manifest/validate.hpp"

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
  try {
    release_active();
  } catch (...) {  // out of memory in a transport's release: a destructor must not throw
    log_error("rollout executor: releasing the active imports failed at shutdown");
  }
}

namespace {

// Shards of one update: same model and version, distinct publisher ranks and update ids, no
// tensor in two shards.
result<void> shards_check(std::span<const manifest_ptr> shards, std::int32_t rank) {
  if (shards.empty()) {
    return make_error(errc::invalid_argument,
                      "invalid update: no shards (rank=" + std::to_string(rank) + ")");
  }
  for (std::size_t i = 0; i < shards.size(); ++i) {
    if (!shards[i]) {
      return make_error(errc::invalid_argument, "invalid update: shards[" + std::to_string(i) +
                                                    "]: no manifest (rank=" + std::to_string(rank) +
                                                    ")");
    }
  }
  const auto& first = *shards.front();
  // Names are compared with earlier shards' only: a tensor named twice within one shard is the
  // validator's to refuse, in its own words. (Sized for valid shards; a larger one grows it.)
  std::size_t expected = 0;
  for (const auto& shard : shards) {
    expected += std::min<std::size_t>(shard->tensors.size(), manifest_limits{}.max_tensors);
  }
  name_set names(shards.size() > 1 ? expected : 0);
  std::set<std::int32_t> sources;
  std::set<std::string_view> ids;
  for (const auto& shard : shards) {
    const auto& m = *shard;
    auto where = " (" + update_context(m.update_id, rank) + ")";
    if (m.model_id != first.model_id || m.weight_version != first.weight_version) {
      const char* field = m.model_id != first.model_id ? "model_id" : "weight_version";
      return make_error(errc::invalid_manifest,
                        std::string("invalid manifest: ") + field +
                            ": shards of one update must share model_id and weight_version (" +
                            update_key(first.model_id, first.weight_version) + " vs " +
                            update_key(m.model_id, m.weight_version) + ")" + where);
    }
    if (!sources.insert(m.source_rank).second) {
      return make_error(errc::invalid_manifest,
                        "invalid manifest: source_rank: two shards from source_rank " +
                            std::to_string(m.source_rank) + where);
    }
    if (!ids.insert(m.update_id).second) {
      return make_error(errc::invalid_manifest,
                        "invalid manifest: update_id: two shards of one update_id" + where);
    }
    if (shards.size() == 1) break;
    for (const auto& t : m.tensors) {
      if (names.contains(t.name)) {
        return make_error(errc::invalid_manifest, "invalid manifest: tensors: \"" + t.name +
                                                      "\" appears in two shards" + where);
      }
    }
    for (const auto& t : m.tensors) names.insert(t.name);
  }
  return {};
}

}  // namespace

// Imports, verifies and stages the shards; on failure what was imported is in `imported_ids`
// and nothing is staged.
result<void> rollout_executor::import_and_stage(std::span<const manifest_ptr> shards,
                                                rollout_report& report,
                                                std::vector<update_id>& imported_ids,
                                                std::chrono::steady_clock::time_point& t) {
  std::vector<const imported_update*> parts;
  // Room first: an import must never succeed without being on record (it would stay held).
  parts.reserve(shards.size());
  imported_ids.reserve(shards.size());
  for (const auto& m : shards) {
    // On record before it exists (copying the id allocates): an import that succeeded is
    // never left held and unrecorded.
    imported_ids.push_back(m->update_id);
    struct unrecord {  // taken off again when the import fails or throws
      std::vector<update_id>& ids;
      bool imported = false;
      ~unrecord() {
        if (!imported) ids.pop_back();
      }
    } record{imported_ids};
    auto imported = consumer_.import_update(m);
    if (!imported) return imported.error();
    record.imported = true;
    parts.push_back(*imported);
  }
  // The adapter sees shards by source rank, whatever order they came in (HTTP and Python
  // callers keep arrival order), so the same model always stages the same way.
  std::stable_sort(parts.begin(), parts.end(), [](const auto* a, const auto* b) {
    return a->manifest.source_rank < b->manifest.source_rank;
  });
  report.timings.import = seconds_since(t);

  if (config_.verify) {
    for (const auto& id : imported_ids) {
      if (auto verified = consumer_.verify(id); !verified) return verified.error();
    }
    report.timings.verify = seconds_since(t);
  }

  if (auto staged = adapter_.stage(parts); !staged) {
    auto e = staged.error();
    // An installer's own text (a Python exception's, say) does not know the update.
    const auto& id = parts.front()->manifest.update_id;
    if (e.message.find(id) == std::string::npos) e.message += " for update_id=" + id;
    e.message += " at consumer rank " + std::to_string(consumer_.rank());
    return e;
  }
  // The bytes must not have changed since they were verified (a publisher that reused the
  // memory under this rank): a copy could mix two versions, and views would open onto memory
  // being rewritten. Checked before the switch, so readers never see either.
  for (const auto& id : imported_ids) {
    if (auto whole = consumer_.intact(id); !whole) {
      adapter_.discard(report.id);
      return whole.error();
    }
  }
  for (const auto& id : imported_ids) {
    if (auto installed = consumer_.mark_installed(id); !installed) {
      adapter_.discard(report.id);
      return installed.error();
    }
  }
  return {};
}

rollout_report rollout_executor::update_weights(std::span<const weight_update_manifest> shards) {
  std::vector<manifest_ptr> shared;
  try {
    shared.reserve(shards.size());
    for (const auto& m : shards) {
      shared.push_back(std::make_shared<const weight_update_manifest>(m));
    }
  } catch (const std::exception& e) {  // out of memory: refused before anything was imported
    rollout_report report;
    for (const auto& m : shards) report.shard_ids.push_back(m.update_id);
    if (!shards.empty()) {
      const auto& first = *std::min_element(
          shards.begin(), shards.end(),
          [](const auto& a, const auto& b) { return a.source_rank < b.source_rank; });
      report.id = first.update_id;
      report.weight_version = first.weight_version;
    }
    report.failure =
        make_error(errc::install_failed, std::string("install failed: ") + e.what() + " (" +
                                             update_context(report.id, consumer_.rank()) + ")");
    return report;
  }
  return update_weights(std::span<const manifest_ptr>(shared));
}

rollout_report rollout_executor::update_weights(std::span<const manifest_ptr> shards) {
  std::lock_guard lock(mutex_);
  rollout_report report;
  const bool whole = std::all_of(shards.begin(), shards.end(), [](const auto& m) { return !!m; });
  for (const auto& m : shards) report.shard_ids.push_back(m ? m->update_id : update_id());
  if (!shards.empty() && whole) {
    // The update is known by its lowest source rank's shard, the one the adapter stages first.
    const auto& first = **std::min_element(
        shards.begin(), shards.end(),
        [](const auto& a, const auto& b) { return a->source_rank < b->source_rank; });
    report.id = first.update_id;
    report.weight_version = first.weight_version;
  }
  auto start = clock_type::now();
  auto t = start;
  std::vector<update_id> imported_ids;

  // Any failure: reject with the reason, give the new shards back, keep the previous version.
  auto fail = [&](wsync::error err) {
    log_warn("rejecting update: " + err.message);
    for (const auto& id : imported_ids) {
      (void)consumer_.reject(id, err.message);
      (void)consumer_.release(id);
    }
    report.released_self = !imported_ids.empty();
    report.failure = std::move(err);
    report.timings.total = std::chrono::duration<double>(clock_type::now() - start).count();
    return report;
  };

  // Nothing below may leave by an exception (an adapter out of memory, say) with the shards
  // still imported: it becomes a rejection like any other failure.
  // From the switch on nothing may throw: readers see the new weights, and the bookkeeping of
  // what is held must follow them whole. What it needs is allocated here, in the try.
  std::optional<update_id> next_id;
  std::vector<update_id> next_held;
  try {
    if (auto ok = shards_check(shards, consumer_.rank()); !ok) return fail(ok.error());
    if (auto ok = import_and_stage(shards, report, imported_ids, t); !ok) return fail(ok.error());
    next_id = report.id;
    next_held = imported_ids;
  } catch (const std::exception& e) {
    adapter_.discard(report.id);
    return fail(make_error(errc::install_failed, std::string("install failed: ") + e.what() + " (" +
                                                     update_context(report.id, consumer_.rank()) +
                                                     ")"));
  }

  {
    // The version switches with the weights: a reader inside the gate sees both or neither.
    std::unique_lock exclusive(gate_);
    adapter_.activate(report.id);
    std::lock_guard active(active_mutex_);
    active_version_ = report.weight_version;
    active_id_.swap(next_id);
  }
  report.timings.install = seconds_since(t);
  report.acknowledged = true;
  // The previous imports are no longer read by anyone: the gate was held exclusively above.
  report.released.swap(held_);
  const bool keeps = adapter_.references_import();
  if (keeps) held_.swap(next_held);
  // Acknowledging and releasing are reports to the transport: one that throws (out of memory
  // for its error text) is logged, and the rank's state above stands.
  auto noexcept_log = [](const char* what, auto&& step) noexcept {
    try {
      step();
    } catch (const std::exception& e) {
      try {
        log_error(std::string(what) + " raised: " + e.what());
      } catch (...) {
      }
    }
  };
  noexcept_log("acknowledge after install", [&] {
    for (const auto& id : imported_ids) {
      if (auto acked = consumer_.acknowledge(id); !acked) {
        // Only a concurrent caller touching this update can cause this. Readers already see
        // it, so the report still says acknowledged: a rejection would let the publisher reuse
        // memory this rank serves.
        log_error("acknowledge after install failed: " + acked.error().message);
      }
    }
  });
  report.timings.ack = seconds_since(t);
  noexcept_log("release of the previous update", [&] {
    for (const auto& id : report.released) {
      if (auto released = consumer_.release(id); !released) {
        log_error("release of the previous update failed: " + released.error().message);
      }
    }
  });
  if (!keeps) {
    noexcept_log("release after a copying install", [&] {
      for (const auto& id : imported_ids) (void)consumer_.release(id);
    });
    report.released_self = true;
  }
  report.timings.release = seconds_since(t);
  report.timings.total = std::chrono::duration<double>(clock_type::now() - start).count();
  return report;
}

std::optional<std::uint64_t> rollout_executor::active_weight_version() const {
  std::lock_guard lock(active_mutex_);
  return active_version_;
}

std::optional<update_id> rollout_executor::active_update() const {
  std::lock_guard lock(active_mutex_);
  return active_id_;
}

std::vector<update_id> rollout_executor::release_active() {
  std::lock_guard lock(mutex_);
  // Generations in flight may read the held imports (views of them are the active weights):
  // they finish first, as they do before an install switches.
  std::unique_lock exclusive(gate_);
  // Readers after this one must find no weights, not views of memory given back.
  if (!held_.empty() && adapter_.references_import() && adapter_.deactivate()) {
    std::lock_guard active(active_mutex_);
    active_version_.reset();
    active_id_.reset();
  }
  for (const auto& id : held_) (void)consumer_.release(id);
  return std::exchange(held_, {});
}

}  // namespace wsync
