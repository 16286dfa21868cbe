// The ucx transport and its registry entry. The rest lives beside it, in wsync::ucx_detail:
//   ucx_common.*  settings, UCX status -> error, the check macro, hex
//   handle.*      the handle (JSON) and its relay / stripe rewrites
//   slot_pool.*   pre-faulted memory registered once
//   node.hpp      one UCX worker with its progress thread; node.cpp, node_serve.cpp, node_pull.cpp
//   halves.hpp    the publisher (publisher.cpp) and consumer (consumer.cpp) halves
#include "ucx/ucx.hpp"

#include <memory>
#include <string>
#include <vector>

#include "ucx/halves.hpp"
#include "ucx/handle.hpp"
#include "ucx/node.hpp"
#include "ucx/ucx_common.hpp"

namespace wsync {
namespace ucx_detail {
namespace {

// --- the transport and its registry entry -----------------------------------------------------

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
