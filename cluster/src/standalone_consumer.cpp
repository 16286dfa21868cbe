// `wsync consumer --standalone --transport file-mmap`: TorchRL's pull model. The publisher
// only writes files; this rank notices a new CURRENT and installs it, with the same lifecycle
// (import, verify, install, acknowledge, release the previous version) as a coordinated rank.

#include "wsync/cluster/standalone_consumer.hpp"

#include "wsync/actors/stop_signals.hpp"
#include "wsync/manifest/log.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/file_mmap.hpp"
#include "wsync/transports/registry.hpp"

namespace wsync {

int consumer_follow_run(const follow_options& o) {
  block_stop_signals();
  std::string who = "consumer rank " + std::to_string(o.rank);
  if (o.transport != "file-mmap") {
    return log_error(who +
                     ": --standalone without HTTP follows a file-mmap directory; "
                     "--transport " +
                     o.transport + " has no state file to poll"),
           2;
  }
  // The transport checks its options: a missing dir is named there.
  auto t = make_transport(o.transport, o.transport_settings);
  if (!t) return log_error(who + ": " + t.error().message), 2;
  const std::string& dir = o.transport_settings.at("dir");
  auto c = (*t)->make_consumer();
  if (!c) return log_error(who + ": " + c.error().message), 1;
  weight_consumer consumer(std::move(*c), consumer_config{o.rank, 2});
  reference_runtime runtime;
  rollout_executor executor(consumer, runtime, runtime.gate(), executor_config{o.verify});
  log_info(who + ": following " + dir + "/CURRENT every " + std::to_string(o.poll.count()) +
           " ms (file-mmap, no coordinator); SIGINT/SIGTERM/SIGHUP stops");
  update_id last_tried;
  std::string last_problem;
  while (!stop_requested_within(o.poll)) {
    auto cur = file_mmap_current(dir);
    if (!cur) {
      // A state file being replaced is never half-read (rename), so this is a real problem;
      // say it once, keep polling.
      if (cur.error().message != last_problem) log_warn(who + ": " + cur.error().message);
      last_problem = cur.error().message;
      continue;
    }
    last_problem.clear();
    if (!*cur || (*cur)->update_id == last_tried) continue;
    const auto& m = **cur;
    last_tried = m.update_id;
    if (!o.model_id.empty() && m.model_id != o.model_id) {
      log_warn(who + ": " + dir + "/CURRENT holds model_id " + m.model_id + ", not " + o.model_id +
               "; waiting for " + o.model_id + " (" + update_context(m) + ")");
      continue;
    }
    auto report = executor.update_weights(m);
    if (report.acknowledged) {
      log_info(who + ": active version " + std::to_string(m.weight_version) + " (update_id " +
               m.update_id + ", " + std::to_string(m.total_bytes) + " bytes, import " +
               std::to_string(report.timings.import) + " s, verify " +
               std::to_string(report.timings.verify) + " s)");
    } else if (report.failure && report.failure->code == errc::unknown_update) {
      // The writer reused the buffer between our read of CURRENT and our lease: CURRENT has
      // moved on, so the next poll finds the newer version.
      last_tried.clear();
    }
    // Other failures were logged by the executor (rejecting update: ...); the previous version
    // stays active and this update is not tried again.
  }
  auto active = executor.active_weight_version();
  executor.release_active();
  log_info(who + ": stopping; active version " +
           (active ? std::to_string(*active) : std::string("none")));
  return 0;
}

}  // namespace wsync
