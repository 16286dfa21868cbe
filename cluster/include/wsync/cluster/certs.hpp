#pragma once
// `wsync certs`: a private CA and one certificate and key per node, so that turning TLS on
// between cluster processes is one command.

#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"

namespace wsync {

struct certs_request {
  std::string out_dir;             ///< created if missing; existing files are never overwritten
  std::vector<std::string> nodes;  ///< host names or IP addresses, one certificate each
  unsigned days = 365;
};

/// Writes out_dir/ca.pem, ca.key and, per node, <node>.pem and <node>.key: RSA 2048 keys (mode
/// 0600), SHA-256 signatures, each node certificate naming the node (CN and subjectAltName, DNS
/// or IP) and signed by the CA. Returns the files written.
result<std::vector<std::string>> certs_make(const certs_request& request);

}  // namespace wsync
