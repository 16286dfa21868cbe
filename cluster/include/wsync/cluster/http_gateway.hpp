#pragma once
// The HTTP control surface of a consumer rank (DESIGN §7): vLLM's weight-transfer routes plus
// /metrics, /status and /generate, served by cpp-httplib and answered by a
// weight_transfer_service. Off unless asked for (--enable-weight-transfer or
// WSYNC_SERVER_DEV_MODE=1), on 127.0.0.1 unless told otherwise, and behind a bearer token when
// one is configured.

#include <cstdint>
#include <memory>
#include <string>

#include "wsync/actors/node.hpp"
#include "wsync/cluster/weight_transfer.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

struct http_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;  ///< 0: pick a free one
  std::string token;       ///< bearer token every request must carry; empty: none
  std::string port_file;   ///< written once listening (for launchers and tests)
  int threads = 64;        ///< held generations occupy one each: keep room for /resume
};

class http_gateway {
 public:
  http_gateway(weight_transfer_service& service, http_options options);
  ~http_gateway();  ///< stops serving
  http_gateway(const http_gateway&) = delete;
  http_gateway& operator=(const http_gateway&) = delete;

  /// Binds and serves in a background thread; returns the port.
  result<std::uint16_t> start();
  void stop();

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// `wsync consumer --standalone`: one consumer rank with no coordinator, driven only over HTTP,
/// as a vLLM server would be. Runs until SIGINT/SIGTERM; returns the exit code.
struct standalone_options {
  weight_transfer_config rank;
  http_options http;
};
int standalone_consumer_run(const standalone_options& options);

/// `wsync consumer --coordinator ... --enable-weight-transfer`: the coordinator-driven ranks
/// of this process (consumer_run) plus the HTTP surface over them: /status, /metrics,
/// /pause, /resume, /is_paused, /get_world_size and /generate; the four phases answer 409.
int consumer_http_run(consumer_options options, const standalone_options& http);

}  // namespace wsync
