#pragma once
// JSON from another process or the network (manifests, handles, HTTP bodies, safetensors
// headers, file-mmap state files): nlohmann parses any depth without recursing, but dump(),
// copies and comparisons recurse once per nesting level, so a value nested a million deep
// (2 MB of brackets) would overflow the stack when an error message quotes it. Such input is
// refused at the parse. Include only in .cpp files (nlohmann is heavy).

#include <nlohmann/json.hpp>
#include <string_view>

namespace wsync {

/// Deeper than this is refused: wsync's own documents nest five levels at most.
inline constexpr int json_max_depth = 64;

/// The parsed value, or a discarded one (is_discarded()) when `text` is not JSON or nests
/// deeper than json_max_depth. `too_deep` (when given) tells the second case.
inline nlohmann::json json_parse_bounded(std::string_view text, bool* too_deep = nullptr) {
  bool deep = false;
  auto j = nlohmann::json::parse(
      text.begin(), text.end(),
      [&deep](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > json_max_depth) deep = true;
        return true;
      },
      /*allow_exceptions=*/false);
  if (too_deep) *too_deep = deep;
  if (deep) return nlohmann::json(nlohmann::json::value_t::discarded);
  return j;
}

}  // namespace wsync
