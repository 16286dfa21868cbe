#include "ucx/ucx.hpp"

#include <sys/mman.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <unordered_map>

#include "ucx/handle.hpp"
#include "ucx/node.hpp"
#include "ucx/slot_pool.hpp"
#include "ucx/ucx_common.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {
namespace ucx_detail {

// --- publisher half -----------------------------------------------------------------------------

class ucx_publisher final : public publisher_transport {
 public:
  explicit ucx_publisher(std::unique_ptr<node> n) : node_(std::move(n)) {}

  result<std::vector<std::span<std::byte>>> acquire(const update_id& id,
                                                    std::span<const std::uint64_t> sizes,
                                                    std::chrono::milliseconds wait) override {
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

  result<std::string> expose(const update_id& id) override {
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
    for (std::size_t i = 0; i < u.nbytes.size(); ++i) {
      std::vector<std::uint64_t> sums;
      for (std::uint64_t off = 0; off < u.nbytes[i]; off += h.chunk) {
        sums.push_back(
            checksum_compute(u.s->base + u.offsets[i] + off, std::min(h.chunk, u.nbytes[i] - off)));
      }
      h.checksums.push_back(std::move(sums));
      h.bases.push_back(reinterpret_cast<std::uintptr_t>(u.s->base + u.offsets[i]));
    }
    node_->call([&] {
      node_->serve_add(id, served_from(u.s, u.offsets, u.nbytes, h.chunk, h.checksums, true));
    });
    return handle_dump(h);
  }

  void release(const update_id& id) override {
    {
      std::lock_guard lock(mutex_);
      if (!updates_.erase(id)) return;
    }
    node_->call([&] { node_->serve_remove(id); });
    node_->pool().release(id);  // the slot is reused once the sends reading it are done
  }

 private:
  struct held {
    slot* s;
    std::vector<std::uint64_t> offsets, nbytes;
  };
  std::unique_ptr<node> node_;
  std::mutex mutex_;
  std::map<update_id, held> updates_;
};

// --- consumer half ------------------------------------------------------------------------------

class ucx_consumer final : public consumer_transport {
 public:
  explicit ucx_consumer(std::unique_ptr<node> n) : node_(std::move(n)) {}

  result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& m) override {
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
            job,
            make_error(errc::timeout, "ucx: import of update_id " + m.update_id + " took over " +
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

  void release(const update_id& id) override { drop(id); }

  std::string relay_address() const override { return node_->address(); }

 private:
  void drop(const update_id& id) {
    node_->call([&] { node_->serve_remove(id); });
    node_->pool().release(id);
  }

  std::unique_ptr<node> node_;
};

// --- the transport and its registry entry -----------------------------------------------------

namespace {

constexpr transport_caps ucx_caps{.cpu_memory = true,
                                  .gpu_memory = false,  // Debian's UCX has no CUDA transports
                                  .cross_process = true,
                                  .cross_node = true,
                                  .zero_copy_import = false};

class ucx_transport final : public transport {
 public:
  explicit ucx_transport(ucx_settings cfg) : cfg_(std::move(cfg)) {}
  std::string_view name() const override { return "ucx"; }
  transport_caps caps() const override { return ucx_caps; }

  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    auto n = node::create(cfg_, "publisher", false);
    if (!n) return n.error();
    return std::unique_ptr<publisher_transport>(std::make_unique<ucx_publisher>(std::move(*n)));
  }

  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    auto n = node::create(cfg_, "consumer", true);
    if (!n) return n.error();
    return std::unique_ptr<consumer_transport>(std::make_unique<ucx_consumer>(std::move(*n)));
  }

  result<std::string> handle_via_relay(const std::string& text,
                                       const std::string& relay_address) const override {
    return ucx_detail::handle_via_relay(text, relay_address);
  }

  result<std::string> handle_striped(const std::vector<std::string>& texts) const override {
    return ucx_detail::handle_striped(texts);
  }

 private:
  ucx_settings cfg_;
};

}  // namespace
}  // namespace ucx_detail

transport_entry ucx_entry() {
  using ucx_detail::page;
  using ucx_detail::ucx_caps;
  using ucx_detail::ucx_settings;
  using ucx_detail::ucx_transport;
  return {"ucx", "cluster; pooled slots registered once, chunked pulls, relays between consumers",
          ucx_caps, [](const transport_options& options) -> result<std::unique_ptr<transport>> {
            options_reader reader("ucx", options);
            ucx_settings cfg;
            cfg.tls = reader.get_string("tls", "");
            cfg.devices = reader.get_string("devices", "");
            cfg.rndv_thresh = reader.get_string("rndv_thresh", "");
            cfg.op = reader.get_string("op", "auto");
            if (cfg.op != "auto" && cfg.op != "tag" && cfg.op != "get") {
              return make_error(errc::invalid_argument,
                                "ucx option op: expected auto, tag or get, got \"" + cfg.op + "\"");
            }
            auto chunk =
                reader.get_uint("chunk_bytes", cfg.chunk_bytes, page, std::uint64_t{1} << 30);
            if (!chunk) return chunk.error();
            auto window = reader.get_uint("window", cfg.window, 1, 256);
            if (!window) return window.error();
            auto slots = reader.get_uint("slots", cfg.slots, 1, 64);
            if (!slots) return slots.error();
            auto timeout = reader.get_uint("timeout_ms", cfg.timeout_ms, 1, 3600000);
            if (!timeout) return timeout.error();
            cfg.chunk_bytes = *chunk;
            cfg.window = *window;
            cfg.slots = *slots;
            cfg.timeout_ms = *timeout;
            if (auto ok = reader.finish(); !ok) return ok.error();
            return std::unique_ptr<transport>(std::make_unique<ucx_transport>(cfg));
          }};
}

}  // namespace wsync
