// `wsync publisher --standalone`: a trainer rank with no coordinator and no CAF. It publishes its
// versions into shared memory, writes their manifests for an HTTP-driven consumer to import, and
// holds them until it is told to stop.

#include "wsync/cluster/standalone_publisher.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "wsync/actors/stop_signals.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {

int publisher_standalone_run(const publisher_options& o, const std::string& manifest_out) {
  block_stop_signals();
  // The manifests go to consumers that map the publisher's memory on this host: a transport
  // flag asking for anything else would be ignored, so refuse it instead.
  if (o.transport != "shared-memory" || !o.transport_settings.empty()) {
    return log_error("publisher rank " + std::to_string(o.rank) +
                     ": --standalone publishes over shared memory only; drop --transport " +
                     o.transport + " and its --transport-option settings"),
           2;
  }
  auto shard = shard_load(publisher_shard(o));
  if (!shard) return log_error(shard.error().message), 1;
  auto slots = std::to_string(std::max<std::uint64_t>(2, std::min<std::uint64_t>(o.versions, 64)));
  auto t = make_transport("shared-memory", {{"slots", slots}});
  if (!t) return log_error(t.error().message), 1;
  auto pt = (*t)->make_publisher();
  if (!pt) return log_error(pt.error().message), 1;
  publisher_config cfg;
  cfg.model_id = publisher_model_id(o);
  cfg.source_rank = o.rank;
  cfg.release_when_answered = false;  // held until this process stops
  weight_publisher publisher(std::move(*pt), "shared-memory", cfg);
  std::string tmp = manifest_out + ".tmp";
  {
    std::ofstream out(tmp);
    for (std::uint64_t v = o.first_version; v < o.first_version + o.versions; ++v) {
      auto m = publisher.publish(shard->tensors, v, {}, {{"rank", std::to_string(o.rank)}});
      if (!m) return log_error(m.error().message), 1;
      out << manifest_to_json(*m) << "\n";
    }
    if (!out) return log_error("publisher: cannot write " + manifest_out), 1;
  }
  std::rename(tmp.c_str(), manifest_out.c_str());
  log_info("publisher rank " + std::to_string(o.rank) + ": " + std::to_string(o.versions) +
           " version(s) in shared memory, manifests in " + manifest_out +
           "; holding them until SIGINT/SIGTERM");
  wait_for_signal();
  for (const auto& id : publisher.held_updates()) (void)publisher.release(id);
  return 0;
}

}  // namespace wsync
