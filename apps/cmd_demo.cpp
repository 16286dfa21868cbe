// `wsync demo`: a whole cluster as local processes.

#include <iostream>
#include <memory>

#include "subcommand.hpp"
#include "wsync/cluster/demo.hpp"

namespace wsync::cli {

subcommand add_demo(CLI::App& app) {
  auto opt = std::make_shared<demo_options>();
  auto* demo = app.add_subcommand(
      "demo",
      "Local cluster demo: a coordinator, publisher ranks and consumer ranks as "
      "separate processes on loopback, versions over shared memory, then the per-rank "
      "table.");
  demo->add_option("--publishers", opt->publishers, "publisher ranks")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  demo->add_option("--consumers", opt->consumers, "consumer ranks")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  demo->add_option("--versions", opt->versions, "versions to publish")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  demo->add_option("--layout", opt->layout, "model layout or synthetic:<bytes>:<tensors>")
      ->capture_default_str();
  demo->add_flag("--json", opt->json,
                 "end with the status object (JSON: every rank's state and version, see "
                 "docs/cluster.md)");
  return {demo, [opt] {
            return demo_run(*opt, std::cout);
          }};
}

}  // namespace wsync::cli
