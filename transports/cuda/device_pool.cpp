#include "cuda/device_pool.hpp"

#include <nlohmann/json.hpp>

#include "src/json_read.hpp"
#include "src/slot_ring.hpp"
#include "wsync/manifest/json_bounded.hpp"

namespace wsync::device_pool {
namespace {

bool is_hex(const std::string& s, std::size_t digits) {
  if (s.size() != digits) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

std::string handle_encode(const handle& h) {
  nlohmann::json j = {{"pool", h.pool},
                      {"slot", h.slot},
                      {"id", h.id},
                      {"control", h.control},
                      {"generation", h.generation},
                      {"capacity", h.capacity},
                      {"pid", h.pid},
                      {"device", h.device},
                      {"event", h.event},
                      {"offsets", h.offsets}};
  if (!h.memory.empty()) j["memory"] = h.memory;
  if (!h.socket.empty()) j["socket"] = h.socket;
  return j.dump();
}

result<handle> handle_parse(const weight_update_manifest& m, sharing kind) {
  const char* name = kind == sharing::ipc ? "cuda-ipc" : "cuda-vmm";
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + why + " (" +
                                                  update_context(m) + ")");
  };
  auto j = json_parse_bounded(m.transport_handle);
  if (j.is_discarded() || !j.is_object()) return bad(std::string("not a ") + name + " handle");
  handle h;
  try {
    h.pool = j.at("pool").get<std::string>();
    h.slot = json_read::field<std::uint64_t>(j, "slot");
    h.id = j.at("id").get<std::string>();
    h.control = j.at("control").get<std::string>();
    h.generation = json_read::field<std::uint64_t>(j, "generation");
    h.capacity = json_read::field<std::uint64_t>(j, "capacity");
    h.pid = json_read::field<std::int32_t>(j, "pid");
    h.device = json_read::field<std::int32_t>(j, "device");
    h.event = j.at("event").get<std::string>();
    h.offsets = json_read::list<std::uint64_t>(j, "offsets");
    if (kind == sharing::ipc) h.memory = j.at("memory").get<std::string>();
    if (kind == sharing::vmm) h.socket = j.at("socket").get<std::string>();
  } catch (const std::exception& e) {
    return bad(std::string(name) + " handle field: " + e.what());
  }
  if (!is_hex(h.pool, 16)) return bad("pool is not 16 hex digits");
  if (!is_hex(h.id, 32)) return bad("id is not 32 hex digits");
  if (h.slot >= max_slots) return bad("slot " + std::to_string(h.slot) + " is not below 64");
  if (h.pid <= 0) return bad("pid " + std::to_string(h.pid) + " is not a process id");
  if (h.device < 0) return bad("device " + std::to_string(h.device) + " is negative");
  if (h.control.rfind("wsync-", 0) != 0 || h.control.find('/') != std::string::npos ||
      h.control.size() > 200) {
    return bad("control page \"" + h.control + "\" is not a wsync shared-memory name");
  }
  if (!is_hex(h.event, 128)) return bad("event is not a 64-byte handle in hex");
  if (kind == sharing::ipc && !is_hex(h.memory, 128)) {
    return bad("memory is not a 64-byte handle in hex");
  }
  if (kind == sharing::vmm && (h.socket.rfind("wsync-vmm-", 0) != 0 || h.socket.size() > 100)) {
    return bad("socket \"" + h.socket + "\" is not a wsync socket name");
  }
  if (auto why = slot_ring::segments_outside(h.offsets, h.capacity, m.segments); !why.empty()) {
    return bad(why);
  }
  return h;
}

}  // namespace wsync::device_pool
