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

/// Whether `text` holds anything (a value, a key, a container) inside `limit` arrays and objects
/// nested in one another: the parse callback's old rule, under which an empty container at that
/// depth passed and nothing inside it did. Brackets in strings do not count. Linear and
/// allocation-free: nlohmann builds every level before a callback could refuse one, ~64 bytes
/// of heap per bracket (gigabytes for a large body of '[').
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
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') continue;
    if (c == ']' || c == '}') {
      if (--depth < 0) return false;  // not JSON: the parser says so
      continue;
    }
    if (depth >= limit) return true;
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      ++depth;
    }
  }
  return false;
}

namespace json_bounded_detail {

// A DOM builder read by SAX that also watches for a key given twice. Not parse()'s callback
// form: its end of every object searches the enclosing container for a discarded value, which
// made parsing quadratic (80,000 objects in one array: 7 s here). Not nlohmann's own SAX DOM
// builder either: that one is internal (detail::), and its template changed in 3.12.
class sax {
 public:
  using json = nlohmann::json;
  sax(json& root, bool watch_keys) : root_(root), watch_(watch_keys) {}
  bool null() { return put(nullptr); }
  bool boolean(bool v) { return put(v); }
  bool number_integer(json::number_integer_t v) { return put(v); }
  bool number_unsigned(json::number_unsigned_t v) { return put(v); }
  bool number_float(json::number_float_t v, const json::string_t&) { return put(v); }
  bool string(json::string_t& v) { return put(std::move(v)); }
  bool binary(json::binary_t& v) { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) {
    if (watch_) keys_.emplace_back();
    return open(json::object());
  }
  bool key(json::string_t& k) {
    if (watch_ && !found_twice_ && !keys_.back().insert(k).second) {
      found_twice_ = true;
      twice_ = k;
      twice_depth_ = keys_.size();
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() {
    if (watch_) keys_.pop_back();
    open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) { return open(json::array()); }
  bool end_array() {
    open_.pop_back();
    return true;
  }
  template <class Exception>
  bool parse_error(std::size_t, const std::string&, const Exception&) {
    errored_ = true;
    return false;
  }
  bool errored() const { return errored_; }
  bool found_twice() const { return found_twice_; }
  const std::string& twice() const { return twice_; }
  std::size_t twice_depth() const { return twice_depth_; }

 private:
  // Where the next value goes: the root, the end of the innermost array, or the innermost
  // object at the last key (a key given twice keeps the last value, as nlohmann's parse does).
  json* place(json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& in = *open_.back();
    if (in.is_array()) {
      in.push_back(std::move(v));
      return &in.back();
    }
    json& slot = in[key_];
    slot = std::move(v);
    return &slot;
  }
  bool put(json v) {
    place(std::move(v));
    return true;
  }
  bool open(json v) {
    open_.push_back(place(std::move(v)));
    return true;
  }

  json& root_;
  bool watch_;
  std::vector<json*> open_;  // the containers being filled, innermost last
  std::string key_;
  std::vector<std::set<std::string>> keys_;  // of each object being parsed, innermost last
  bool errored_ = false, found_twice_ = false;
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
  // Anything inside 65 containers: the outermost value counts 0, so deeper than 64.
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
  if (reader.found_twice()) {
    if (duplicate_key) *duplicate_key = reader.twice();
    if (duplicate_depth) *duplicate_depth = reader.twice_depth();
    return discarded;
  }
  return j;
}

}  // namespace wsync
