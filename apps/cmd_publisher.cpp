// `wsync publisher`: a trainer rank, joined to a coordinator or standalone.

#include <iostream>
#include <memory>

#include "common.hpp"
#include "subcommand.hpp"
#include "wsync/cluster/standalone_publisher.hpp"
#include "wsync/sources/layouts.hpp"

namespace wsync::cli {
namespace {

struct publisher_state {
  publisher_options options;
  std::string coordinator;  // host:port, parsed into options.coordinator after the checks
  std::vector<std::string> transport_settings;
  bool standalone = false;
  std::string manifest_out;
};

// Options this run would not act on are refused, not ignored. Compared with their defaults, not
// counted, so that a configuration printed by --dump-config (every setting) loads again.
std::string misplaced_option(const publisher_state& s) {
  const publisher_state d;
  if (s.standalone && !s.coordinator.empty()) {
    return "--coordinator: a standalone publisher joins no coordinator (drop one of the two)";
  }
  if (s.standalone && s.options.outcome_timeout != d.options.outcome_timeout) {
    return "--outcome-timeout-ms: a standalone publisher waits for no outcome";
  }
  if (!s.standalone && !s.manifest_out.empty()) {
    return "--manifest-out: only --standalone writes manifests (a coordinator carries them)";
  }
  if (!s.options.safetensors.empty() && s.options.layout != d.options.layout) {
    return "--layout: not with --safetensors, whose file gives the tensors";
  }
  return {};
}

int publisher_start(publisher_state& s) {
  publisher_options& opt = s.options;
  if (opt.rank < 0 || opt.rank >= opt.ranks) {
    std::cerr << "wsync: --rank: must be in [0, --ranks)\n";
    return 2;
  }
  if (auto why = misplaced_option(s); !why.empty()) {
    std::cerr << "wsync: publisher: " << why << "\n";
    return 2;
  }
  if (s.standalone) {
    if (!transport_settings_from(s.transport_settings, opt.transport_settings)) return 2;
    // Flags the standalone publisher would not act on are refused, not ignored.
    if (opt.json) {
      std::cerr << "wsync: --json: a standalone publisher has no outcomes to print (no "
                   "coordinator collects answers); drop it\n";
      return 2;
    }
    if (opt.interval.count() > 0 && opt.transport != "file-mmap") {
      std::cerr << "wsync: --interval-ms: --standalone over shared memory publishes every "
                   "version at once and holds them; only --transport file-mmap paces versions\n";
      return 2;
    }
    if (s.manifest_out.empty() && opt.transport != "file-mmap") {
      std::cerr << "wsync: --standalone: needs --manifest-out FILE (or --transport file-mmap "
                   "--transport-option dir=DIR)\n";
      return 2;
    }
    return publisher_standalone_run(opt, s.manifest_out);
  }
  if (s.coordinator.empty()) {
    std::cerr << "wsync: publisher: --coordinator is required (or --standalone)\n";
    return 2;
  }
  if (!need_token(opt.coordinator.token)) return 2;
  if (!transport_settings_from(s.transport_settings, opt.transport_settings)) return 2;
  if (!coordinator_from(s.coordinator, opt.coordinator)) return 2;
  return publisher_run(opt);
}

// What to publish: a layout or a checkpoint file, and which versions.
void add_content_flags(CLI::App* pub, publisher_options& opt) {
  pub->add_option("--layout", opt.layout,
                  "model layout (" + join(layout_names()) + ") or synthetic:<bytes>:<tensors>")
      ->capture_default_str();
  pub->add_option("--safetensors", opt.safetensors,
                  "publish the tensors of this .safetensors file (mapped, zero-copy) instead of "
                  "a layout; every rank takes tensor i when i % ranks == rank")
      ->check(CLI::ExistingFile);
  pub->add_option("--model", opt.model_id,
                  "model id (default: the layout name, or \"safetensors\")");
  pub->add_option("--versions", opt.versions, "versions to publish")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 40))
      ->capture_default_str();
  pub->add_option("--first-version", opt.first_version, "weight_version of the first one")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 62))
      ->capture_default_str();
  add_milliseconds(pub, "--interval-ms", opt.interval, "pause between versions", 0);
  add_milliseconds(pub, "--outcome-timeout-ms", opt.outcome_timeout,
                   "how long a version's outcome may take before the publish fails; keep it "
                   "above twice the coordinator's --update-deadline-ms (assembly, then "
                   "distribution)",
                   1000);
  pub->add_flag("--json", opt.json, "print each outcome as one JSON line");
}

}  // namespace

subcommand add_publisher(CLI::App& app) {
  auto state = std::make_shared<publisher_state>();
  publisher_options& opt = state->options;
  auto* pub = app.add_subcommand(
      "publisher",
      "Run a publisher (trainer) rank: publish its shard of N versions of a model layout "
      "(or a safetensors checkpoint) over the chosen transport and wait for each outcome; "
      "with --standalone, publish with no coordinator.");
  pub->add_option("--coordinator", state->coordinator,
                  "coordinator host:port (not with --standalone)")
      ->envname("WSYNC_COORDINATOR");
  pub->add_flag("--standalone", state->standalone,
                "no coordinator. Over shared memory: publish the versions, write their "
                "manifests to --manifest-out and hold them until SIGINT/SIGTERM/SIGHUP (feeds an "
                "HTTP-driven consumer). With --transport file-mmap --transport-option dir=DIR: "
                "publish each version (--interval-ms apart) durably into DIR, where `wsync "
                "consumer --standalone --transport file-mmap` polls for it, then exit");
  pub->add_option("--manifest-out", state->manifest_out,
                  "with --standalone: file that gets one manifest JSON per line (optional with "
                  "file-mmap)");
  pub->add_option("--rank", opt.rank, "publisher rank (0..ranks-1); default $RANK or $SLURM_PROCID")
      ->envname("RANK")
      ->required();
  pub->add_option("--ranks", opt.ranks,
                  "publisher ranks sharing the model; default $WORLD_SIZE or $SLURM_NTASKS")
      ->envname("WORLD_SIZE")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  add_node(pub, opt.node, "node name shown in status");
  add_transport(pub, opt.transport, state->transport_settings);
  add_content_flags(pub, opt);
  add_token(pub, opt.coordinator.token);
  add_tls(pub, opt.coordinator.tls);
  return {pub, [state] {
            return publisher_start(*state);
          }};
}

}  // namespace wsync::cli
