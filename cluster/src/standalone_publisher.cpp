// `wsync publisher --standalone`: a trainer rank with no coordinator and no CAF. Over shared
// memory it publishes its versions, writes their manifests for an HTTP-driven consumer to import,
// and holds them until it is told to stop. Over file-mmap it publishes them into a directory
// that polling consumers follow, and leaves.

#include "wsync/cluster/standalone_publisher.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "wsync/actors/stop_signals.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/registry.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {
namespace {

// file-mmap: nothing to hold after publishing. Each version is durable in DIR once publish()
// returns, and consumers that poll DIR/CURRENT pull it; the process leaves after the last one.
int publish_into_directory(const publisher_options& o, const std::string& manifest_out) {
  std::string who = "publisher rank " + std::to_string(o.rank);
  // The transport checks its options (a missing dir is named there) before any tensor loads.
  auto t = make_transport("file-mmap", o.transport_settings);
  if (!t) return log_error(who + ": " + t.error().message), 2;
  const std::string& dir = o.transport_settings.at("dir");
  auto shard = shard_load(publisher_shard(o));
  if (!shard) return log_error(shard.error().message), 1;
  auto pt = (*t)->make_publisher();
  if (!pt) return log_error(who + ": " + pt.error().message), 1;
  publisher_config cfg;
  cfg.model_id = publisher_model_id(o);
  cfg.source_rank = o.rank;
  weight_publisher publisher(std::move(*pt), "file-mmap", cfg);
  std::ofstream out;
  if (!manifest_out.empty()) {
    out.open(manifest_out);
    if (!out) {
      return log_error(who + ": --manifest-out " + manifest_out + ": " + std::strerror(errno)), 2;
    }
  }
  for (std::uint64_t v = o.first_version; v < o.first_version + o.versions; ++v) {
    // Looked at before every version, with no interval too: signals are blocked here, so this
    // is the only way a stop ends the run.
    if (v != o.first_version && stop_requested_within(o.interval)) break;
    // No expected consumer: the buffer is free for this process at once; CURRENT and the
    // readers' leases are what keep it from being overwritten.
    if (auto same = shard_unchanged(*shard, o.rank, v, false); !same) {
      return log_error(same.error().message), 1;
    }
    auto m = publisher.publish(shard->tensors, v, {}, {{"rank", std::to_string(o.rank)}});
    if (!m) return log_error(m.error().message), 1;
    if (auto same = shard_unchanged(*shard, o.rank, v, true); !same) {
      return log_error(same.error().message), 1;
    }
    log_info(who + ": published weight_version " + std::to_string(v) + " into " + dir + " (" +
             m->transport_handle + ", " + std::to_string(m->total_bytes) + " bytes)");
    if (out.is_open()) out << manifest_to_json(*m) << "\n" << std::flush;
  }
  log_info(who + ": done; " + dir + "/CURRENT names weight_version " +
           std::to_string(publisher.last_version()));
  return 0;
}

}  // namespace

int publisher_standalone_run(const publisher_options& o, const std::string& manifest_out) {
  block_stop_signals();
  if (o.transport == "file-mmap") return publish_into_directory(o, manifest_out);
  // The manifests go to consumers that map the publisher's memory on this host: a transport
  // flag asking for anything else would be ignored, so refuse it instead.
  if (o.transport != "shared-memory" || !o.transport_settings.empty()) {
    return log_error("publisher rank " + std::to_string(o.rank) +
                     ": --standalone publishes over shared memory or file-mmap only; drop "
                     "--transport " +
                     o.transport + " and its --transport-option settings"),
           2;
  }
  // Every version stays published until this process stops, one shared-memory slot each.
  if (o.versions > 64) {
    return log_error("publisher rank " + std::to_string(o.rank) + ": --versions " +
                     std::to_string(o.versions) +
                     ": --standalone over shared memory holds every version in its own slot, "
                     "at most 64"),
           2;
  }
  auto shard = shard_load(publisher_shard(o));
  if (!shard) return log_error(shard.error().message), 1;
  auto slots = std::to_string(std::max<std::uint64_t>(2, o.versions));
  auto t = make_transport("shared-memory", {{"slots", slots}});
  if (!t) return log_error(t.error().message), 1;
  auto pt = (*t)->make_publisher();
  if (!pt) return log_error(pt.error().message), 1;
  publisher_config cfg;
  cfg.model_id = publisher_model_id(o);
  cfg.source_rank = o.rank;
  cfg.release_when_answered = false;  // held until this process stops
  weight_publisher publisher(std::move(*pt), "shared-memory", cfg);
  // The manifests appear whole or not at all: written aside, renamed into place.
  const std::string tmp = manifest_out + ".tmp";
  auto give_up = [&](const std::string& why) {  // ~weight_publisher frees what it published
    std::remove(tmp.c_str());
    log_error(why);
    return 1;
  };
  {
    std::ofstream out(tmp);
    if (!out) return give_up("publisher: cannot write " + tmp + ": " + std::strerror(errno));
    for (std::uint64_t v = o.first_version; v < o.first_version + o.versions; ++v) {
      if (auto same = shard_unchanged(*shard, o.rank, v, false); !same) {
        return give_up(same.error().message);
      }
      auto m = publisher.publish(shard->tensors, v, {}, {{"rank", std::to_string(o.rank)}});
      if (!m) return give_up(m.error().message);
      if (auto same = shard_unchanged(*shard, o.rank, v, true); !same) {
        return give_up(same.error().message);
      }
      out << manifest_to_json(*m) << "\n";
    }
    out.flush();
    if (!out) return give_up("publisher: cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), manifest_out.c_str()) != 0) {
    return give_up("publisher: cannot rename " + tmp + " to " + manifest_out + ": " +
                   std::strerror(errno));
  }
  log_info("publisher rank " + std::to_string(o.rank) + ": " + std::to_string(o.versions) +
           " version(s) in shared memory, manifests in " + manifest_out +
           "; holding them until SIGINT/SIGTERM/SIGHUP");
  wait_for_signal();
  for (const auto& id : publisher.held_updates()) (void)publisher.release(id);
  return 0;
}

}  // namespace wsync
