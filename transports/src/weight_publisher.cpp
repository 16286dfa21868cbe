#include "wsync/transports/weight_publisher.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "src/parallel.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/validate.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {
namespace {

constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) {
  return (v + a - 1) / a * a;
}

// Below this, a second copy thread costs more to start than it saves.
constexpr std::uint64_t parallel_copy_min_bytes = std::uint64_t{16} << 20;
// Finished updates kept for status() after their memory was released.
constexpr std::size_t finished_history = 64;

std::string default_worker_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return std::string(host[0] ? host : "localhost") + ":" + std::to_string(::getpid());
}

}  // namespace

std::string_view consumer_outcome_name(consumer_outcome o) {
  switch (o) {
    case consumer_outcome::pending:
      return "pending";
    case consumer_outcome::acknowledged:
      return "acknowledged";
    case consumer_outcome::rejected:
      return "rejected";
    case consumer_outcome::failed:
      return "failed";
    case consumer_outcome::released:
      return "released";
  }
  return "invalid";
}

result<void> pack_tensors(std::span<const tensor_source> tensors, std::uint64_t max_segment_bytes,
                          std::vector<tensor_descriptor>& descriptors,
                          std::vector<segment_descriptor>& segments) {
  descriptors.clear();
  descriptors.reserve(tensors.size());
  segments.clear();
  // A segment ends at its last tensor rounded up to the alignment, but never past the limit
  // (unless a single tensor is larger than the limit on its own).
  auto seal = [&](std::uint64_t cursor) {
    std::uint64_t end = std::max<std::uint64_t>(cursor, 1);
    segments.back().nbytes =
        std::min(align_up(end, tensor_alignment), std::max(end, max_segment_bytes));
  };
  std::uint64_t cursor = 0;
  for (const auto& t : tensors) {
    std::uint64_t start = align_up(cursor, tensor_alignment);
    // Open a new segment when this tensor (with its padding) would overflow a non-empty one.
    bool fits = align_up(start + t.nbytes, tensor_alignment) <= max_segment_bytes;
    if (segments.empty() || (cursor > 0 && !fits)) {
      if (!segments.empty()) seal(cursor);
      segments.push_back({});
      start = 0;
    }
    tensor_descriptor d;
    d.name = t.name;
    d.dtype = t.dtype;
    d.shape = t.shape;
    d.strides = t.strides;
    d.nbytes = t.nbytes;
    d.segment = static_cast<std::uint32_t>(segments.size() - 1);
    d.offset = start;
    descriptors.push_back(std::move(d));
    cursor = start + t.nbytes;
  }
  if (!segments.empty()) seal(cursor);
  return {};
}

weight_publisher::weight_publisher(std::unique_ptr<publisher_transport> transport,
                                   std::string transport_name, publisher_config config)
    : transport_(std::move(transport)),
      transport_name_(std::move(transport_name)),
      config_(std::move(config)) {
  if (config_.source_worker.empty()) config_.source_worker = default_worker_name();
  if (config_.copy_threads == 0) config_.copy_threads = 1;
}

weight_publisher::~weight_publisher() {
  transport_->closing();  // a transfer in flight ends now: the releases below need not wait
  std::lock_guard lock(mutex_);
  for (auto& [id, p] : updates_) {
    if (!p.memory_released) transport_->release(id);
  }
}

result<gpu::stream*> weight_publisher::stream_on(int device) {
  std::lock_guard lock(stream_mutex_);
  auto& s = streams_[device];
  if (!s) {
    auto made = gpu::stream::make(device);
    if (!made) return made.error();
    s = std::make_unique<gpu::stream>(std::move(*made));
  }
  return s.get();
}

result<void> weight_publisher::copy_to_device(std::span<const tensor_source> tensors,
                                              std::vector<tensor_descriptor>& descs,
                                              const std::vector<std::span<std::byte>>& dest,
                                              const checksum_method& method) {
  auto s = stream_on(transport_->memory().cuda_device);
  if (!s) return s.error();
  // A failure once copies are queued waits for them: the caller then reuses the slot and may
  // free the sources.
  auto fail = [&](error e) -> error {
    (void)(*s)->synchronize();
    return e;
  };
  // The copies wait for the work queued on each producing stream; the host does not.
  std::set<std::pair<int, void*>> waited;
  for (const auto& t : tensors) {
    if (t.cuda_device >= 0 && waited.emplace(t.cuda_device, t.stream).second) {
      if (auto ok = (*s)->wait_for(t.stream, t.cuda_device); !ok) return ok.error();
    }
  }
  // Tensors on the slot's device, chunked method: one kernel pass copies and hashes every byte.
  // Not for tensors on another device: the kernel would read them without peer access (an
  // illegal address that ruins the context); cudaMemcpyAsync below moves them between devices.
  const int device = transport_->memory().cuda_device;
  const bool all_on_device =
      std::all_of(tensors.begin(), tensors.end(),
                  [&](const tensor_source& t) { return t.cuda_device == device; });
  if (all_on_device && method.algorithm == checksum_algorithm::xxh3_64_chunked) {
    std::vector<gpu::device_copy> copies(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      copies[i] = {dest[descs[i].segment].data() + descs[i].offset, tensors[i].data,
                   tensors[i].nbytes};
    }
    auto sums = gpu::copy_with_checksums(copies, method.chunk_bytes, (*s)->handle());
    if (!sums) return fail(sums.error());
    for (std::size_t i = 0; i < tensors.size(); ++i) descs[i].checksum = (*sums)[i];
    return {};
  }
  // Host tensors (or the whole-tensor method): copies, then the checksum kernel.
  std::vector<gpu::device_range> ranges(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    auto* to = dest[descs[i].segment].data() + descs[i].offset;
    if (auto ok = (*s)->copy(to, tensors[i].data, tensors[i].nbytes); !ok) {
      return fail({ok.error().code, ok.error().message + " for tensors[" + std::to_string(i) +
                                        "] \"" + tensors[i].name + "\""});
    }
    ranges[i] = {to, tensors[i].nbytes};
  }
  // On the same stream, after the copies; waits for the digests.
  auto sums = gpu::checksums(ranges, method, (*s)->handle());
  if (!sums) return fail(sums.error());
  for (std::size_t i = 0; i < tensors.size(); ++i) descs[i].checksum = (*sums)[i];
  return {};
}

result<void> weight_publisher::copy_all(std::span<const tensor_source> tensors,
                                        std::vector<tensor_descriptor>& descs,
                                        const std::vector<std::span<std::byte>>& dest,
                                        const checksum_method& method) {
  if (!transport_->memory().host()) return copy_to_device(tensors, descs, dest, method);
  // Device tensors into host segments: the GPU copies them first (each device on its stream,
  // after the work queued on each producing stream), the threads below hash them.
  std::set<gpu::stream*> used;
  std::set<std::pair<int, void*>> waited;
  // Waits for every stream used, keeping the first failure.
  auto sync_used = [&]() -> result<void> {
    result<void> synced;
    for (auto* s : used) {
      if (auto ok = s->synchronize(); !ok && synced) synced = ok.error();
    }
    return synced;
  };
  // A failure once copies are queued waits for them: the caller then reuses the segments and
  // may free the sources.
  auto fail = [&](error e) -> error {
    (void)sync_used();
    return e;
  };
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.cuda_device < 0) continue;
    auto s = stream_on(t.cuda_device);
    if (!s) return fail(s.error());
    used.insert(*s);
    if (waited.emplace(t.cuda_device, t.stream).second) {
      if (auto ok = (*s)->wait_for(t.stream, t.cuda_device); !ok) return fail(ok.error());
    }
    if (auto ok = (*s)->copy(dest[descs[i].segment].data() + descs[i].offset, t.data, t.nbytes);
        !ok) {
      return fail(ok.error());
    }
  }
  if (auto synced = sync_used(); !synced) return synced;
  hash_pieces(descs, method, [&](std::size_t tensor, std::uint64_t offset, std::uint64_t nbytes) {
    const auto& d = descs[tensor];
    auto* to = dest[d.segment].data() + d.offset + offset;
    return tensors[tensor].cuda_device >= 0  // already copied
               ? checksum_compute(to, nbytes)
               : checksum_copy(to, tensors[tensor].data + offset, nbytes);
  });
  return {};
}

result<void> weight_publisher::checksums_in_place(std::span<const tensor_source> tensors,
                                                  std::vector<tensor_descriptor>& descs,
                                                  const checksum_method& method) {
  // Host tensors on the threads (a device tensor's pieces hash to nothing there: its digest is
  // set below); device tensors on their device, on its stream, after the work queued on each
  // producing stream.
  std::map<int, std::vector<std::size_t>> on_device;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].cuda_device >= 0) on_device[tensors[i].cuda_device].push_back(i);
  }
  const bool any_host = std::any_of(tensors.begin(), tensors.end(),
                                    [](const tensor_source& t) { return t.cuda_device < 0; });
  if (any_host) {
    hash_pieces(descs, method, [&](std::size_t tensor, std::uint64_t offset, std::uint64_t nbytes) {
      const auto& t = tensors[tensor];
      return t.cuda_device >= 0 ? 0 : checksum_compute(t.data + offset, nbytes);
    });
  }
  for (const auto& [device, which] : on_device) {
    auto s = stream_on(device);
    if (!s) return s.error();
    std::set<void*> waited;
    std::vector<gpu::device_range> ranges;
    for (auto i : which) {
      if (waited.insert(tensors[i].stream).second) {
        if (auto ok = (*s)->wait_for(tensors[i].stream, device); !ok) return ok.error();
      }
      ranges.push_back({tensors[i].data, tensors[i].nbytes});
    }
    auto sums = gpu::checksums(ranges, method, (*s)->handle());
    if (!sums) return sums.error();
    for (std::size_t k = 0; k < which.size(); ++k) descs[which[k]].checksum = (*sums)[k];
  }
  return {};
}

template <class Digest>
void weight_publisher::hash_pieces(std::vector<tensor_descriptor>& descs,
                                   const checksum_method& method, Digest digest) {
  // Pieces: whole tensors, largest first, or every chunk of every tensor in order
  // (xxh3-64-chunked, so that one large tensor is hashed by all threads). Threads take the next
  // piece from a shared counter; digest(tensor, offset, nbytes) hashes one (and may copy it).
  std::vector<std::uint64_t> sizes(descs.size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < descs.size(); ++i) total += sizes[i] = descs[i].nbytes;
  const checksum_pieces pieces(sizes, method);
  std::vector<std::size_t> largest_first;  // whole tensors only; chunks go in order
  if (method.algorithm == checksum_algorithm::xxh3_64) {
    largest_first.resize(pieces.size());
    std::iota(largest_first.begin(), largest_first.end(), std::size_t{0});
    std::stable_sort(largest_first.begin(), largest_first.end(),
                     [&](std::size_t a, std::size_t b) { return sizes[a] > sizes[b]; });
  }
  std::vector<std::uint64_t> digests(pieces.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t n; (n = next.fetch_add(1)) < digests.size();) {
      const auto k = largest_first.empty() ? n : largest_first[n];
      const auto p = pieces.at(k);
      digests[k] = digest(p.tensor, p.offset, p.nbytes);
    }
  };
  unsigned threads = config_.copy_threads;
  if (threads <= 1 || total < parallel_copy_min_bytes || digests.size() < 2) threads = 1;
  parallel::run(threads, work);
  for (std::size_t i = 0; i < descs.size(); ++i) descs[i].checksum = pieces.fold(i, digests.data());
}

result<weight_update_manifest> weight_publisher::publish(
    std::span<const tensor_source> tensors, std::uint64_t weight_version,
    std::vector<std::int32_t> expected_consumers, std::map<std::string, std::string> metadata) {
  weight_update_manifest m;
  m.update_id = update_id_generate();
  m.model_id = config_.model_id;
  m.weight_version = weight_version;
  m.source_worker = config_.source_worker;
  m.source_rank = config_.source_rank;
  m.transport = transport_name_;
  m.metadata = std::move(metadata);
  m.checksum_method = config_.checksum;
  const memory_location memory = transport_->memory();
  if (!memory.host() && m.checksum_method.algorithm == checksum_algorithm::xxh3_64) {
    m.checksum_method = {checksum_algorithm::xxh3_64_chunked, std::uint64_t{1} << 20};
  }
  {
    std::lock_guard lock(mutex_);
    if (auto no = version_refusal_locked(weight_version, m)) return *no;
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].data == nullptr && tensors[i].nbytes > 0) {
      return make_error(errc::invalid_argument, "invalid tensor: tensors[" + std::to_string(i) +
                                                    "].data: null for \"" + tensors[i].name +
                                                    "\" (" + update_context(m) + ")");
    }
  }
  std::sort(expected_consumers.begin(), expected_consumers.end());
  if (std::adjacent_find(expected_consumers.begin(), expected_consumers.end()) !=
      expected_consumers.end()) {
    return make_error(errc::invalid_argument,
                      "expected_consumers: duplicate rank (" + update_context(m) + ")");
  }
  if (auto packed = pack_tensors(tensors, config_.max_segment_bytes, m.tensors, m.segments);
      !packed) {
    return packed.error();
  }
  m.total_bytes = 0;
  for (const auto& s : m.segments) m.total_bytes += s.nbytes;
  for (auto& t : m.tensors) t.device = memory.text();
  // Validate before touching memory: the manifest's rules are the input rules.
  if (auto ok = manifest_validate(m, transport_known); !ok) return ok.error();

  // The streams below make their devices current; the caller's is put back on every return.
  std::optional<gpu::device_kept> kept;
  if (!memory.host() || std::any_of(tensors.begin(), tensors.end(),
                                    [](const tensor_source& t) { return t.cuda_device >= 0; })) {
    kept.emplace();
  }
  std::vector<std::uint64_t> sizes;
  for (const auto& s : m.segments) sizes.push_back(s.nbytes);
  const bool lent = config_.lend_sources && transport_->can_lend();
  if (lent) {
    // The transport reads the tensors where they are: hash them there, then lend them.
    if (auto ok = checksums_in_place(tensors, m.tensors, m.checksum_method); !ok) {
      return make_error(ok.error().code,
                        "publish failed: " + ok.error().message + " (" + update_context(m) + ")");
    }
    std::vector<lent_range> ranges;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      ranges.push_back({m.tensors[i].segment, m.tensors[i].offset, tensors[i].data,
                        tensors[i].nbytes, tensors[i].cuda_device});
    }
    if (auto ok = transport_->lend(m.update_id, sizes, std::move(ranges)); !ok) {
      return make_error(ok.error().code,
                        ok.error().message + " (rank=" + std::to_string(m.source_rank) + ")");
    }
  } else {
    auto dest = transport_->acquire(m.update_id, sizes, config_.slot_wait);
    if (!dest) {  // the transport knows the update, not the rank: name both
      return make_error(dest.error().code,
                        dest.error().message + " (rank=" + std::to_string(m.source_rank) + ")");
    }
    if (auto copied = copy_all(tensors, m.tensors, *dest, m.checksum_method); !copied) {
      transport_->release(m.update_id);
      return make_error(copied.error().code, "publish failed: " + copied.error().message + " (" +
                                                 update_context(m) + ")");
    }
  }
  if (!expected_consumers.empty()) {
    if (auto ok = transport_->consumers_set(m.update_id, expected_consumers); !ok) {
      transport_->release(m.update_id);
      return make_error(ok.error().code, ok.error().message + " (" + update_context(m) + ")");
    }
  }
  auto handle = transport_->expose(m.update_id);
  if (!handle) {
    transport_->release(m.update_id);
    return make_error(handle.error().code,
                      "publish failed: " + handle.error().message + " (" + update_context(m) + ")");
  }
  m.transport_handle = std::move(*handle);
  // Consumers refuse a handle past the manifest limit, and relays (ucx) add their addresses to
  // it on the way: one that would not reach them fails here, where the trainer sees why, not
  // at every consumer after the publish said it went out.
  if (const auto room = manifest_limits{}.max_handle_bytes / 8 * 7;
      m.transport_handle.size() > room) {
    transport_->release(m.update_id);
    return make_error(
        errc::invalid_argument,
        "publish failed: transport_handle: " + std::to_string(m.transport_handle.size()) +
            " bytes, above the " + std::to_string(room) +
            " that leave relays room within what consumers accept (" +
            std::to_string(manifest_limits{}.max_handle_bytes) +
            "); over ucx, a larger chunk_bytes lists fewer chunk checksums (" + update_context(m) +
            ")");
  }

  std::lock_guard lock(mutex_);
  // A concurrent publish may have raced past the check above; the later one loses.
  if (auto no = version_refusal_locked(weight_version, m)) {
    transport_->release(m.update_id);
    return *no;
  }
  // Under the lock, so that announcements follow version order.
  if (auto ok = transport_->announce(m); !ok) {
    transport_->release(m.update_id);
    return make_error(ok.error().code,
                      ok.error().message + " (rank=" + std::to_string(m.source_rank) + ")");
  }
  published_any_ = true;
  last_version_ = weight_version;
  publication p;
  p.id = m.update_id;
  p.weight_version = weight_version;
  for (auto rank : expected_consumers) p.consumers[rank] = {};
  auto [it, inserted] = updates_.emplace(m.update_id, std::move(p));
  order_.push_back(m.update_id);
  // No expected consumer: nothing will ever hold it. Lent tensors are still being sent, and
  // releasing waits for that: the caller releases it (after lent_wait).
  if (!lent || !expected_consumers.empty()) maybe_release_locked(it->second);
  // Forget the oldest finished updates so bookkeeping stays bounded.
  while (order_.size() > finished_history) {
    auto old = updates_.find(order_.front());
    if (old != updates_.end() && !old->second.memory_released) break;
    if (old != updates_.end()) updates_.erase(old);
    order_.erase(order_.begin());
  }
  return m;
}

std::optional<error> weight_publisher::version_refusal_locked(
    std::uint64_t weight_version, const weight_update_manifest& m) const {
  if (!published_any_ || weight_version > last_version_) return std::nullopt;
  std::string why = "weight_version must increase monotonically: weight_version " +
                    std::to_string(weight_version) + " is not above " +
                    std::to_string(last_version_) + " for model_id=" + m.model_id;
  if (weight_version < last_version_) {
    return make_error(errc::version_not_monotonic, why + " (" + update_context(m) + ")");
  }
  // The same version again: a retry, once every publication of it was given back.
  if (config_.coordinator_orders_versions) return std::nullopt;
  for (const auto& [id, p] : updates_) {
    if (p.weight_version == weight_version && !p.memory_released) {
      return make_error(errc::version_not_monotonic,
                        why + ", and its publication update_id=" + id +
                            " is still held (release it to publish version " +
                            std::to_string(weight_version) + " again) (" + update_context(m) + ")");
    }
  }
  return std::nullopt;
}

void weight_publisher::maybe_release_locked(publication& p) {
  if (p.memory_released || !config_.release_when_answered) return;
  for (const auto& [rank, r] : p.consumers) {
    if (r.outcome != consumer_outcome::released && r.outcome != consumer_outcome::failed) return;
  }
  p.memory_released = true;
  transport_->release(p.id);
}

result<void> weight_publisher::report(const update_id& id, std::int32_t rank,
                                      consumer_outcome outcome, std::string reason) {
  std::lock_guard lock(mutex_);
  auto it = updates_.find(id);
  if (it == updates_.end()) {
    return make_error(errc::unknown_update,
                      "unknown update_id: " + id + " (" + update_context(id, rank) + ")");
  }
  auto& p = it->second;
  auto c = p.consumers.find(rank);
  if (c == p.consumers.end()) {
    return make_error(errc::invalid_argument, "consumer rank " + std::to_string(rank) +
                                                  " is not expected for this update (" +
                                                  update_context(id, rank) + ")");
  }
  auto& r = c->second;
  using o = consumer_outcome;
  bool ok = false;
  switch (outcome) {
    case o::acknowledged:
    case o::rejected:
      ok = r.outcome == o::pending;
      break;
    case o::released:
      ok = r.outcome != o::released && r.outcome != o::failed;
      break;
    case o::failed:
      ok = r.outcome != o::released && r.outcome != o::failed;
      break;
    case o::pending:
      ok = false;
      break;
  }
  if (!ok) {
    return make_error(errc::illegal_transition, "cannot record " +
                                                    std::string(consumer_outcome_name(outcome)) +
                                                    " for a consumer already " +
                                                    std::string(consumer_outcome_name(r.outcome)) +
                                                    " (" + update_context(id, rank) + ")");
  }
  if (outcome == o::acknowledged) r.acknowledged = true;
  if (!reason.empty()) r.reason = std::move(reason);
  r.outcome = outcome;
  maybe_release_locked(p);
  return {};
}

result<void> weight_publisher::on_acknowledged(const update_id& id, std::int32_t rank) {
  return report(id, rank, consumer_outcome::acknowledged, {});
}
result<void> weight_publisher::on_rejected(const update_id& id, std::int32_t rank,
                                           std::string reason) {
  return report(id, rank, consumer_outcome::rejected, std::move(reason));
}
result<void> weight_publisher::on_released(const update_id& id, std::int32_t rank) {
  return report(id, rank, consumer_outcome::released, {});
}
result<void> weight_publisher::on_failed(const update_id& id, std::int32_t rank,
                                         std::string reason) {
  return report(id, rank, consumer_outcome::failed, std::move(reason));
}

result<void> weight_publisher::lent_wait(const update_id& id, std::chrono::milliseconds wait) {
  if (auto ok = transport_->lent_wait(id, wait); !ok) {
    return make_error(ok.error().code,
                      ok.error().message + " (" + update_context(id, config_.source_rank) + ")");
  }
  return {};
}

result<void> weight_publisher::release(const update_id& id) {
  std::lock_guard lock(mutex_);
  auto it = updates_.find(id);
  if (it == updates_.end()) {
    return make_error(errc::unknown_update, "unknown update_id: " + id + " (" +
                                                update_context(id, config_.source_rank) + ")");
  }
  if (!it->second.memory_released) {
    it->second.memory_released = true;
    transport_->release(id);
  }
  return {};
}

result<publication> weight_publisher::status(const update_id& id) const {
  std::lock_guard lock(mutex_);
  auto it = updates_.find(id);
  if (it == updates_.end()) {
    return make_error(errc::unknown_update, "unknown update_id: " + id + " (" +
                                                update_context(id, config_.source_rank) + ")");
  }
  return it->second;
}

std::uint64_t weight_publisher::last_version() const {
  std::lock_guard lock(mutex_);
  return last_version_;
}

std::vector<update_id> weight_publisher::held_updates() const {
  std::lock_guard lock(mutex_);
  std::vector<update_id> out;
  for (const auto& [id, p] : updates_) {
    if (!p.memory_released) out.push_back(id);
  }
  return out;
}

}  // namespace wsync
