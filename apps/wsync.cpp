// The `wsync` executable: thin subcommands over the libraries. Each subcommand lives in its own
// cmd_*.cpp; this file builds the app, parses, and runs the one chosen.

#include <sys/resource.h>

#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "common.hpp"
#include "subcommand.hpp"
#include "toml_config.hpp"
#include "wsync/transports/registry.hpp"

namespace {

// Descriptors: a coordinator holds one connection per consumer process and publisher, a consumer
// process of 1,024 ranks one mapping descriptor per slot and a socket per peer request. The soft
// limit (often 1,024) is raised to the hard one, as servers do; the hard limit is the operator's.
void raise_descriptor_limit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &lim);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace wsync::cli;
  CLI::App app{
      "wsync moves versioned model-weight updates from trainer ranks to rollout ranks.\n"
      "Transports: " +
      join(wsync::builtin_transports().names())};
  app.set_version_flag("--version", "wsync 0.1.0");
  app.require_subcommand(1);
  // Settings come from defaults < WSYNC_* / launcher environment variables < the --config TOML
  // file < command-line flags (CLI11's order). The file is strict: a key no option knows is an
  // error that names it, and every value goes through the same checks as its flag. Set before the
  // subcommands are added: they inherit it.
  app.set_config("--config", "",
                 "TOML file of settings, one [section] per subcommand (see configs/); flags "
                 "override it");
  app.config_formatter(std::make_shared<wsync::toml_config>());  // toml++ parses the file
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.fallthrough();
  bool dump_config = false;
  app.add_flag("--dump-config", dump_config,
               "print the subcommand's effective configuration (file, environment and flags "
               "merged) as TOML and exit")
      ->configurable(false);
  // In --help order: a braced list runs its calls left to right.
  const std::vector<subcommand> subcommands = {
      add_bench(app),  add_coordinator(app), add_consumer(app), add_publisher(app),
      add_status(app), add_demo(app),        add_certs(app)};

  launcher_environment();
  raise_descriptor_limit();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ConfigError& e) {
    // CLI11 words an unknown key in INI terms; say what it is in ours.
    std::string what = e.what();
    const std::string ini = "INI was not able to parse ";
    if (what.rfind(ini, 0) == 0) {
      auto key = what.substr(ini.size());
      // CLI11 names a section no subcommand has "<section>.++".
      if (key.size() > 3 && key.compare(key.size() - 3, 3, ".++") == 0) {
        what = "config: unknown section [" + key.substr(0, key.size() - 3) + "]";
      } else {
        what = "config: unknown setting " + key;
      }
    }
    std::cerr << what << "\nRun with --help for more information.\n";
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (dump_config) {
    // Only the chosen subcommand's section; the token is never written (it is not configurable
    // from files either: it belongs in the environment).
    // An option left empty is written commented out: read back, "" would be a value (a file
    // path that must exist, say), so the dump could not be loaded as it is.
    for (const auto* sub : app.get_subcommands()) {
      std::cout << "[" << sub->get_name() << "]\n";
      std::istringstream lines(sub->config_to_str(true, true));
      for (std::string line; std::getline(lines, line);) {
        const bool empty = line.size() > 3 && line.compare(line.size() - 3, 3, "=\"\"") == 0 &&
                           line.front() != '#';
        // A secret the file may hold is still not printed: a dump gets pasted into issues.
        if (line.rfind("http-token=", 0) == 0 && !empty) {
          std::cout << "# http-token is set; not written (give it in WSYNC_HTTP_TOKEN)\n";
          continue;
        }
        std::cout << (empty ? "# " : "") << line << "\n";
      }
    }
    return 0;
  }
  for (const auto& sub : subcommands) {
    if (sub.command->parsed()) return sub.run();
  }
  return 0;
}
