#include <chrono>
#include <future>

#include "ucx/halves.hpp"
#include "ucx/handle.hpp"
#include "wsync/transports/ucx.hpp"

namespace wsync::ucx_detail {

result<std::vector<std::span<const std::byte>>> ucx_consumer::import_segments(
    const weight_update_manifest& m) {
  auto h = handle_parse(m.transport_handle, &m);
  if (!h) return h.error();
  const auto& cfg = node_->settings();
  std::vector<std::uint64_t> sizes;
  for (const auto& s : m.segments) sizes.push_back(s.nbytes);
  std::uint64_t need = 0;
  auto offsets = page_offsets(sizes, &need);
  auto timeout = std::chrono::milliseconds(cfg.timeout_ms);
  auto landing = node_->pool().acquire(m.update_id, need, timeout);
  if (!landing) return landing.error();

  auto job = std::make_shared<pull_job>();
  job->id = m.update_id;
  job->context = update_context(m);
  if (h->stripes.empty()) {
    pull_lane lane;
    lane.sources = h->fallbacks;
    lane.sources.insert(lane.sources.begin(), h->address);
    std::string op = cfg.op == "auto" ? ucx_auto_op(cfg.tls) : cfg.op;
    lane.get = op == "get" && !h->rkey.empty();
    lane.bases = h->bases;
    lane.rkey_hex = h->rkey;
    lane.publisher = h->publisher;
    job->lanes.push_back(std::move(lane));
  }
  for (const auto& stripe : h->stripes) {
    pull_lane lane;
    lane.sources = stripe.fallbacks;
    lane.sources.insert(lane.sources.begin(), stripe.address);
    job->lanes.push_back(std::move(lane));
  }
  job->landing = *landing;
  job->offsets = offsets;
  job->nbytes = sizes;
  job->chunk = h->chunk;
  job->window = cfg.window;
  for (std::uint32_t i = 0; i < sizes.size(); ++i) {
    for (std::uint64_t off = 0; off < sizes[i]; off += h->chunk) {
      job->lanes[job->total++ % job->lanes.size()].order.emplace_back(i, off);
    }
  }
  auto finished = job->finished.get_future();
  node_->call([&] {
    // Serve the update to children from the first chunk on: the relay is pipelined.
    node_->serve_add(m.update_id,
                     served_from(*landing, offsets, sizes, h->chunk, h->checksums, false));
    node_->pull_start(job);
  });
  if (finished.wait_for(timeout) != std::future_status::ready) {
    node_->call([&] {
      node_->pull_abort(
          job, make_error(errc::timeout, "ucx: import of update_id " + m.update_id + " took over " +
                                             std::to_string(cfg.timeout_ms) +
                                             " ms (option timeout_ms; " + update_context(m) + ")"));
    });
  }
  auto pulled = finished.get();
  if (!pulled) {
    drop(m.update_id);
    return pulled.error();
  }
  std::vector<std::span<const std::byte>> spans;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    spans.emplace_back((*landing)->base + offsets[i], sizes[i]);
  }
  return spans;
}

void ucx_consumer::drop(const update_id& id) {
  node_->call([&] { node_->serve_remove(id); });
  node_->pool().release(id);
}

}  // namespace wsync::ucx_detail
