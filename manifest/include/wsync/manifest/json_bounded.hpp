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

/// The parsed value, or a discarded one (is_discarded()) when `text` is not JSON or nests
/// deeper than json_max_depth. `too_deep` (when given) tells the second case. With
/// `duplicate_key`, a key that comes twice in one object (nlohmann keeps the last silently) is
/// refused too and named there, and `duplicate_depth` (when given) says in which object: 1 for
/// the top-level one, 2 for an object inside it, and so on.
inline nlohmann::json json_parse_bounded(std::string_view text, bool* too_deep = nullptr,
                                         std::string* duplicate_key = nullptr,
                                         std::size_t* duplicate_depth = nullptr) {
  // The callback's depth counts from 0 at the outermost value; this count, from 1.
  if (json_nests_deeper(text, json_max_depth + 1)) {
    if (too_deep) *too_deep = true;
    if (duplicate_key) duplicate_key->clear();
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
  bool deep = false;
  std::vector<std::set<std::string>> keys;  // of each object being parsed, innermost last
  std::string twice;
  auto j = nlohmann::json::parse(
      text.begin(), text.end(),
      [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        if (depth > json_max_depth) deep = true;
        if (!duplicate_key || deep) return true;
        using event_t = nlohmann::json::parse_event_t;
        if (event == event_t::object_start) {
          keys.emplace_back();
        } else if (event == event_t::object_end && !keys.empty()) {
          keys.pop_back();
        } else if (event == event_t::key && !keys.empty() && twice.empty() &&
                   !keys.back().insert(parsed.get<std::string>()).second) {
          twice = parsed.get<std::string>();
          if (duplicate_depth) *duplicate_depth = keys.size();
        }
        return true;
      },
      /*allow_exceptions=*/false);
  if (too_deep) *too_deep = deep;
  if (duplicate_key) *duplicate_key = deep ? std::string() : twice;
  if (deep || !twice.empty()) return nlohmann::json(nlohmann::json::value_t::discarded);
  return j;
}

}  // namespace wsync
