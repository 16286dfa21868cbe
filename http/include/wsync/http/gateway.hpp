#pragma once
// The HTTP control surface of a consumer rank (docs/http.md): vLLM's weight-transfer routes plus
// /metrics, /status and /generate, served by cpp-httplib and answered by a
// weight_transfer_service (weight_transfer.hpp); SGLang's routes too when asked for. The processes
// that serve it are in consumer_process.hpp. Off unless asked for (--enable-weight-transfer or
// WSYNC_SERVER_DEV_MODE=1), on 127.0.0.1 unless told otherwise, and behind a bearer token when
// one is configured.

#include <cstdint>
#include <memory>
#include <string>

#include "wsync/http/weight_transfer.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

struct http_options {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;    ///< 0: pick a free one
  std::string token;         ///< bearer token every request must carry; empty: none
  std::string port_file;     ///< written once listening (for launchers and tests)
  int threads = 64;          ///< held generations occupy one each: keep room for /resume
  std::string api = "vllm";  ///< route set: "vllm", "sglang" or "both" (docs/http.md)
};

/// The route sets --http-api accepts.
inline constexpr const char* http_api_names[] = {"vllm", "sglang", "both"};

class http_gateway {
 public:
  http_gateway(weight_transfer_service& service, http_options options);
  ~http_gateway();  ///< stops serving
  http_gateway(const http_gateway&) = delete;
  http_gateway& operator=(const http_gateway&) = delete;

  /// Binds and serves in a background thread; returns the port.
  result<std::uint16_t> start();
  void stop();

  struct impl;  ///< gateway.cpp's (its route helpers take it)

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace wsync
