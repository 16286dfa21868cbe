#include "wsync/cluster/status.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace wsync {

namespace {

// `text` left-aligned in `width` columns, and one space after (never cut: a long value pushes
// the rest of the row right rather than losing characters).
std::string column(const std::string& text, std::size_t width) {
  return text + std::string(text.size() < width ? width - text.size() : 0, ' ') + " ";
}

}  // namespace

int status_print(const std::string& status_json, std::ostream& out) {
  auto status = nlohmann::json::parse(status_json, nullptr, false);
  if (!status.is_object()) {
    out << "status: not a status object\n";
    return 1;
  }
  auto text = [](const nlohmann::json& v) {
    return v.is_null() ? std::string("-") : v.is_string() ? v.get<std::string>() : v.dump();
  };
  // A field of an entry, null where the entry lacks it or is no object (a coordinator of
  // another build may write less): printed as "-", never read past.
  auto at = [](const nlohmann::json& j, const char* key) {
    return j.is_object() ? j.value(key, nlohmann::json()) : nlohmann::json();
  };
  auto list = [&](const nlohmann::json& j, const char* key) {
    auto v = at(j, key);
    return v.is_array() ? v : nlohmann::json::array();
  };
  // via: the node leader a consumer reports through (docs/cluster.md, "Node leaders")
  out << "rank  node  role       state         active_version  via      received_from / reason\n";
  for (const auto& r : list(status, "ranks")) {
    const auto reason = at(r, "reason");
    out << column(text(at(r, "rank")), 5) << column(text(at(r, "node")), 5)
        << column(text(at(r, "role")), 10) << column(text(at(r, "state")), 13)
        << column(text(at(r, "active_weight_version")), 15) << column(text(at(r, "via")), 8)
        << text(at(r, "received_from")) << (reason.is_null() ? "" : "  (" + text(reason) + ")")
        << "\n";
  }
  const auto updates = list(status, "updates");
  if (!updates.empty()) {
    out << "\nupdate                          phase       commit_s  ranks\n";
    for (const auto& u : updates) {
      std::string ranks;
      for (const auto& r : list(u, "ranks")) {
        ranks += text(at(r, "rank")) + ":" + text(at(r, "state")) + " ";
      }
      const auto seconds = at(u, "commit_s");
      char commit[32];
      std::snprintf(commit, sizeof commit, "%.4f",
                    seconds.is_number() ? seconds.get<double>() : 0.0);
      out << column(text(at(u, "key")), 31) << column(text(at(u, "phase")), 11) << column(commit, 9)
          << ranks << "\n";
    }
  }
  return at(status, "status") == "pass" ? 0 : 1;
}

}  // namespace wsync
