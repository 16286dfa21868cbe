#include "common.hpp"

#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <iostream>

#include "wsync/transports/registry.hpp"

namespace wsync::cli {
namespace {

// "host:port" -> endpoint (host and port only): a host, and a port of decimal digits only.
bool parse_endpoint(const std::string& text, endpoint& ep) {
  auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  const char* first = text.data() + colon + 1;
  const char* last = text.data() + text.size();
  unsigned port = 0;
  auto [end, ec] = std::from_chars(first, last, port);
  if (first == last || *first == '+' || ec != std::errc() || end != last || port == 0 ||
      port > 65535) {
    return false;
  }
  ep.host = text.substr(0, colon);
  ep.port = static_cast<std::uint16_t>(port);
  return true;
}

}  // namespace

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

CLI::Option* add_milliseconds(CLI::App* cmd, const std::string& name,
                              std::chrono::milliseconds& field, const std::string& help,
                              std::int64_t min_ms, std::int64_t max_ms) {
  // CLI11 cannot read a std::chrono duration, so the flag takes the count and the callback
  // stores it; without the flag the callback never runs and the struct's default stands.
  return cmd
      ->add_option_function<std::int64_t>(
          name, [&field](const std::int64_t& ms) { field = std::chrono::milliseconds(ms); }, help)
      ->check(CLI::Range(min_ms, max_ms))
      ->default_str(std::to_string(field.count()));
}

void add_node(CLI::App* cmd, std::string& node, const std::string& help) {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) == 0 && host[0] != '\0') node = host;
  cmd->add_option("--node", node, help + " (default: this host's name)")
      ->envname("WSYNC_NODE")
      ->capture_default_str();
}

void add_token(CLI::App* cmd, std::string& token) {
  cmd->add_option("--token", token,
                  "cluster token (default: $WSYNC_TOKEN); ranks without it are refused")
      ->envname("WSYNC_TOKEN")
      ->configurable(false);
}

void add_transport(CLI::App* cmd, std::string& transport, std::vector<std::string>& settings) {
  cmd->add_option("--transport", transport,
                  "data plane: shared-memory (one node), file-mmap (a directory both sides "
                  "mount: disk, tmpfs, NFS; needs dir=DIR), ucx (across nodes; consumers relay "
                  "along the coordinator's --plan), or cuda-ipc / cuda-vmm (one GPU node: device "
                  "slots, zero-copy device views; CUDA builds with a device), or nccl (one "
                  "communicator from the publisher to the consumer ranks in consumers=...)")
      ->check(CLI::IsMember(builtin_transports().names()))
      ->capture_default_str();
  cmd->add_option("--transport-option", settings,
                  "KEY=VALUE for the transport, repeatable (ucx: tls=tcp, devices=eth0, "
                  "chunk_bytes=...; file-mmap: dir=DIR, buffers=2, lease_timeout_ms=10000; "
                  "cuda-ipc, cuda-vmm: slots=2, device=0; nccl: consumers=0,1, device=0, "
                  "bucket_bytes=..., buckets=2, timeout_ms=60000; see docs/transports.md)");
}

void add_tls(CLI::App* cmd, tls_settings& tls) {
  auto* cert = cmd->add_option("--tls-cert", tls.certificate,
                               "PEM certificate: turns on TLS between cluster processes (every "
                               "process needs one; with --tls-key and --tls-ca)")
                   ->envname("WSYNC_TLS_CERT")
                   ->check(CLI::ExistingFile);
  auto* key = cmd->add_option("--tls-key", tls.key, "PEM private key of --tls-cert")
                  ->envname("WSYNC_TLS_KEY")
                  ->check(CLI::ExistingFile);
  auto* ca =
      cmd->add_option("--tls-ca", tls.ca_file, "PEM CA file that signed every peer's certificate")
          ->envname("WSYNC_TLS_CA")
          ->check(CLI::ExistingFile);
  // All three or none: a key and CA without the certificate would leave TLS off without a
  // word (a misspelt WSYNC_TLS_CERT), and a certificate alone cannot verify anyone.
  cert->needs(key)->needs(ca);
  key->needs(cert);
  ca->needs(cert);
}

bool transport_settings_from(const std::vector<std::string>& items, transport_options& out) {
  for (const auto& item : items) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::cerr << "wsync: --transport-option " << item << ": expected KEY=VALUE\n";
      return false;
    }
    out[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return true;
}

bool coordinator_from(const std::string& text, endpoint& ep) {
  if (parse_endpoint(text, ep)) return true;
  std::cerr << "wsync: --coordinator: expected host:port, got " << text << "\n";
  return false;
}

bool need_token(const std::string& token) {
  if (!token.empty()) return true;
  std::cerr << "wsync: no cluster token: pass --token or set WSYNC_TOKEN\n";
  return false;
}

void launcher_environment() {
  auto copy = [](const char* from, const char* to) {
    if (std::getenv(to) == nullptr && std::getenv(from) != nullptr) {
      ::setenv(to, std::getenv(from), 0);
    }
  };
  copy("SLURM_PROCID", "RANK");
  copy("SLURM_NTASKS", "WORLD_SIZE");
  copy("SLURM_LOCALID", "LOCAL_RANK");
}

}  // namespace wsync::cli
