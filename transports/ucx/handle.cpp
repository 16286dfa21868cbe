#include "ucx/handle.hpp"

#include <charconv>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "src/json_read.hpp"
#include "ucx/ucx_common.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/json_bounded.hpp"

namespace wsync::ucx_detail {

std::string handle_dump(const handle& h) {
  nlohmann::json sums = nlohmann::json::array();
  for (const auto& seg : h.checksums) {
    nlohmann::json s = nlohmann::json::array();
    for (auto c : seg) s.push_back(checksum_hex(c));
    sums.push_back(std::move(s));
  }
  nlohmann::json j = {{"address", h.address}, {"chunk", h.chunk}, {"checksums", sums}};
  if (!h.fallbacks.empty()) j["fallbacks"] = h.fallbacks;
  for (const auto& p : h.stripes) {
    j["stripes"].push_back({{"address", p.address}, {"fallbacks", p.fallbacks}});
  }
  if (!h.rkey.empty()) j["rkey"] = h.rkey, j["bases"] = h.bases;
  if (const auto& p = h.publisher; !h.rkey.empty() && p.pid > 0) {
    j["pid"] = p.pid, j["pid_start"] = p.start, j["pidns"] = p.pidns, j["boot"] = p.boot;
  }
  return j.dump();
}

result<handle> handle_parse(const std::string& text, const weight_update_manifest* m) {
  auto bad = [&](const std::string& why) -> error {
    return make_error(errc::invalid_manifest, "invalid manifest: transport_handle: " + why +
                                                  (m ? " (" + update_context(*m) + ")" : ""));
  };
  auto j = json_parse_bounded(text);
  if (j.is_discarded() || !j.is_object()) return bad("not a ucx handle");
  handle h;
  try {
    h.address = j.at("address").get<std::string>();
    h.chunk = json_read::field<std::uint64_t>(j, "chunk");
    for (const auto& seg : j.at("checksums")) {
      std::vector<std::uint64_t> sums;
      for (const auto& c : seg) {
        auto s = c.get<std::string>();
        std::uint64_t v = 0;
        auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
        if (ec != std::errc{} || end != s.data() + s.size() || s.size() != 16) {
          return bad("chunk checksum \"" + s + "\" is not 16 hex digits");
        }
        sums.push_back(v);
      }
      h.checksums.push_back(std::move(sums));
    }
    if (j.contains("fallbacks")) h.fallbacks = j.at("fallbacks").get<std::vector<std::string>>();
    if (j.contains("stripes")) {
      for (const auto& p : j.at("stripes")) {
        h.stripes.push_back({p.at("address").get<std::string>(),
                             p.at("fallbacks").get<std::vector<std::string>>()});
      }
    }
    if (j.contains("rkey")) {
      h.rkey = j.at("rkey").get<std::string>();
      h.bases = json_read::list<std::uint64_t>(j, "bases");
      if (j.contains("pid")) {
        h.publisher.pid = json_read::field<std::int64_t>(j, "pid");
        h.publisher.start = json_read::field<std::uint64_t>(j, "pid_start");
        h.publisher.pidns = json_read::field<std::uint64_t>(j, "pidns");
        h.publisher.boot = j.value("boot", std::string());  // absent: not watched
      }
    }
  } catch (const std::exception& e) {
    return bad(std::string("ucx handle field: ") + e.what());
  }
  if (!hex_decode(h.address)) return bad("address is not a hex UCX worker address");
  for (const auto& f : h.fallbacks) {
    if (!hex_decode(f)) return bad("a fallback is not a hex UCX worker address");
  }
  for (const auto& p : h.stripes) {
    bool ok = hex_decode(p.address).has_value();
    for (const auto& f : p.fallbacks) ok = ok && hex_decode(f).has_value();
    if (!ok) return bad("a stripe's source is not a hex UCX worker address");
  }
  if (!h.rkey.empty() && !hex_decode(h.rkey)) return bad("rkey is not hex");
  if (h.publisher.pid < 0 || h.publisher.pid > std::numeric_limits<std::int32_t>::max()) {
    return bad("pid " + std::to_string(h.publisher.pid) + " is not a process id");
  }
  if (h.chunk < page || h.chunk > (std::uint64_t{1} << 30)) {
    return bad("chunk " + std::to_string(h.chunk) + " is outside [4096, 1 GiB]");
  }
  if (m) {
    if (h.checksums.size() != m->segments.size()) {
      return bad(std::to_string(h.checksums.size()) + " checksum lists for " +
                 std::to_string(m->segments.size()) + " segments");
    }
    for (std::size_t i = 0; i < h.checksums.size(); ++i) {
      if (h.checksums[i].size() != chunks_of(m->segments[i].nbytes, h.chunk)) {
        return bad("segment " + std::to_string(i) + " has " +
                   std::to_string(h.checksums[i].size()) + " chunk checksums, its " +
                   std::to_string(m->segments[i].nbytes) + " bytes make " +
                   std::to_string(chunks_of(m->segments[i].nbytes, h.chunk)) + " chunks");
      }
    }
    if (!h.rkey.empty() && h.bases.size() != m->segments.size()) {
      return bad(std::to_string(h.bases.size()) + " segment addresses for " +
                 std::to_string(m->segments.size()) + " segments");
    }
  }
  return h;
}

result<std::string> handle_via_relay(const std::string& text, const std::string& relay_address) {
  auto h = handle_parse(text, nullptr);
  if (!h) return h.error();
  if (!hex_decode(relay_address)) {
    return make_error(errc::invalid_argument,
                      "ucx: relay address \"" + relay_address.substr(0, 32) +
                          "\" is not a UCX worker address (field relay_address)");
  }
  // The relay first; should it fail, what it pulls from, and so on up to the publisher. A
  // relay serves every chunk, whichever stripe brought it: the child pulls them all there.
  if (!h->stripes.empty()) {
    h->address = h->stripes[0].address;
    h->fallbacks = h->stripes[0].fallbacks;
    h->stripes.clear();
  }
  h->fallbacks.insert(h->fallbacks.begin(), h->address);
  h->address = relay_address;
  h->rkey.clear();  // a relay serves by request; the publisher's memory keys mean nothing there
  h->publisher = {};
  h->bases.clear();
  return handle_dump(*h);
}

result<std::string> handle_striped(const std::vector<std::string>& texts) {
  if (texts.empty()) {
    return make_error(errc::invalid_argument, "ucx: no handle to stripe (field handles)");
  }
  if (texts.size() == 1) return texts[0];
  std::optional<handle> out;
  for (const auto& text : texts) {
    auto h = handle_parse(text, nullptr);
    if (!h) return h.error();
    if (!h->stripes.empty()) {
      return make_error(errc::invalid_argument, "ucx: a handle given to stripe is striped itself");
    }
    if (out && (h->chunk != out->chunk || h->checksums != out->checksums)) {
      return make_error(errc::invalid_argument,
                        "ucx: handles to stripe describe different updates (chunk, checksums)");
    }
    if (!out) out = *h;
    out->stripes.push_back({h->address, h->fallbacks});
  }
  out->rkey.clear();  // stripes pull by request
  out->publisher = {};
  out->bases.clear();
  return handle_dump(*out);
}

}  // namespace wsync::ucx_detail
