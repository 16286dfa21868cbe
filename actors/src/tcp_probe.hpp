#pragma once
// Whether a TCP listener answers within a limit. CAF 0.17 connects with a blocking connect(): to
// a host that drops SYNs (a firewall, a machine that is down) it waits out the kernel's SYN
// retries, about two minutes at tcp_syn_retries=6, saying nothing; inside an actor it holds the
// middleman, and every other connect and publish of the process waits behind it. A probe first
// bounds that. Free of CAF.

#include <chrono>
#include <cstdint>
#include <string>

struct addrinfo;

namespace wsync {

/// Empty when host:port took a TCP connection within `limit` (closed at once); else why not:
/// "cannot resolve <host>: ...", the connect error ("Connection refused"), or "no answer within
/// <limit> ms".
std::string tcp_answers(const std::string& host, std::uint16_t port,
                        std::chrono::milliseconds limit);

/// The same over the addresses of `found` (a getaddrinfo list), tried in order within one
/// limit, each with an equal share of the time left; "no address" when the list is empty.
std::string tcp_answers(const addrinfo* found, std::chrono::milliseconds limit);

}  // namespace wsync
