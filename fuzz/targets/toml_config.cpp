// Fuzz target: a `--config` file (TOML). toml_config turns it into CLI11's items, then an app
// shaped like wsync's (top-level settings, one [section] per subcommand, typed options) checks
// them. The only exceptions allowed out are CLI11's, which wsync reports as usage errors
// (exit 2); anything else would end the program.

#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "toml_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(wsync::fuzz::text(data, size));
  wsync::toml_config config;
  try {
    std::istringstream in(text);
    auto items = config.from_config(in);
    int depth = 0;
    for (const auto& item : items) {
      if (item.name == "++") ++depth;
      if (item.name == "--") --depth;
      wsync::fuzz::expect(depth == 0 || depth == 1, "sections open and close in pairs");
    }
    wsync::fuzz::expect(depth == 0, "every section is closed");
  } catch (const CLI::Error&) {
  }

  CLI::App app("fuzz");
  app.config_formatter(std::make_shared<wsync::toml_config>());
  std::string log = "info";
  app.add_option("--log", log);
  auto* consumer = app.add_subcommand("consumer");
  std::string coordinator, transport;
  std::vector<int> ranks;
  double timeout = 0;
  std::uint64_t slots = 0;
  bool verify = true;
  consumer->add_option("--coordinator", coordinator);
  consumer->add_option("--transport", transport);
  consumer->add_option("--ranks", ranks);
  consumer->add_option("--timeout", timeout)->check(CLI::PositiveNumber);
  consumer->add_option("--slots", slots)->check(CLI::Range(1, 64));
  consumer->add_flag("--verify,!--no-verify", verify);
  app.allow_config_extras(CLI::config_extras_mode::error);
  try {
    std::istringstream in(text);
    app.parse_from_stream(in);
  } catch (const CLI::Error&) {
  }
  return 0;
}
