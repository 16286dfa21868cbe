#pragma once
// The subcommands of `wsync`, one file each (cmd_*.cpp). Each binds its flags straight into its
// module's option struct, so a default is written once, in the struct; main() adds them all,
// parses, and runs the one the command line chose.

#include <CLI/CLI.hpp>

#include <functional>

namespace wsync::cli {

/// A subcommand added to the app. `run` owns the options `command`'s flags were bound to; call
/// it once, after a successful parse chose `command`. It returns the process exit code.
struct subcommand {
  CLI::App* command = nullptr;
  std::function<int()> run;
};

subcommand add_bench(CLI::App& app);
subcommand add_certs(CLI::App& app);
subcommand add_coordinator(CLI::App& app);
subcommand add_consumer(CLI::App& app);
subcommand add_publisher(CLI::App& app);
subcommand add_status(CLI::App& app);
subcommand add_demo(CLI::App& app);

}  // namespace wsync::cli
