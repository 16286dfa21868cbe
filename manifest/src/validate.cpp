#include "wsync/manifest/validate.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "src/utf8.hpp"
#include "wsync/manifest/checksum.hpp"

namespace wsync {
namespace {

bool mul_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}
bool add_overflows(std::uint64_t a, std::uint64_t b, std::uint64_t& out) {
  return __builtin_add_overflow(a, b, &out);
}

bool printable_id(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.' || c == ':' || c == '/' || c == '@';
  });
}

// JSON carries text: a name that is not UTF-8 (or holds control characters) cannot round-trip.
// Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing past U+10FFFF (the JSON
// writer replaces those, which would rename the tensor on the way, or make two names one); and
// no control characters (C0, DEL, C1: a terminal acts on them when a log or an error shows the
// name).
bool valid_text(std::string_view s) {
  std::size_t i = 0;
  // Plain ASCII without control characters, eight bytes at a time (tensor names are): no byte
  // with its high bit set, none below 0x20 and none 0x7f (DEL) (the borrow test of "has a byte
  // less than n", on the bytes and on their complement to 0x7f).
  constexpr std::uint64_t ones = 0x0101010101010101, highs = 0x8080808080808080;
  for (std::uint64_t w; i + 8 <= s.size(); i += 8) {
    std::memcpy(&w, s.data() + i, 8);
    const std::uint64_t del = w ^ (0x7f * ones);  // a zero byte where w had DEL
    if ((w & highs) != 0 || ((w - 0x20 * ones) & ~w & highs) != 0 ||
        ((del - ones) & ~del & highs) != 0) {
      break;
    }
  }
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) return false;
      ++i;
      continue;
    }
    const std::size_t len = detail::utf8_length(s, i);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

bool valid_device(std::string_view d) {
  if (d == "cpu") return true;
  if (d.substr(0, 5) != "cuda:" || d.size() == 5 || d.size() > 9) return false;
  return std::all_of(d.begin() + 5, d.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool row_major(const tensor_descriptor& t) {
  if (t.strides.empty()) return true;
  std::int64_t expect = 1;
  for (std::size_t i = t.shape.size(); i-- > 0;) {
    if (t.shape[i] != 1 && t.strides[i] != expect) return false;
    // An empty tensor's later dimensions may multiply past 64 bits; no stride can match then.
    if (__builtin_mul_overflow(expect, t.shape[i], &expect)) return false;
  }
  return true;
}

// Collects the first problem found; every message names the field and the update.
class checker {
 public:
  explicit checker(const weight_update_manifest& m) : context_(update_context(m)) {}

  result<void> fail(const std::string& field, const std::string& why) const {
    return make_error(errc::invalid_manifest,
                      "invalid manifest: " + field + ": " + why + " (" + context_ + ")");
  }

 private:
  std::string context_;
};

std::string tensor_field(std::size_t i, const char* field) {
  return "tensors[" + std::to_string(i) + "]." + field;
}

}  // namespace

bool tensor_element_count(const tensor_descriptor& t, std::uint64_t& out) {
  // A zero anywhere makes the tensor empty, whatever the other dimensions multiply to: the
  // answer must not depend on their order (safetensors reads such shapes the same way).
  if (std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end()) {
    // The other dimensions still multiply to a signed 64-bit count: engines (torch among them)
    // multiply every dimension in order and refuse an overflow, even one a later zero cancels.
    std::int64_t others = 1;
    for (auto d : t.shape) {
      if (d < 0 || (d != 0 && __builtin_mul_overflow(others, d, &others))) return false;
    }
    return out = 0, true;
  }
  std::uint64_t n = 1;
  for (auto d : t.shape) {
    if (d < 0 || mul_overflows(n, static_cast<std::uint64_t>(d), n)) return false;
  }
  out = n;
  return true;
}

bool tensor_span_bytes(const tensor_descriptor& t, std::uint64_t& out) {
  std::uint64_t elements = 0;
  if (!tensor_element_count(t, elements)) return false;
  std::uint64_t itemsize = dtype_itemsize(t.dtype);
  if (elements == 0) return out = 0, true;
  if (t.strides.empty()) return !mul_overflows(elements, itemsize, out);
  if (t.strides.size() != t.shape.size()) return false;  // no span; never read past strides
  // Highest element index reachable is sum((dim - 1) * stride).
  std::uint64_t last = 0;
  for (std::size_t i = 0; i < t.shape.size(); ++i) {
    std::uint64_t step = 0;
    if (t.strides[i] < 0) return false;
    if (mul_overflows(static_cast<std::uint64_t>(t.shape[i] - 1),
                      static_cast<std::uint64_t>(t.strides[i]), step) ||
        add_overflows(last, step, last)) {
      return false;
    }
  }
  std::uint64_t count = 0;
  return !add_overflows(last, 1, count) && !mul_overflows(count, itemsize, out);
}

name_set::name_set(std::size_t expected) {
  std::size_t n = 16;
  while (n < 2 * expected) n *= 2;
  slots_.resize(n);
}

// The slot holding `name`, or the free one where it would go (the table is never full).
std::size_t name_set::find(std::string_view name) const {
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t i = std::hash<std::string_view>{}(name)&mask;; i = (i + 1) & mask) {
    if (slots_[i].data() == nullptr || slots_[i] == name) return i;
  }
}

bool name_set::insert(std::string_view name) {
  // A free slot holds a default view; a name's view never has null data, even when empty.
  if (name.data() == nullptr) name = std::string_view("", 0);
  if (2 * (size_ + 1) > slots_.size()) grow();
  auto& slot = slots_[find(name)];
  if (slot.data() != nullptr) return false;
  slot = name;
  ++size_;
  return true;
}

bool name_set::contains(std::string_view name) const {
  if (name.data() == nullptr) name = std::string_view("", 0);
  return slots_[find(name)].data() != nullptr;
}

void name_set::grow() {
  std::vector<std::string_view> old(slots_.size() * 2);
  old.swap(slots_);
  size_ = 0;
  for (auto v : old) {
    if (v.data() != nullptr) insert(v);
  }
}

result<void> manifest_validate(const weight_update_manifest& m,
                               bool (*known_transport)(std::string_view),
                               const manifest_limits& limits) {
  checker c(m);
  if (m.update_id.empty()) return c.fail("update_id", "empty");
  if (m.update_id.size() > 128 || !printable_id(m.update_id)) {
    return c.fail("update_id", "must be at most 128 characters of [A-Za-z0-9._:/@-]");
  }
  if (m.model_id.empty()) return c.fail("model_id", "empty");
  if (m.model_id.size() > limits.max_name_bytes || !printable_id(m.model_id)) {
    return c.fail("model_id", "must be at most " + std::to_string(limits.max_name_bytes) +
                                  " characters of [A-Za-z0-9._:/@-]");
  }
  if (m.source_rank < 0 || static_cast<std::uint64_t>(m.source_rank) > limits.max_rank) {
    return c.fail("source_rank", "out of range: " + std::to_string(m.source_rank));
  }
  // Carried as text on every hop: bytes JSON cannot hold would change on the way.
  if (m.source_worker.size() > limits.max_name_bytes || !valid_text(m.source_worker)) {
    return c.fail("source_worker", "must be at most " + std::to_string(limits.max_name_bytes) +
                                       " bytes of UTF-8 text without control characters");
  }
  if (m.transport.empty()) return c.fail("transport", "empty");
  if (m.transport.size() > 64 || !valid_text(m.transport)) {
    return c.fail("transport", "must be at most 64 bytes of UTF-8 text without control characters");
  }
  if (known_transport && !known_transport(m.transport)) {
    return c.fail("transport", "unknown transport \"" + m.transport + "\"");
  }
  if (m.transport_handle.size() > limits.max_handle_bytes) {
    return c.fail("transport_handle",
                  "larger than " + std::to_string(limits.max_handle_bytes) + " bytes");
  }
  for (const auto& [key, value] : m.metadata) {
    if (key.empty()) return c.fail("metadata", "empty key");
    if (!valid_text(key) || !valid_text(value)) {
      return c.fail("metadata", "key or value is not UTF-8 text without control characters");
    }
  }

  const auto& cm = m.checksum_method;
  if (cm.algorithm != checksum_algorithm::xxh3_64 &&
      cm.algorithm != checksum_algorithm::xxh3_64_chunked) {
    return c.fail("checksum.algorithm",
                  "unknown value " + std::to_string(static_cast<int>(cm.algorithm)));
  }
  if (cm.algorithm == checksum_algorithm::xxh3_64 && cm.chunk_bytes != 0) {
    return c.fail("checksum.chunk_bytes", "set, but xxh3-64 hashes whole tensors");
  }
  if (cm.algorithm == checksum_algorithm::xxh3_64_chunked &&
      (cm.chunk_bytes < checksum_chunk_min || cm.chunk_bytes > checksum_chunk_max ||
       (cm.chunk_bytes & (cm.chunk_bytes - 1)) != 0)) {
    return c.fail("checksum.chunk_bytes", std::to_string(cm.chunk_bytes) +
                                              " is not a power of two from " +
                                              std::to_string(checksum_chunk_min) + " to " +
                                              std::to_string(checksum_chunk_max));
  }

  // Segments: sizes add up to total_bytes without overflow and within limits.
  if (m.tensors.empty()) return c.fail("tensors", "empty: an update carries at least one tensor");
  if (m.tensors.size() > limits.max_tensors) {
    return c.fail("tensors", "more than " + std::to_string(limits.max_tensors) + " tensors");
  }
  if (m.segments.empty()) return c.fail("segments", "empty");
  if (m.segments.size() > m.tensors.size()) {
    return c.fail("segments", std::to_string(m.segments.size()) + " segments for " +
                                  std::to_string(m.tensors.size()) + " tensors");
  }
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < m.segments.size(); ++i) {
    if (add_overflows(total, m.segments[i].nbytes, total) || total > limits.max_total_bytes) {
      return c.fail("segments[" + std::to_string(i) + "].nbytes",
                    "total size exceeds " + std::to_string(limits.max_total_bytes) + " bytes");
    }
  }
  if (total != m.total_bytes) {
    return c.fail("total_bytes", std::to_string(m.total_bytes) + " but segments add up to " +
                                     std::to_string(total));
  }

  name_set names(m.tensors.size());
  for (std::size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    if (t.name.empty()) return c.fail(tensor_field(i, "name"), "empty");
    if (t.name.size() > limits.max_name_bytes) {
      return c.fail(tensor_field(i, "name"),
                    "longer than " + std::to_string(limits.max_name_bytes) + " bytes");
    }
    if (!valid_text(t.name)) {
      return c.fail(tensor_field(i, "name"), "not UTF-8 text without control characters");
    }
    if (!names.insert(t.name)) {
      return c.fail(tensor_field(i, "name"), "duplicate name \"" + t.name + "\"");
    }
    if (dtype_itemsize(t.dtype) == 0) {
      return c.fail(tensor_field(i, "dtype"),
                    "unknown dtype " + std::to_string(static_cast<int>(t.dtype)));
    }
    if (t.shape.size() > limits.max_dims) {
      return c.fail(tensor_field(i, "shape"),
                    "more than " + std::to_string(limits.max_dims) + " dimensions");
    }
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shape[d] < 0) {
        return c.fail(
            tensor_field(i, "shape"),
            "dimension " + std::to_string(d) + " is negative (" + std::to_string(t.shape[d]) + ")");
      }
    }
    std::uint64_t elements = 0, want = 0;
    if (!tensor_element_count(t, elements) ||
        mul_overflows(elements, dtype_itemsize(t.dtype), want) || want > limits.max_total_bytes) {
      return c.fail(tensor_field(i, "shape"), "element count overflows or exceeds limits");
    }
    if (!t.strides.empty()) {
      if (t.strides.size() != t.shape.size()) {
        return c.fail(tensor_field(i, "strides"),
                      std::to_string(t.strides.size()) + " strides for " +
                          std::to_string(t.shape.size()) + " dimensions");
      }
      for (std::size_t d = 0; d < t.strides.size(); ++d) {
        if (t.strides[d] < 0) {
          return c.fail(tensor_field(i, "strides"), "stride " + std::to_string(d) +
                                                        " is negative (" +
                                                        std::to_string(t.strides[d]) + ")");
        }
      }
    }
    if (row_major(t)) {
      if (t.nbytes != want) {
        return c.fail(
            tensor_field(i, "nbytes"),
            std::to_string(t.nbytes) + " but shape x itemsize is " + std::to_string(want));
      }
    } else {
      std::uint64_t span = 0;
      if (!tensor_span_bytes(t, span)) {
        return c.fail(tensor_field(i, "strides"), "reach overflows 64 bits");
      }
      if (span == 0 && t.nbytes != 0) {
        return c.fail(tensor_field(i, "nbytes"),
                      std::to_string(t.nbytes) + " for a tensor without elements");
      }
      if (span > t.nbytes) {
        return c.fail(
            tensor_field(i, "strides"),
            "reach " + std::to_string(span) + " bytes, outside nbytes " + std::to_string(t.nbytes));
      }
    }
    if (!valid_device(t.device)) {
      return c.fail(tensor_field(i, "device"),
                    "\"" + t.device + "\" is neither \"cpu\" nor \"cuda:N\"");
    }
    if (t.segment >= m.segments.size()) {
      return c.fail(tensor_field(i, "segment"),
                    std::to_string(t.segment) + " but the manifest has " +
                        std::to_string(m.segments.size()) + " segments");
    }
    if (t.offset % tensor_alignment != 0) {
      return c.fail(tensor_field(i, "offset"), std::to_string(t.offset) + " is not " +
                                                   std::to_string(tensor_alignment) +
                                                   "-byte aligned");
    }
    std::uint64_t end = 0;
    if (add_overflows(t.offset, t.nbytes, end) || end > m.segments[t.segment].nbytes) {
      return c.fail(tensor_field(i, "offset"),
                    "range [" + std::to_string(t.offset) + ", +" + std::to_string(t.nbytes) +
                        ") lies outside segment " + std::to_string(t.segment) + " of " +
                        std::to_string(m.segments[t.segment].nbytes) + " bytes");
    }
  }

  // Overlap: sort tensor ranges by (segment, offset) and compare neighbours.
  std::vector<std::size_t> order(m.tensors.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  auto before = [&](std::size_t a, std::size_t b) {
    const auto &x = m.tensors[a], &y = m.tensors[b];
    return x.segment != y.segment ? x.segment < y.segment : x.offset < y.offset;
  };
  // A packed manifest lists its tensors in place order already.
  if (!std::is_sorted(order.begin(), order.end(), before)) {
    std::sort(order.begin(), order.end(), before);
  }
  // Compare each range with the furthest end seen so far in its segment, so an empty tensor in
  // between cannot hide an overlap.
  std::uint64_t max_end = 0;
  std::size_t max_owner = order.empty() ? 0 : order[0];
  for (std::size_t k = 0; k < order.size(); ++k) {
    const auto& cur = m.tensors[order[k]];
    if (k > 0 && cur.segment != m.tensors[order[k - 1]].segment) max_end = 0;
    if (cur.nbytes == 0) continue;
    if (cur.offset < max_end) {
      return c.fail(tensor_field(order[k], "offset"),
                    "range overlaps tensor \"" + m.tensors[max_owner].name + "\" in segment " +
                        std::to_string(cur.segment));
    }
    if (cur.offset + cur.nbytes > max_end) max_end = cur.offset + cur.nbytes, max_owner = order[k];
  }
  return {};
}

}  // namespace wsync
