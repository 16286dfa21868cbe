#include "toml_config.hpp"

#include <toml++/toml.h>

namespace wsync {
namespace {

// One TOML value as CLI11 inputs (an array gives one input per element).
std::vector<std::string> inputs_of(const toml::node& node, const std::string& key) {
  std::vector<std::string> out;
  auto scalar = [&](const toml::node& n) {
    if (auto s = n.as_string()) return out.push_back(s->get());
    if (auto i = n.as_integer()) return out.push_back(std::to_string(i->get()));
    if (auto b = n.as_boolean()) return out.push_back(b->get() ? "true" : "false");
    // No wsync setting takes a fraction: 7.0 for 7 is a slip to name, and a float printed back
    // (1234567.0 as 1.23457e+06) would not be the value written.
    if (n.is_floating_point()) {
      throw CLI::ConfigError("config: " + key +
                             ": a floating-point number; every wsync setting is an integer, a "
                             "string or a boolean");
    }
    throw CLI::ConfigError("config: " + key +
                           ": only strings, integers, booleans and arrays of them are settings");
  };
  if (auto array = node.as_array()) {
    for (const auto& element : *array) scalar(element);
  } else {
    scalar(node);
  }
  return out;
}

// CLI11 reads the item names "++" and "--" as "open" and "close a section": TOML allows them as
// bare keys, so a key made only of those marks is refused rather than taken for one.
void check_key(const std::string& key, const std::string& where) {
  if (key == "++" || key == "--") {
    throw CLI::ConfigError("config: " + where + ": not a setting name");
  }
}

}  // namespace

std::vector<CLI::ConfigItem> toml_config::from_config(std::istream& input) const {
  toml::table root;
  try {
    root = toml::parse(input);
  } catch (const toml::parse_error& e) {
    const auto& where = e.source().begin;
    throw CLI::ConfigError("config: line " + std::to_string(where.line) + ", column " +
                           std::to_string(where.column) + ": " + std::string(e.description()));
  }
  std::vector<CLI::ConfigItem> out;
  for (const auto& [key, node] : root) {
    std::string name(key.str());
    check_key(name, name);
    if (const auto* section = node.as_table()) {
      // A [section] is a subcommand: CLI11 expects it opened ("++") and closed ("--").
      out.push_back({{name}, "++", {}});
      for (const auto& [inner_key, value] : *section) {
        std::string inner(inner_key.str());
        check_key(inner, name + "." + inner);
        if (value.is_table()) {
          throw CLI::ConfigError("config: " + name + "." + inner +
                                 ": nested tables are not settings (one [section] per subcommand)");
        }
        out.push_back({{name}, inner, inputs_of(value, name + "." + inner)});
      }
      out.push_back({{name}, "--", {}});
    } else {
      out.push_back({{}, name, inputs_of(node, name)});
    }
  }
  return out;
}

}  // namespace wsync
