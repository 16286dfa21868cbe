#pragma once
// What the benchmarks' processes share: a control channel of length-prefixed JSON messages over
// a socket, and a consumer rank (the reference runtime behind the rollout executor) that answers
// them, in this process or in a child of its own.

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"
#include "wsync/transports/transport.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync {

/// Sends one message; false when the peer is gone.
bool channel_send(int fd, const nlohmann::json& message);

/// The next message, or nullopt when the peer is gone, `timeout` passed, or `*interrupted`
/// became non-zero (a signal handler's flag) while waiting.
std::optional<nlohmann::json> channel_receive(int fd, std::chrono::milliseconds timeout,
                                              const volatile sig_atomic_t* interrupted = nullptr);

/// One consumer rank: imports, verifies, installs and acknowledges each update it is handed.
class bench_consumer {
 public:
  bench_consumer(std::unique_ptr<consumer_transport> t, bool verify, std::int32_t rank);

  /// Runs one update through the rollout executor; returns the "report" message.
  nlohmann::json handle(const weight_update_manifest& m, double decode_s);

  /// Releases what the active weights still hold; returns the ids.
  std::vector<update_id> shutdown() { return executor_.release_active(); }

 private:
  weight_consumer consumer_;
  reference_runtime runtime_;
  rollout_executor executor_;
};

/// The body of a consumer process: makes a consumer of `transport`, sends {"type": "ready",
/// "relay_address": ...} (or {"type": "error"}), then answers each "update" with a "report"
/// and "stop" with "released", and exits.
[[noreturn]] void bench_consumer_process(int fd, bool verify, const std::string& transport,
                                         const transport_options& options, std::int32_t rank);

}  // namespace wsync
