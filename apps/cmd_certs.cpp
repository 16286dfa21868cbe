// `wsync certs`: a CA and per-node certificates and keys for TLS between cluster processes.

#include <iostream>
#include <memory>

#include "common.hpp"
#include "subcommand.hpp"
#include "wsync/cluster/certs.hpp"

namespace wsync::cli {
namespace {

int certs_run(const certs_request& r) {
  auto files = certs_make(r);
  if (!files) {
    std::cerr << "wsync " << files.error().message << "\n";
    return 1;
  }
  for (const auto& f : *files) std::cout << f << "\n";
  std::cout << "On each node N, start every wsync process with:\n"
            << "  WSYNC_TLS_CERT=" << r.out_dir << "/N.pem WSYNC_TLS_KEY=" << r.out_dir
            << "/N.key WSYNC_TLS_CA=" << r.out_dir << "/ca.pem\n"
            << "Copy ca.pem and that node's two files only; ca.key stays where certificates are "
               "made (docs/cluster.md, TLS).\n";
  return 0;
}

}  // namespace

subcommand add_certs(CLI::App& app) {
  auto r = std::make_shared<certs_request>();
  auto* certs = app.add_subcommand(
      "certs",
      "Make a private CA and a certificate and key per node, for TLS between the cluster's "
      "processes (keys mode 0600; existing files are never overwritten).");
  certs->add_option("--out", r->out_dir, "directory to write into (created if missing)")
      ->required();
  certs->add_option("--nodes", r->nodes, "host names or IP addresses, one certificate each")
      ->delimiter(',')
      ->required();
  certs->add_option("--days", r->days, "validity in days")
      ->check(CLI::Range(1u, 36500u))
      ->capture_default_str();
  return {certs, [r] {
            return certs_run(*r);
          }};
}

}  // namespace wsync::cli
