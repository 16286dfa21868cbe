#pragma once
// Entry points of the consumer processes that serve the HTTP surface (gateway.hpp). Each runs
// until SIGINT/SIGTERM/SIGHUP and returns a process exit code.

#include "wsync/actors/node.hpp"
#include "wsync/http/gateway.hpp"
#include "wsync/http/weight_transfer.hpp"

namespace wsync {

/// `wsync consumer --standalone`: one consumer rank with no coordinator, driven only over HTTP,
/// as a vLLM server would be. Runs until SIGINT/SIGTERM/SIGHUP; returns the exit code.
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
