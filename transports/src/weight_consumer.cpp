#include "wsync/transports/weight_consumer.hpp"

#include <atomic>

#include "src/parallel.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/validate.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

// Terminal states remembered after release, so a late call gets "after release", not "unknown".
constexpr std::size_t finished_history = 256;
constexpr std::uint64_t parallel_verify_min_bytes = std::uint64_t{16} << 20;

}  // namespace

weight_consumer::weight_consumer(std::unique_ptr<consumer_transport> transport,
                                 consumer_config config)
    : transport_(std::move(transport)), config_(config) {
  if (config_.verify_threads == 0) config_.verify_threads = 1;
  transport_->rank_set(config_.rank);
}

weight_consumer::~weight_consumer() {
  std::lock_guard lock(mutex_);
  for (auto& [id, e] : updates_) {
    if (e.update) transport_->release(id);
  }
}

std::string weight_consumer::context(const update_id& id) const {
  return update_context(id, config_.rank);
}

result<const imported_update*> weight_consumer::import_update(
    const weight_update_manifest& manifest) {
  return import_update(std::make_shared<const weight_update_manifest>(manifest));
}

result<const imported_update*> weight_consumer::import_update(manifest_ptr shared) {
  if (!shared) {
    return make_error(errc::invalid_argument, "cannot import update: no manifest (rank=" +
                                                  std::to_string(config_.rank) + ")");
  }
  const weight_update_manifest& manifest = *shared;
  const auto& id = manifest.update_id;
  if (auto ok = manifest_validate(manifest, transport_known); !ok) {
    // The validator names the publisher's rank; say which consumer refused it too.
    return make_error(ok.error().code,
                      ok.error().message + " at consumer rank " + std::to_string(config_.rank));
  }
  {
    std::lock_guard lock(mutex_);
    if (updates_.count(id)) {
      return make_error(errc::illegal_transition,
                        "cannot import update: update_id already imported (" + context(id) + ")");
    }
    auto& mv = versions_[manifest.model_id];
    const std::uint64_t v = manifest.weight_version;
    auto refuse = [&](const std::string& why) {
      return make_error(errc::version_not_monotonic,
                        "weight_version must increase monotonically: weight_version " +
                            std::to_string(v) + " from source_rank " +
                            std::to_string(manifest.source_rank) + " " + why +
                            " for model_id=" + manifest.model_id + " (" + context(id) + ")");
    };
    if (mv.active && v <= *mv.active) {
      return refuse("is not above the active " + std::to_string(*mv.active));
    }
    if (!mv.held.empty() && mv.held.rbegin()->first > v) {
      return refuse("is below " + std::to_string(mv.held.rbegin()->first) +
                    ", which is being imported");
    }
    if (auto h = mv.held.find(v); h != mv.held.end() && h->second.count(manifest.source_rank)) {
      return refuse("is already imported and still held");
    }
    // Held from here on, while the lock is let go for the import: a second import of this
    // version and shard (a retry racing the original) is refused, not accepted twice.
    mv.held[v].insert(manifest.source_rank);
  }
  // Until the update is booked, any way out gives the hold back (and the segments, once
  // imported): an exception too (out of memory), or the version could never come again.
  struct undo {
    weight_consumer& self;
    const weight_update_manifest& manifest;
    bool imported = false, booked = false;
    ~undo() {
      if (booked) return;
      if (imported) self.transport_->release(manifest.update_id);
      std::lock_guard lock(self.mutex_);
      self.unhold_locked(manifest);
    }
  } pending{*this, manifest};
  auto segments = transport_->import_segments(manifest);
  if (!segments) {
    return make_error(segments.error().code, segments.error().message + " at consumer rank " +
                                                 std::to_string(config_.rank));
  }
  pending.imported = true;

  auto update = std::make_unique<imported_update>(shared);  // `shared` keeps `manifest` for undo
  update->memory = transport_->memory();
  update->segments = std::move(*segments);
  update->tensors.reserve(manifest.tensors.size());
  for (const auto& t : update->manifest.tensors) {
    update->tensors.push_back({&t, update->segments[t.segment].data() + t.offset});
  }
  std::lock_guard lock(mutex_);
  auto& e = updates_[id];
  e.state = update_state::imported;
  e.update = std::move(update);
  pending.booked = true;
  return e.update.get();
}

void weight_consumer::unhold_locked(const weight_update_manifest& m) {
  auto& held = versions_[m.model_id].held;
  if (auto h = held.find(m.weight_version); h != held.end()) {
    if (auto r = h->second.find(m.source_rank); r != h->second.end()) h->second.erase(r);
    if (h->second.empty()) held.erase(h);
  }
}

void weight_consumer::version_done_locked(const imported_update& u, bool acknowledged) {
  unhold_locked(u.manifest);
  auto& mv = versions_[u.manifest.model_id];
  const std::uint64_t v = u.manifest.weight_version;
  if (acknowledged && (!mv.active || v > *mv.active)) mv.active = v;
}

result<std::vector<std::uint64_t>> weight_consumer::checksums_of(const imported_update& u) const {
  const std::size_t tensors = u.tensors.size();
  if (!u.memory.host()) {
    // On the update's device, whichever this thread had current (an HTTP pool thread, say),
    // and that one current again afterwards.
    gpu::device_kept kept;
    if (auto was = gpu::set_device(u.memory.cuda_device); !was) return was.error();
    std::vector<gpu::device_range> ranges(tensors);
    for (std::size_t i = 0; i < tensors; ++i) {
      ranges[i] = {u.tensors[i].data, u.tensors[i].descriptor->nbytes};
    }
    return gpu::checksums(ranges, u.manifest.checksum_method);
  }
  // Pieces: whole tensors, or every chunk of every tensor (xxh3-64-chunked, so that one large
  // tensor spreads over the threads too). Workers take pieces in turn.
  std::vector<std::uint64_t> sizes(tensors);
  for (std::size_t i = 0; i < tensors; ++i) sizes[i] = u.tensors[i].descriptor->nbytes;
  const checksum_pieces pieces(sizes, u.manifest.checksum_method);
  std::vector<std::uint64_t> digests(pieces.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < digests.size();) {
      const auto p = pieces.at(k);
      digests[k] = checksum_compute(u.tensors[p.tensor].data + p.offset, p.nbytes);
    }
  };
  // Small updates hash faster than a thread starts.
  unsigned threads =
      u.manifest.total_bytes < parallel_verify_min_bytes ? 1 : config_.verify_threads;
  parallel::run(threads, work);
  std::vector<std::uint64_t> out(tensors);
  for (std::size_t i = 0; i < tensors; ++i) out[i] = pieces.fold(i, digests.data());
  return out;
}

result<void> weight_consumer::intact(const update_id& id) const {
  if (auto ok = transport_->intact(id); !ok) {
    return make_error(ok.error().code,
                      ok.error().message + " at consumer rank " + std::to_string(config_.rank));
  }
  return {};
}

result<void> weight_consumer::verify(const update_id& id) {
  const imported_update* u = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = updates_.find(id);
    if (it != updates_.end()) u = it->second.update.get();
  }
  if (u == nullptr) return step(id, update_event::verify_ok);  // gives the right refusal
  auto sums = checksums_of(*u);
  if (!sums) {
    return make_error(sums.error().code,
                      "cannot verify: " + sums.error().message + " (" + context(id) + ")");
  }
  const std::size_t tensors = u->tensors.size();
  const std::vector<std::uint64_t>& got = *sums;
  // The first mismatch (lowest index) is reported.
  std::size_t bad = tensors;
  for (std::size_t i = tensors; i-- > 0;) {
    if (got[i] != u->tensors[i].descriptor->checksum) bad = i;
  }
  if (std::size_t i = bad; i < tensors) {
    {
      std::lock_guard lock(mutex_);
      if (auto it = updates_.find(id); it != updates_.end()) it->second.verify_failed = true;
    }
    const auto& d = *u->tensors[i].descriptor;
    return make_error(errc::checksum_mismatch,
                      "tensor checksum mismatch: tensors[" + std::to_string(i) + "] \"" + d.name +
                          "\" checksum expected " + checksum_hex(d.checksum) + " got " +
                          checksum_hex(got[i]) + " (" + context(id) + ")");
  }
  return step(id, update_event::verify_ok);
}

result<void> weight_consumer::step(const update_id& id, update_event event) {
  std::lock_guard lock(mutex_);
  auto it = updates_.find(id);
  update_state from = update_state::announced;
  if (it != updates_.end()) {
    from = it->second.state;
    if (it->second.verify_failed &&
        (event == update_event::install_ok || event == update_event::acknowledge)) {
      return make_error(errc::illegal_transition,
                        "cannot " + std::string(update_event_name(event)) +
                            " update after tensor checksum mismatch (" + context(id) + ")");
    }
  } else {
    bool known = false;
    for (const auto& [fid, state] : finished_) {
      if (fid == id) from = state, known = true;
    }
    // Never seen: the lifecycle refuses everything but release and reject from "announced";
    // an unknown id cannot be released or rejected either.
    if (!known && (event == update_event::release || event == update_event::reject)) {
      return make_error(errc::unknown_update,
                        "unknown update_id: " + id + " (" + context(id) + ")");
    }
  }
  auto to = update_transition(from, event, context(id));
  if (!to) return to.error();
  if (it == updates_.end()) return {};  // a legal move on a forgotten update changes nothing
  // The version rule counts an update as held until it is acknowledged (then its version is the
  // active one), rejected or released (then the version may come again).
  const bool was_held = from != update_state::acknowledged && from != update_state::rejected;
  const bool now_held = *to != update_state::acknowledged && *to != update_state::rejected &&
                        *to != update_state::released;
  if (was_held && !now_held && it->second.update) {
    version_done_locked(*it->second.update, *to == update_state::acknowledged);
  }
  it->second.state = *to;
  if (*to == update_state::released) {
    if (it->second.update) transport_->release(id);
    finished_.emplace_back(id, update_state::released);
    if (finished_.size() > finished_history) finished_.pop_front();
    updates_.erase(it);
  }
  return {};
}

result<void> weight_consumer::mark_installed(const update_id& id) {
  return step(id, update_event::install_ok);
}

result<void> weight_consumer::acknowledge(const update_id& id) {
  return step(id, update_event::acknowledge);
}

result<void> weight_consumer::reject(const update_id& id, std::string reason) {
  auto ok = step(id, update_event::reject);
  if (ok) {
    std::lock_guard lock(mutex_);
    if (auto it = updates_.find(id); it != updates_.end()) it->second.reason = std::move(reason);
  }
  return ok;
}

result<void> weight_consumer::release(const update_id& id) {
  return step(id, update_event::release);
}

result<update_state> weight_consumer::state(const update_id& id) const {
  std::lock_guard lock(mutex_);
  if (auto it = updates_.find(id); it != updates_.end()) return it->second.state;
  for (const auto& [fid, s] : finished_) {
    if (fid == id) return s;
  }
  return make_error(errc::unknown_update, "unknown update_id: " + id + " (" + context(id) + ")");
}

}  // namespace wsync
