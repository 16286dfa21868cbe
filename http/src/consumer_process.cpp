// The consumer processes that serve HTTP: a standalone rank driven only over HTTP, and the
// coordinator-driven ranks of a process with the HTTP surface over them.

#include "wsync/http/consumer_process.hpp"

#include "wsync/actors/stop_signals.hpp"
#include "wsync/http/gateway.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {

namespace {

// Feeds what the coordinator-driven ranks do into the service behind the gateway.
class http_follower final : public consumer_observer {
 public:
  http_follower(const standalone_options& o, std::string coordinator)
      : service_(o.rank, std::move(coordinator)), gateway_(service_, o.http) {}
  ~http_follower() override { stopping(); }  // a backstop: consumer_run calls it on every path
  result<std::uint16_t> start() { return gateway_.start(); }
  void rank_started(std::int32_t rank, reference_runtime& runtime) override {
    service_.add_rank(rank, runtime);
  }
  void update_done(std::int32_t rank, const std::string& key, const rollout_report& report,
                   std::uint64_t bytes) override {
    service_.record_update(rank, key, report, bytes);
  }
  void stopping() override {
    // Each step may run twice (here, then from the destructor). No generation may run on a runtime
    // that is about to go: those in flight or held by a pause end, then the gateway's threads are
    // joined.
    service_.detach_ranks();
    service_.stop_waiting();
    gateway_.stop();
  }

 private:
  weight_transfer_service service_;
  http_gateway gateway_;
};

}  // namespace

int consumer_http_run(consumer_options options, const standalone_options& http) {
  // Before the gateway starts its threads: a stop signal must reach consumer_run's wait, not
  // kill the process from one of them.
  block_stop_signals();
  http_follower follower(http,
                         options.coordinator.host + ":" + std::to_string(options.coordinator.port));
  auto port = follower.start();
  if (!port) return log_error(port.error().message), 1;
  log_info("consumer ranks " + std::to_string(options.rank) + ".." +
           std::to_string(options.rank + options.count - 1) + ": HTTP on " + http.http.host + ":" +
           std::to_string(*port) + (http.http.token.empty() ? "" : " (bearer token required)"));
  options.observer = &follower;
  return consumer_run(options);
}

int standalone_consumer_run(const standalone_options& options) {
  // Stop signals go to wait_for_signal below, not to the default action, in every thread
  // started later.
  block_stop_signals();
  weight_transfer_service service(options.rank);
  http_gateway gateway(service, options.http);
  auto port = gateway.start();
  if (!port) return log_error(port.error().message), 1;
  log_info("consumer rank " + std::to_string(options.rank.rank) + ": standalone, HTTP on " +
           options.http.host + ":" + std::to_string(*port) +
           (options.http.token.empty() ? "" : " (bearer token required)"));
  wait_for_signal();
  // A generation held by a pause, or an NCCL wait, would keep stop() waiting.
  service.stop_waiting();
  gateway.stop();
  return 0;
}

}  // namespace wsync
