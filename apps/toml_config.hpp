#pragma once
// CLI11 reads `--config` files through this: the file is parsed by toml++ (real TOML, so a
// syntax error is reported with its line and column instead of being read as a value), then
// handed to CLI11 as the items of one [section] per subcommand, where the option table checks
// every key and value exactly as it checks the flags.

#include <CLI/CLI.hpp>

namespace wsync {

class toml_config : public CLI::ConfigTOML {
 public:
  /// Throws CLI::ConfigError naming the line and column of a syntax error, or the key whose
  /// value wsync cannot take (nested tables, tables inside arrays, dates).
  std::vector<CLI::ConfigItem> from_config(std::istream& input) const override;
};

}  // namespace wsync
