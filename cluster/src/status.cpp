#include "wsync/cluster/status.hpp"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace wsync {

int status_print(const std::string& status_json, std::ostream& out) {
  auto status = nlohmann::json::parse(status_json, nullptr, false);
  if (!status.is_object()) {
    out << "status: not a status object\n";
    return 1;
  }
  auto text = [](const nlohmann::json& v) {
    return v.is_null() ? std::string("-") : v.is_string() ? v.get<std::string>() : v.dump();
  };
  char line[512];
  // via: the node leader a consumer reports through (docs/cluster.md, "Node leaders")
  out << "rank  node  role       state         active_version  via      received_from\n";
  for (const auto& r : status["ranks"]) {
    std::snprintf(line, sizeof line, "%-5s %-5s %-10s %-13s %-15s %-8s %s\n",
                  text(r["rank"]).c_str(), text(r["node"]).c_str(), text(r["role"]).c_str(),
                  text(r["state"]).c_str(), text(r["active_weight_version"]).c_str(),
                  text(r.value("via", nlohmann::json())).c_str(), text(r["received_from"]).c_str());
    out << line;
  }
  if (status.contains("updates") && !status["updates"].empty()) {
    out << "\nupdate                          phase       commit_s  ranks\n";
    for (const auto& u : status["updates"]) {
      std::string ranks;
      for (const auto& r : u["ranks"]) {
        ranks += text(r["rank"]) + ":" + text(r["state"]) + " ";
      }
      std::snprintf(line, sizeof line, "%-31s %-11s %-9.4f %s\n", text(u["key"]).c_str(),
                    text(u["phase"]).c_str(), u.value("commit_s", 0.0), ranks.c_str());
      out << line;
    }
  }
  return status.value("status", std::string()) == "pass" ? 0 : 1;
}

}  // namespace wsync
