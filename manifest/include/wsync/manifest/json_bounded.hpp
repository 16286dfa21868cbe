#pragma once
// JSON from another process or the network (manifests, handles, HTTP bodies, safetensors
// headers, file-mmap state files): nlohmann parses any depth without recursing, but dump(),
// copies and comparisons recurse once per nesting level, so a value nested a million deep
// (2 MB of brackets) would overflow the stack when an error message quotes it. Such input is
// refused at the parse. Include only in .cpp files (nlohmann is heavy).

#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace wsync {

/// Deeper than this is refused: wsync's own documents nest five levels at most.
inline constexpr int json_max_depth = 64;

/// Whether `text` opens more than `limit` arrays and objects inside one another, brackets in
/// strings aside. Linear and allocation-free: nlohmann builds every level before its callback
/// can refuse one, ~64 bytes of heap per bracket (gigabytes for a large body of '[').
inline bool json_nests_deeper(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) return true;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return false;
}

namespace json_bounded_detail {

// nlohmann's DOM builder behind a SAX reader that also watches for a key given twice. Not
// parse()'s callback form: its end of every object searches the enclosing container for a
// discarded value, which made parsing quadratic (80,000 objects in one array: 7 s here).
class sax {
 public:
  using json = nlohmann::json;
  sax(json& root, bool watch_keys) : dom_(root, false), watch_(watch_keys) {}
  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& s) {
    return dom_.number_float(v, s);
  }
  bool string(json::string_t& v) { return dom_.string(v); }
  bool binary(json::binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) {
    if (watch_) keys_.emplace_back();
    return dom_.start_object(n);
  }
  bool key(json::string_t& k) {
    if (watch_ && twice_.empty() && !keys_.back().insert(k).second) {
      twice_ = k;
      twice_depth_ = keys_.size();
    }
    return dom_.key(k);
  }
  bool end_object() {
    if (watch_) keys_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) { return dom_.start_array(n); }
  bool end_array() { return dom_.end_array(); }
  template <class Exception>
  bool parse_error(std::size_t at, const std::string& token, const Exception& e) {
    return dom_.parse_error(at, token, e);
  }
  bool errored() const { return dom_.is_errored(); }
  const std::string& twice() const { return twice_; }
  std::size_t twice_depth() const { return twice_depth_; }

 private:
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  bool watch_;
  std::vector<std::set<std::string>> keys_;  // of each object being parsed, innermost last
  std::string twice_;
  std::size_t twice_depth_ = 0;
};

}  // namespace json_bounded_detail

/// The parsed value, or a discarded one (is_discarded()) when `text` is not JSON or nests
/// deeper than json_max_depth. `too_deep` (when given) tells the second case. With
/// `duplicate_key`, a key that comes twice in one object (nlohmann keeps the last silently) is
/// refused too and named there, and `duplicate_depth` (when given) says in which object: 1 for
/// the top-level one, 2 for an object inside it, and so on.
inline nlohmann::json json_parse_bounded(std::string_view text, bool* too_deep = nullptr,
                                         std::string* duplicate_key = nullptr,
                                         std::size_t* duplicate_depth = nullptr) {
  const auto discarded = nlohmann::json(nlohmann::json::value_t::discarded);
  if (duplicate_key) duplicate_key->clear();
  // Counted from 1 at the outermost value: 65 levels are the outermost and 64 within it.
  const bool deep = json_nests_deeper(text, json_max_depth + 1);
  if (too_deep) *too_deep = deep;
  if (deep) return discarded;
  nlohmann::json j;
  json_bounded_detail::sax reader(j, duplicate_key != nullptr);
  try {
    if (!nlohmann::json::sax_parse(text.begin(), text.end(), &reader) || reader.errored()) {
      return discarded;
    }
  } catch (const nlohmann::json::exception&) {
    return discarded;
  }
  if (!reader.twice().empty()) {
    if (duplicate_key) *duplicate_key = reader.twice();
    if (duplicate_depth) *duplicate_depth = reader.twice_depth();
    return discarded;
  }
  return j;
}

}  // namespace wsync
