#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "src/parallel.hpp"
#include "src/process.hpp"
#include "ucx/halves.hpp"
#include "ucx/handle.hpp"
#include "wsync/manifest/checksum.hpp"

namespace wsync::ucx_detail {

ucx_publisher::ucx_publisher(std::unique_ptr<node> n)
    : node_(std::move(n)),
      self_{::getpid(), detail::process_start_time(::getpid()), detail::pid_namespace(),
            detail::boot_id()} {}

result<std::vector<std::span<std::byte>>> ucx_publisher::acquire(
    const update_id& id, std::span<const std::uint64_t> sizes, std::chrono::milliseconds wait) {
  {
    std::lock_guard lock(mutex_);
    if (updates_.count(id)) {
      return make_error(errc::invalid_argument,
                        "ucx: update_id " + id + " acquired twice (field update_id)");
    }
  }
  std::uint64_t need = 0;
  auto offsets = page_offsets(sizes, &need);
  auto s = node_->pool().acquire(id, need, wait);
  if (!s) return s.error();
  std::vector<std::span<std::byte>> spans;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    spans.emplace_back((*s)->base + offsets[i], sizes[i]);
  }
  std::lock_guard lock(mutex_);
  updates_[id] = {*s, std::move(offsets), {sizes.begin(), sizes.end()}};
  return spans;
}

result<std::string> ucx_publisher::expose(const update_id& id) {
  std::unique_lock lock(mutex_);
  auto it = updates_.find(id);
  if (it == updates_.end()) {
    return make_error(errc::unknown_update,
                      "unknown update_id: " + id + " was not acquired from ucx");
  }
  auto u = it->second;
  lock.unlock();
  // Chunk checksums let a relay verify each chunk before it forwards it, long before the
  // whole update has arrived and its tensor checksums can be checked.
  handle h;
  h.address = node_->address();
  h.chunk = node_->settings().chunk_bytes;
  h.rkey = u.s->rkey;
  h.publisher = self_;
  // A second pass over every byte (the tensor checksums were taken during the copy): on the
  // cores there are, up to 8, a chunk at a time. One thread took about half of a publish.
  std::vector<std::pair<std::size_t, std::uint64_t>> chunks;  // (segment, offset)
  for (std::size_t i = 0; i < u.nbytes.size(); ++i) {
    h.checksums.emplace_back((u.nbytes[i] + h.chunk - 1) / h.chunk);
    h.bases.push_back(reinterpret_cast<std::uintptr_t>(u.s->base + u.offsets[i]));
    for (std::uint64_t off = 0; off < u.nbytes[i]; off += h.chunk) chunks.emplace_back(i, off);
  }
  std::atomic<std::size_t> next{0};
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
  parallel::run(std::min<std::size_t>(threads, chunks.size()), [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < chunks.size();) {
      const auto [i, off] = chunks[k];
      h.checksums[i][off / h.chunk] =
          checksum_compute(u.s->base + u.offsets[i] + off, std::min(h.chunk, u.nbytes[i] - off));
    }
  });
  node_->call([&] {
    node_->serve_add(id, served_from(u.s, u.offsets, u.nbytes, h.chunk, h.checksums, true));
  });
  return handle_dump(h);
}

void ucx_publisher::release(const update_id& id) {
  {
    std::lock_guard lock(mutex_);
    if (!updates_.erase(id)) return;
  }
  node_->call([&] { node_->serve_remove(id); });
  node_->pool().release(id);  // the slot is reused once the sends reading it are done
}

}  // namespace wsync::ucx_detail
