// The `wsync` executable: thin subcommands over the libraries.

#include <CLI/CLI.hpp>

#include <iostream>

#include "wsync/bench/bench.hpp"
#include "wsync/bench/layouts.hpp"
#include "wsync/transports/registry.hpp"

namespace {

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

void add_bench(CLI::App& app, wsync::bench_options& opt, std::string& verify) {
  auto* bench = app.add_subcommand(
      "bench",
      "Time one weight update end to end (publish, import, verify, install, ack, release) and "
      "print JSON rows: one per timed update, the result row last. Baselines (single-thread "
      "memcpy into pre-faulted memory, single-thread xxh3) are measured in the same run.");
  bench
      ->add_option("--mode", opt.mode,
                   "local: publisher and consumer in one process over local-clone; "
                   "shared-memory: the consumer is a separate process importing zero-copy")
      ->check(CLI::IsMember({"local", "shared-memory"}))
      ->capture_default_str();
  bench->add_flag("--smoke", opt.smoke,
                  "quick run for tests: 8 MiB in 16 tensors (unless --layout/--bytes), at most "
                  "3 repeats");
  auto* layout = bench->add_option(
      "--layout", opt.layout,
      "model whose checkpoint layout (tensor names, shapes, bf16) to publish, with random "
      "contents: " +
          join(wsync::layout_names()) + " (default qwen2.5-0.5b)");
  auto* bytes = bench->add_option("--bytes", opt.bytes,
                                  "publish a synthetic update of this many bytes instead of a "
                                  "model layout");
  bench->add_option("--tensors", opt.tensors, "number of tensors of the synthetic update")
      ->needs(bytes);
  layout->excludes(bytes);
  bench->add_option("--repeat", opt.repeat, "timed updates; timings are their medians")
      ->check(CLI::Range(1u, 1000u))
      ->capture_default_str();
  bench->add_option("--verify", verify, "recompute every tensor checksum on import")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  bench
      ->add_option("--copy-threads", opt.copy_threads,
                   "threads that copy and checksum tensors into the segments")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  bench
      ->add_option("--slots", opt.slots,
                   "shared-memory ring size (at least 2: the active version and the incoming one)")
      ->check(CLI::Range(2u, 64u))
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "wsync moves versioned model-weight updates from trainer ranks to rollout ranks.\n"
      "Transports: " +
      join(wsync::builtin_transports().names())};
  app.set_version_flag("--version", "wsync 0.1.0");
  app.require_subcommand(1);
  wsync::bench_options bench_opt;
  std::string verify = "on";
  add_bench(app, bench_opt, verify);
  CLI11_PARSE(app, argc, argv);

  if (app.got_subcommand("bench")) {
    bench_opt.verify = verify == "on";
    return wsync::bench_run(bench_opt, std::cout);
  }
  return 0;
}
