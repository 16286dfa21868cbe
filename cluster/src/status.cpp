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
  // via: the node leader a consumer reports through (docs/cluster.md, "Node leaders")
  out << "rank  node  role       state         active_version  via      received_from / reason\n";
  for (const auto& r : status["ranks"]) {
    const auto reason = r.value("reason", nlohmann::json());
    out << column(text(r["rank"]), 5) << column(text(r["node"]), 5) << column(text(r["role"]), 10)
        << column(text(r["state"]), 13) << column(text(r["active_weight_version"]), 15)
        << column(text(r.value("via", nlohmann::json())), 8) << text(r["received_from"])
        << (reason.is_null() ? "" : "  (" + text(reason) + ")") << "\n";
  }
  if (status.contains("updates") && !status["updates"].empty()) {
    out << "\nupdate                          phase       commit_s  ranks\n";
    for (const auto& u : status["updates"]) {
      std::string ranks;
      for (const auto& r : u["ranks"]) {
        ranks += text(r["rank"]) + ":" + text(r["state"]) + " ";
      }
      char commit[32];
      std::snprintf(commit, sizeof commit, "%.4f", u.value("commit_s", 0.0));
      out << column(text(u["key"]), 31) << column(text(u["phase"]), 11) << column(commit, 9)
          << ranks << "\n";
    }
  }
  return status.value("status", std::string()) == "pass" ? 0 : 1;
}

}  // namespace wsync
