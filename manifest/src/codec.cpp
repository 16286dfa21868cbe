#include "wsync/manifest/codec.hpp"

#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/json_bounded.hpp"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <limits>
#include <set>

namespace wsync {
namespace {

using json = nlohmann::json;

// Bumped when a field changes meaning; decoders refuse formats they do not know.
constexpr int format_version = 1;

constexpr char b64_alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// The transport handle is opaque bytes; base64 keeps any byte intact through JSON.
std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    auto v = (std::uint32_t(std::uint8_t(in[i])) << 16) |
             (std::uint32_t(std::uint8_t(in[i + 1])) << 8) | std::uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(b64_alphabet[(v >> s) & 63]);
  }
  if (i < in.size()) {
    std::uint32_t v = std::uint32_t(std::uint8_t(in[i])) << 16;
    if (i + 1 < in.size()) v |= std::uint32_t(std::uint8_t(in[i + 1])) << 8;
    out.push_back(b64_alphabet[(v >> 18) & 63]);
    out.push_back(b64_alphabet[(v >> 12) & 63]);
    out.push_back(i + 1 < in.size() ? b64_alphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

bool base64_decode(std::string_view in, std::string& out) {
  if (in.size() % 4 != 0) return false;
  out.clear();
  out.reserve(in.size() / 4 * 3);
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  for (std::size_t i = 0; i < in.size(); i += 4) {
    int pad = (in[i + 3] == '=') + (in[i + 2] == '=' && in[i + 3] == '=');
    if (pad > 0 && i + 4 != in.size()) return false;
    std::uint32_t v = 0;
    for (int k = 0; k < 4 - pad; ++k) {
      int d = value(in[i + k]);
      if (d < 0) return false;
      v |= std::uint32_t(d) << (18 - 6 * k);
    }
    out.push_back(char((v >> 16) & 0xff));
    if (pad < 2) out.push_back(char((v >> 8) & 0xff));
    if (pad < 1) out.push_back(char(v & 0xff));
  }
  return true;
}

bool parse_hex64(const std::string& s, std::uint64_t& out) {
  if (s.size() != 16) return false;
  std::uint64_t v = 0;
  for (char c : s) {
    int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = (v << 4) | std::uint64_t(d);
  }
  out = v;
  return true;
}

// Reads fields of one JSON object strictly: each key must be read once, unknown keys are errors.
class reader {
 public:
  reader(const json& obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  std::string field(const char* key) const {
    return path_.empty() ? std::string(key) : path_ + "." + key;
  }

  const json* get(const char* key, json::value_t kind, std::string& err) {
    seen_.insert(key);
    auto it = obj_.find(key);
    if (it == obj_.end()) return err = field(key) + ": missing", nullptr;
    bool ok =
        it->type() == kind || (kind == json::value_t::number_integer && it->is_number_unsigned());
    if (!ok) return err = field(key) + ": expected " + type_word(kind), nullptr;
    return &*it;
  }

  std::string unknown_key() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (!seen_.count(it.key())) return field(it.key().c_str()) + ": unknown field";
    }
    return {};
  }

 private:
  static const char* type_word(json::value_t kind) {
    switch (kind) {
      case json::value_t::string:
        return "a string";
      case json::value_t::number_unsigned:
        return "a non-negative integer";
      case json::value_t::number_integer:
        return "an integer";
      case json::value_t::array:
        return "an array";
      case json::value_t::object:
        return "an object";
      default:
        return "another type";
    }
  }

  const json& obj_;
  std::string path_;
  std::set<std::string> seen_;
};

template <class T>
bool read_uint(reader& r, const char* key, T& out, std::string& err) {
  const json* v = r.get(key, json::value_t::number_unsigned, err);
  if (!v) return false;
  auto n = v->get<std::uint64_t>();
  if (n > std::numeric_limits<T>::max()) return err = r.field(key) + ": out of range", false;
  out = static_cast<T>(n);
  return true;
}

bool read_string(reader& r, const char* key, std::string& out, std::string& err) {
  const json* v = r.get(key, json::value_t::string, err);
  if (!v) return false;
  out = v->get<std::string>();
  return true;
}

bool read_int_array(reader& r, const char* key, std::vector<std::int64_t>& out, std::string& err) {
  const json* v = r.get(key, json::value_t::array, err);
  if (!v) return false;
  out.clear();
  for (std::size_t i = 0; i < v->size(); ++i) {
    const auto& e = (*v)[i];
    if (e.is_number_unsigned()) {
      auto u = e.get<std::uint64_t>();
      if (u > std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
        return err = r.field(key) + "[" + std::to_string(i) + "]: out of range", false;
      }
      out.push_back(static_cast<std::int64_t>(u));
    } else if (e.is_number_integer()) {
      out.push_back(e.get<std::int64_t>());
    } else {
      return err = r.field(key) + "[" + std::to_string(i) + "]: expected an integer", false;
    }
  }
  return true;
}

bool read_tensor(const json& j, std::size_t i, tensor_descriptor& t, std::string& err) {
  std::string path = "tensors[" + std::to_string(i) + "]";
  if (!j.is_object()) return err = path + ": expected an object", false;
  reader r(j, path);
  std::string dtype_text, checksum_text;
  if (!read_string(r, "name", t.name, err) || !read_string(r, "dtype", dtype_text, err) ||
      !read_int_array(r, "shape", t.shape, err) || !read_int_array(r, "strides", t.strides, err) ||
      !read_uint(r, "nbytes", t.nbytes, err) || !read_string(r, "device", t.device, err) ||
      !read_uint(r, "segment", t.segment, err) || !read_uint(r, "offset", t.offset, err) ||
      !read_string(r, "checksum", checksum_text, err)) {
    return false;
  }
  auto dt = dtype_parse(dtype_text);
  if (!dt) return err = path + ".dtype: unknown dtype \"" + dtype_text + "\"", false;
  t.dtype = *dt;
  if (!parse_hex64(checksum_text, t.checksum)) {
    return err = path + ".checksum: expected 16 lower-case hex digits", false;
  }
  err = r.unknown_key();
  return err.empty();
}

bool read_manifest(const json& j, weight_update_manifest& m, std::string& err) {
  if (!j.is_object()) return err = "manifest: expected a JSON object", false;
  reader r(j, "");
  int format = 0;
  if (!read_uint(r, "wsync_manifest", format, err)) return false;
  if (format != format_version) {
    return err = "wsync_manifest: format " + std::to_string(format) + " is not supported (want " +
                 std::to_string(format_version) + ")",
           false;
  }
  std::string handle64;
  if (!read_string(r, "update_id", m.update_id, err) ||
      !read_string(r, "model_id", m.model_id, err) ||
      !read_uint(r, "weight_version", m.weight_version, err) ||
      !read_string(r, "source_worker", m.source_worker, err) ||
      !read_uint(r, "source_rank", m.source_rank, err) ||
      !read_string(r, "transport", m.transport, err) ||
      !read_string(r, "transport_handle", handle64, err) ||
      !read_uint(r, "total_bytes", m.total_bytes, err)) {
    return false;
  }
  if (!base64_decode(handle64, m.transport_handle)) {
    return err = "transport_handle: not valid base64", false;
  }
  const json* tensors = r.get("tensors", json::value_t::array, err);
  if (!tensors) return false;
  m.tensors.resize(tensors->size());
  for (std::size_t i = 0; i < tensors->size(); ++i) {
    if (!read_tensor((*tensors)[i], i, m.tensors[i], err)) return false;
  }
  const json* segments = r.get("segments", json::value_t::array, err);
  if (!segments) return false;
  m.segments.resize(segments->size());
  for (std::size_t i = 0; i < segments->size(); ++i) {
    const auto& s = (*segments)[i];
    std::string path = "segments[" + std::to_string(i) + "]";
    if (!s.is_object()) return err = path + ": expected an object", false;
    reader sr(s, path);
    if (!read_uint(sr, "nbytes", m.segments[i].nbytes, err)) return false;
    if (err = sr.unknown_key(); !err.empty()) return false;
  }
  if (j.contains("checksum")) {  // absent: xxh3-64 over each whole tensor
    const json* cs = r.get("checksum", json::value_t::object, err);
    if (!cs) return false;
    reader cr(*cs, "checksum");
    std::string algorithm;
    if (!read_string(cr, "algorithm", algorithm, err)) return false;
    auto parsed = checksum_algorithm_parse(algorithm);
    if (!parsed) {
      return err =
                 "checksum.algorithm: \"" + algorithm + "\" is neither xxh3-64 nor xxh3-64-chunked",
             false;
    }
    m.checksum_method.algorithm = *parsed;
    if (cs->contains("chunk_bytes") &&
        !read_uint(cr, "chunk_bytes", m.checksum_method.chunk_bytes, err)) {
      return false;
    }
    if (err = cr.unknown_key(); !err.empty()) return false;
  }
  const json* meta = r.get("metadata", json::value_t::object, err);
  if (!meta) return false;
  m.metadata.clear();
  for (auto it = meta->begin(); it != meta->end(); ++it) {
    if (!it->is_string()) return err = "metadata." + it.key() + ": expected a string", false;
    m.metadata.emplace(it.key(), it->get<std::string>());
  }
  err = r.unknown_key();
  return err.empty();
}

}  // namespace

std::string manifest_to_json(const weight_update_manifest& m) {
  json tensors = json::array();
  for (const auto& t : m.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", dtype_name(t.dtype)},
                       {"shape", t.shape},
                       {"strides", t.strides},
                       {"nbytes", t.nbytes},
                       {"device", t.device},
                       {"segment", t.segment},
                       {"offset", t.offset},
                       {"checksum", checksum_hex(t.checksum)}});
  }
  json segments = json::array();
  for (const auto& s : m.segments) segments.push_back({{"nbytes", s.nbytes}});
  json j = {
      {"wsync_manifest", format_version}, {"update_id", m.update_id},
      {"model_id", m.model_id},           {"weight_version", m.weight_version},
      {"source_worker", m.source_worker}, {"source_rank", m.source_rank},
      {"transport", m.transport},         {"transport_handle", base64_encode(m.transport_handle)},
      {"tensors", std::move(tensors)},    {"segments", std::move(segments)},
      {"metadata", m.metadata},           {"total_bytes", m.total_bytes}};
  if (m.checksum_method != checksum_method{}) {
    j["checksum"] = {{"algorithm", checksum_algorithm_name(m.checksum_method.algorithm)},
                     {"chunk_bytes", m.checksum_method.chunk_bytes}};
  }
  // Names and ids may hold any bytes; replace invalid UTF-8 rather than throw. Validation refuses
  // such ids, so a valid manifest always round-trips exactly.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

result<weight_update_manifest> manifest_from_json(std::string_view text) {
  bool too_deep = false;
  json j = json_parse_bounded(text, &too_deep);
  weight_update_manifest m;
  std::string err;
  if (j.is_discarded()) {
    err = too_deep ? "manifest: nested deeper than " + std::to_string(json_max_depth) + " levels"
                   : "manifest: not valid JSON";
  } else if (read_manifest(j, m, err)) {
    return m;
  }
  std::string context = update_context(m.update_id, m.source_rank);
  return make_error(errc::invalid_manifest, "invalid manifest: " + err + " (" + context + ")");
}

}  // namespace wsync
