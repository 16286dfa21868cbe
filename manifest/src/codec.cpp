#include "wsync/manifest/codec.hpp"

#include "src/plain_json.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/codec_json.hpp"
#include "wsync/manifest/json_bounded.hpp"
#include "wsync/manifest/json_writer.hpp"
#include "wsync/manifest/validate.hpp"

#include <nlohmann/json.hpp>

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
  // Sized only within the limit validation holds them to: a body of "{}," would otherwise
  // make this allocate ~150 bytes per 3 it holds before the first entry is refused.
  const std::uint64_t most = manifest_limits{}.max_tensors;
  const json* tensors = r.get("tensors", json::value_t::array, err);
  if (!tensors) return false;
  if (tensors->size() > most) {
    return err = "tensors: more than " + std::to_string(most) + " tensors", false;
  }
  m.tensors.resize(tensors->size());
  for (std::size_t i = 0; i < tensors->size(); ++i) {
    if (!read_tensor((*tensors)[i], i, m.tensors[i], err)) return false;
  }
  const json* segments = r.get("segments", json::value_t::array, err);
  if (!segments) return false;
  if (segments->size() > most) {
    return err = "segments: more than " + std::to_string(most) + " segments", false;
  }
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

// The decoder's fast path: a SAX reader that fills the manifest as the text streams by, for a
// manifest shaped as manifest_to_json writes it (keys in any order). It gives up (false) at
// the first thing it does not expect: anything off (a missing, unknown, repeated or mistyped
// field, a value out of range, text that is not JSON) goes to read_manifest over the parsed
// document, which names the problem. What it accepts, read_manifest accepts as the same
// manifest (codec.test.cpp checks that on mutated texts). Building the document took about
// 2 ms for 290 tensors, on every hop of every update.
class fast_reader {
 public:
  explicit fast_reader(weight_update_manifest& m) : m_(m) {}

  bool null() { return false; }
  bool boolean(bool) { return false; }
  bool number_float(double, const std::string&) { return false; }
  bool binary(std::vector<std::uint8_t>&) { return false; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

  bool number_integer(std::int64_t v) {  // negative: only a dimension or a stride may be
    if (at_ != in::dims) return false;
    dims_->push_back(v);
    return true;
  }
  bool number_unsigned(std::uint64_t v) {
    switch (at_) {
      case in::dims:
        if (v > std::uint64_t(std::numeric_limits<std::int64_t>::max())) return false;
        dims_->push_back(static_cast<std::int64_t>(v));
        return true;
      case in::root:
        switch (field_) {
          case f_format:
            return v == format_version;
          case f_weight_version:
            return m_.weight_version = v, true;
          case f_source_rank:
            return v <= std::uint64_t(std::numeric_limits<std::int32_t>::max()) &&
                   (m_.source_rank = static_cast<std::int32_t>(v), true);
          case f_total_bytes:
            return m_.total_bytes = v, true;
          default:
            return false;
        }
      case in::tensor: {
        auto& t = m_.tensors.back();
        switch (field_) {
          case t_nbytes:
            return t.nbytes = v, true;
          case t_segment:
            return v <= std::numeric_limits<std::uint32_t>::max() &&
                   (t.segment = static_cast<std::uint32_t>(v), true);
          case t_offset:
            return t.offset = v, true;
          default:
            return false;
        }
      }
      case in::segment:
        return m_.segments.back().nbytes = v, true;
      case in::checksum:
        return field_ == c_chunk_bytes && (m_.checksum_method.chunk_bytes = v, true);
      default:
        return false;
    }
  }
  bool string(std::string& v) {
    switch (at_) {
      case in::root:
        switch (field_) {
          case f_update_id:
            return m_.update_id = std::move(v), true;
          case f_model_id:
            return m_.model_id = std::move(v), true;
          case f_source_worker:
            return m_.source_worker = std::move(v), true;
          case f_transport:
            return m_.transport = std::move(v), true;
          case f_transport_handle:
            return base64_decode(v, m_.transport_handle);
          default:
            return false;
        }
      case in::tensor: {
        auto& t = m_.tensors.back();
        switch (field_) {
          case t_name:
            return t.name = std::move(v), true;
          case t_device:
            return t.device = std::move(v), true;
          case t_dtype: {
            auto d = dtype_parse(v);
            return d && (t.dtype = *d, true);
          }
          case t_checksum:
            return parse_hex64(v, t.checksum);
          default:
            return false;
        }
      }
      case in::checksum: {
        if (field_ != c_algorithm) return false;
        auto a = checksum_algorithm_parse(v);
        return a && (m_.checksum_method.algorithm = *a, true);
      }
      case in::metadata:
        return m_.metadata.emplace(std::move(key_), std::move(v)).second;
      default:
        return false;
    }
  }
  bool key(std::string& k) {
    switch (at_) {
      case in::root:
        return take(k, root_keys, root_seen_);
      case in::tensor:
        return take(k, tensor_keys, tensor_seen_);
      case in::segment:
        return take(k, segment_keys, segment_seen_);
      case in::checksum:
        return take(k, checksum_keys, checksum_seen_);
      case in::metadata:
        key_ = std::move(k);
        return true;
      default:
        return false;
    }
  }
  bool start_object(std::size_t) {
    switch (at_) {
      case in::start:
        return at_ = in::root, true;
      case in::tensors:
        if (m_.tensors.size() >= manifest_limits{}.max_tensors) return false;
        m_.tensors.emplace_back();
        tensor_seen_ = 0;
        return at_ = in::tensor, true;
      case in::segments:
        if (m_.segments.size() >= manifest_limits{}.max_tensors) return false;
        m_.segments.emplace_back();
        segment_seen_ = 0;
        return at_ = in::segment, true;
      case in::root:
        if (field_ == f_checksum) return checksum_seen_ = 0, at_ = in::checksum, true;
        if (field_ == f_metadata) return at_ = in::metadata, true;
        return false;
      default:
        return false;
    }
  }
  bool end_object() {
    switch (at_) {
      case in::root:
        // Every field but the checksum method (absent: xxh3-64 over whole tensors).
        return root_seen_ == (all(root_keys) & ~bit(f_checksum)) || root_seen_ == all(root_keys)
                   ? (at_ = in::done, true)
                   : false;
      case in::tensor:
        return tensor_seen_ == all(tensor_keys) && (at_ = in::tensors, true);
      case in::segment:
        return segment_seen_ == all(segment_keys) && (at_ = in::segments, true);
      case in::checksum:
        return (checksum_seen_ & bit(c_algorithm)) != 0 && (at_ = in::root, true);
      case in::metadata:
        return at_ = in::root, true;
      default:
        return false;
    }
  }
  bool start_array(std::size_t) {
    if (at_ == in::root && field_ == f_tensors) return at_ = in::tensors, true;
    if (at_ == in::root && field_ == f_segments) return at_ = in::segments, true;
    if (at_ == in::tensor && (field_ == t_shape || field_ == t_strides)) {
      dims_ = field_ == t_shape ? &m_.tensors.back().shape : &m_.tensors.back().strides;
      return at_ = in::dims, true;
    }
    return false;
  }
  bool end_array() {
    switch (at_) {
      case in::dims:
        return at_ = in::tensor, true;
      case in::tensors:
      case in::segments:
        return at_ = in::root, true;
      default:
        return false;
    }
  }

  bool done() const { return at_ == in::done; }

 private:
  enum class in { start, root, tensors, tensor, dims, segments, segment, checksum, metadata, done };
  // Field numbers: their index in the key lists below.
  enum root_field {
    f_format,
    f_update_id,
    f_model_id,
    f_weight_version,
    f_source_worker,
    f_source_rank,
    f_transport,
    f_transport_handle,
    f_total_bytes,
    f_tensors,
    f_segments,
    f_checksum,
    f_metadata
  };
  enum tensor_field {
    t_name,
    t_dtype,
    t_shape,
    t_strides,
    t_nbytes,
    t_device,
    t_segment,
    t_offset,
    t_checksum
  };
  enum checksum_field { c_algorithm, c_chunk_bytes };
  static constexpr std::string_view root_keys[] = {
      "wsync_manifest", "update_id", "model_id",         "weight_version", "source_worker",
      "source_rank",    "transport", "transport_handle", "total_bytes",    "tensors",
      "segments",       "checksum",  "metadata"};
  static constexpr std::string_view tensor_keys[] = {
      "name", "dtype", "shape", "strides", "nbytes", "device", "segment", "offset", "checksum"};
  static constexpr std::string_view segment_keys[] = {"nbytes"};
  static constexpr std::string_view checksum_keys[] = {"algorithm", "chunk_bytes"};

  static constexpr std::uint32_t bit(int field) { return std::uint32_t{1} << field; }
  template <std::size_t N>
  static constexpr std::uint32_t all(const std::string_view (&)[N]) {
    return (std::uint32_t{1} << N) - 1;
  }
  // The field named `k` among `keys`, once per object.
  template <std::size_t N>
  bool take(const std::string& k, const std::string_view (&keys)[N], std::uint32_t& seen) {
    for (std::size_t i = 0; i < N; ++i) {
      if (keys[i] != k) continue;
      if (seen & bit(static_cast<int>(i))) return false;
      seen |= bit(static_cast<int>(i));
      field_ = static_cast<int>(i);
      return true;
    }
    return false;
  }

  weight_update_manifest& m_;
  in at_ = in::start;
  int field_ = -1;
  std::string key_;  // metadata: the key of the value that follows
  std::vector<std::int64_t>* dims_ = nullptr;
  std::uint32_t root_seen_ = 0, tensor_seen_ = 0, segment_seen_ = 0, checksum_seen_ = 0;
};

}  // namespace

// The manifest's JSON written straight into one string: what nlohmann's dump() of the same
// object gives, byte for byte (keys written in sorted order, compact), without building the
// object first. For 290 tensors that took about 2 ms, on the path of every publish and
// distribution.
std::string manifest_to_json(const weight_update_manifest& m) {
  json_writer w(512 + m.tensors.size() * 192 + m.transport_handle.size() * 4 / 3);
  w.open('{');
  if (m.checksum_method != checksum_method{}) {
    w.key("checksum").open('{');
    w.key("algorithm").text(checksum_algorithm_name(m.checksum_method.algorithm));
    w.key("chunk_bytes").number(m.checksum_method.chunk_bytes);
    w.close('}');
  }
  w.key("metadata").open('{');
  for (const auto& [k, v] : m.metadata) w.key(k).text(v);  // std::map: sorted, as dump() sorts
  w.close('}');
  w.key("model_id").text(m.model_id);
  w.key("segments").open('[');
  for (const auto& seg : m.segments) w.open('{').key("nbytes").number(seg.nbytes).close('}');
  w.close(']');
  w.key("source_rank").number(m.source_rank);
  w.key("source_worker").text(m.source_worker);
  w.key("tensors").open('[');
  for (const auto& t : m.tensors) {
    w.open('{');
    w.key("checksum").text(checksum_hex(t.checksum));
    w.key("device").text(t.device);
    w.key("dtype").text(dtype_name(t.dtype));
    w.key("name").text(t.name);
    w.key("nbytes").number(t.nbytes);
    w.key("offset").number(t.offset);
    w.key("segment").number(t.segment);
    w.key("shape").numbers(t.shape);
    w.key("strides").numbers(t.strides);
    w.close('}');
  }
  w.close(']');
  w.key("total_bytes").number(m.total_bytes);
  w.key("transport").text(m.transport);
  w.key("transport_handle").text(base64_encode(m.transport_handle));
  w.key("update_id").text(m.update_id);
  w.key("weight_version").number(m.weight_version);
  w.key("wsync_manifest").number(format_version);
  w.close('}');
  return w.take();
}

result<weight_update_manifest> manifest_from_json(std::string_view text) {
  {
    // Plain JSON through our lexer; what it leaves through nlohmann's (unless the reader
    // already said no: it would again); anything either refuses through the document, whose
    // reader names the problem.
    weight_update_manifest m;
    fast_reader fast(m);
    const auto plain = detail::plain_parse(text, fast);
    if (plain == detail::plain_result::accepted && fast.done()) return m;
    if (plain == detail::plain_result::other) {
      weight_update_manifest again;
      fast_reader library(again);
      if (json::sax_parse(text.begin(), text.end(), &library) && library.done()) return again;
    }
  }
  return detail::manifest_from_json_document(text);
}

namespace detail {

std::optional<weight_update_manifest> manifest_from_plain_json(std::string_view text) {
  weight_update_manifest m;
  fast_reader fast(m);
  if (plain_parse(text, fast) == plain_result::accepted && fast.done()) return m;
  return std::nullopt;
}

result<weight_update_manifest> manifest_from_json_document(std::string_view text) {
  bool too_deep = false;
  std::string twice;
  json j = json_parse_bounded(text, &too_deep, &twice);
  if (!j.is_discarded()) return manifest_from_json_value(j);
  // A key given twice is refused, not read as its last value: a proxy or an auditor whose
  // parser keeps the first would see another id or checksum than the one installed.
  const std::string err =
      too_deep        ? "manifest: nested deeper than " + std::to_string(json_max_depth) + " levels"
      : twice.empty() ? std::string("manifest: not valid JSON")
                      : "manifest: key \"" + twice.substr(0, 64) + "\" given twice in one object";
  return make_error(errc::invalid_manifest,
                    "invalid manifest: " + err + " (update_id=<none> rank=<none>)");
}

}  // namespace detail

result<weight_update_manifest> manifest_from_json_value(const json& j) {
  weight_update_manifest m;
  std::string err;
  if (read_manifest(j, m, err)) return m;
  // The rank as the manifest gives it, where it does: a field read before it may be the one
  // that failed, and 0 would name a rank the manifest never said.
  const auto rank = j.is_object() ? j.find("source_rank") : j.end();
  const bool named = rank != j.end() && rank->is_number_integer();
  const std::string context = "update_id=" + update_id_shown(m.update_id) +
                              " rank=" + (named ? rank->dump() : std::string("<none>"));
  return make_error(errc::invalid_manifest, "invalid manifest: " + err + " (" + context + ")");
}

}  // namespace wsync
