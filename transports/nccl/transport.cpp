// The nccl transport (wsync/transports/nccl_transport.hpp): its options, the slice loop both
// sides run, and the transport that makes the two sides (publisher.cpp, consumer.cpp). Pure C++
// over a group_fabric: CI runs all of it on the host fabric.

#include <charconv>
#include <set>

#include "nccl/handle.hpp"
#include "nccl/sides.hpp"

namespace wsync::nccl {

result<void> detail::broadcast_slices(group_member& member, const nccl_handle::handle& h,
                                      clock::time_point deadline, const slice_place& place) {
  const std::uint64_t total[] = {h.bytes};
  auto slices = nccl_plan::segment_slices(total, h.bucket_bytes, h.buckets);
  if (!slices) return slices.error();
  for (const auto& s : *slices) {
    auto at = place(s);
    if (!at) return at.error();
    if (auto r = member.broadcast(*at, s.nbytes, 0, deadline); !r) return r;
    if (s.stream + 1 == h.buckets) {
      if (auto r = member.wait(deadline); !r) return r;
    }
  }
  return member.wait(deadline);
}

namespace {

result<std::vector<std::int32_t>> ranks_parse(const std::string& text) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_argument, "nccl option consumers: \"" + text + "\": " + why);
  };
  std::vector<std::int32_t> out;
  std::set<std::int32_t> seen;
  std::size_t at = 0;
  while (at <= text.size()) {
    const auto comma = std::min(text.find(',', at), text.size());
    std::int32_t r = 0;
    const char* first = text.data() + at;
    const char* last = text.data() + comma;
    auto [end, ec] = std::from_chars(first, last, r);
    if (first == last || ec != std::errc{} || end != last || r < 0) {
      return bad("expected comma-separated consumer ranks (non-negative integers)");
    }
    if (!seen.insert(r).second) return bad("rank " + std::to_string(r) + " twice");
    out.push_back(r);
    at = comma + 1;
  }
  if (out.size() > nccl_handle::max_members) {
    return bad("more than " + std::to_string(nccl_handle::max_members) + " ranks");
  }
  return out;
}

transport_caps caps_for(const memory_location& where) {
  return {.cpu_memory = where.host(),
          .gpu_memory = !where.host(),
          .cross_process = true,
          .cross_node = true,
          .zero_copy_import = false,
          .collective = true};
}

class nccl_transport final : public transport {
 public:
  nccl_transport(transport_settings settings, std::shared_ptr<group_fabric> fabric)
      : settings_(std::move(settings)), fabric_(std::move(fabric)) {}
  std::string_view name() const override { return "nccl"; }
  transport_caps caps() const override { return caps_for(fabric_->memory()); }

  result<std::unique_ptr<publisher_transport>> make_publisher() override {
    auto group = random_hex(8);
    if (group.empty()) return make_error(errc::io_error, "nccl: the kernel gave no random bytes");
    auto header = fabric_->allocate(nccl_handle::header_bytes);
    if (!header) return header.error();
    return detail::make_publisher(settings_, fabric_, std::move(group), std::move(*header));
  }

  result<std::unique_ptr<consumer_transport>> make_consumer() override {
    return detail::make_consumer(settings_, fabric_);
  }

 private:
  const transport_settings settings_;
  const std::shared_ptr<group_fabric> fabric_;
};

}  // namespace

result<transport_settings> settings_read(const transport_options& options) {
  options_reader reader("nccl", options);
  transport_settings s;
  auto consumers = ranks_parse(reader.get_string("consumers", "0"));
  if (!consumers) return consumers.error();
  s.consumers = std::move(*consumers);
  auto device = reader.get_uint("device", 0, 0, 1023);
  if (!device) return device.error();
  auto slots = reader.get_uint("slots", 2, 1, 64);
  if (!slots) return slots.error();
  auto bucket_bytes = reader.get_uint("bucket_bytes", std::uint64_t{256} << 20,
                                      std::uint64_t{1} << 20, std::uint64_t{16} << 30);
  if (!bucket_bytes) return bucket_bytes.error();
  auto buckets = reader.get_uint("buckets", 2, 1, 16);
  if (!buckets) return buckets.error();
  auto timeout = reader.get_uint("timeout_ms", 60000, 1, 3600000);
  if (!timeout) return timeout.error();
  if (auto ok = reader.finish(); !ok) return ok.error();
  s.device = static_cast<int>(*device);
  s.slots = *slots;
  s.bucket_bytes = *bucket_bytes;
  s.buckets = static_cast<unsigned>(*buckets);
  s.timeout = std::chrono::milliseconds(*timeout);
  return s;
}

result<std::unique_ptr<transport>> make_transport(const transport_options& options,
                                                  const fabric_factory& make_fabric) {
  auto settings = settings_read(options);
  if (!settings) return settings.error();
  auto fabric = make_fabric(settings->device);
  if (!fabric) return fabric.error();
  return std::unique_ptr<transport>(
      std::make_unique<nccl_transport>(std::move(*settings), std::move(*fabric)));
}

}  // namespace wsync::nccl
