#pragma once
// The ucx transport handle (JSON): what a consumer needs to pull an update, and the rewrites the
// fan-out planner asks of it (point it at a relay, join stripes). Internal to transports/ucx/.

#include <cstdint>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync::ucx_detail {

// --- the handle: what a consumer needs to pull an update ---------------------------------------

// A process as a handle names it (the publisher's): pid, start time, PID namespace and the boot
// id of its host (a pid means something on that host only); pid 0: none named. A consumer that
// keeps the publisher's remote keys while it lives lets go of them, and of the memory they map,
// once it exited (node::watch_publisher).
struct process_id {
  std::int64_t pid = 0;
  std::uint64_t start = 0, pidns = 0;
  std::string boot;
};

struct handle {
  std::string address;                 // source worker address, hex
  std::vector<std::string> fallbacks;  // sources to pull from if it fails
  struct path {
    std::string address;
    std::vector<std::string> fallbacks;
  };
  std::vector<path> stripes;  // when set, chunk i comes from stripes[i % size] instead
  std::uint64_t chunk = 0;    // chunk size of the pull
  std::vector<std::vector<std::uint64_t>> checksums;  // XXH3 per chunk, per segment
  std::string rkey;                                   // publisher sources only: packed rkey, hex
  std::vector<std::uint64_t> bases;                   // ... and each segment's remote address
  process_id publisher;                               // ... and the publisher's process
};

std::string handle_dump(const handle& h);

// Parses a handle written by handle_dump, checked against the manifest's segments when given.
result<handle> handle_parse(const std::string& text, const weight_update_manifest* m);

// transport::handle_via_relay and transport::handle_striped of "ucx".
result<std::string> handle_via_relay(const std::string& text, const std::string& relay_address);
result<std::string> handle_striped(const std::vector<std::string>& texts);

}  // namespace wsync::ucx_detail
