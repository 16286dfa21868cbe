// A CA and node certificates with OpenSSL's C API (certs.hpp).

#include "wsync/cluster/certs.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/bn.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/rsa.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>

namespace wsync {
namespace {

template <class T, void (*Free)(T*)>
struct freer {
  void operator()(T* p) const { Free(p); }
};
using pkey_ptr = std::unique_ptr<EVP_PKEY, freer<EVP_PKEY, EVP_PKEY_free>>;
using x509_ptr = std::unique_ptr<X509, freer<X509, X509_free>>;

error ssl_error(const std::string& what) {
  return make_error(errc::io_error, "certs: " + what + " failed (OpenSSL)");
}

result<pkey_ptr> rsa_key() {
  std::unique_ptr<EVP_PKEY_CTX, freer<EVP_PKEY_CTX, EVP_PKEY_CTX_free>> ctx(
      EVP_PKEY_CTX_new_id(EVP_PKEY_RSA, nullptr));
  EVP_PKEY* raw = nullptr;
  if (!ctx || EVP_PKEY_keygen_init(ctx.get()) <= 0 ||
      EVP_PKEY_CTX_set_rsa_keygen_bits(ctx.get(), 2048) <= 0 ||
      EVP_PKEY_keygen(ctx.get(), &raw) <= 0) {
    return ssl_error("RSA key generation");
  }
  return pkey_ptr(raw);
}

bool is_ip(const std::string& name) {
  unsigned char buf[16];
  return inet_pton(AF_INET, name.c_str(), buf) == 1 || inet_pton(AF_INET6, name.c_str(), buf) == 1;
}

// A certificate for `subject`'s public key, signed by `issuer_key` (self-signed when the issuer
// certificate is null).
result<x509_ptr> certificate(const std::string& common_name, EVP_PKEY* subject, X509* issuer,
                             EVP_PKEY* issuer_key, unsigned days, bool ca) {
  x509_ptr cert(X509_new());
  if (!cert) return ssl_error("X509_new");
  X509_set_version(cert.get(), 2);
  unsigned char serial[16];
  if (RAND_bytes(serial, sizeof(serial)) != 1) return ssl_error("RAND_bytes");
  serial[0] &= 0x7f;  // positive
  std::unique_ptr<BIGNUM, freer<BIGNUM, BN_free>> bn(BN_bin2bn(serial, sizeof(serial), nullptr));
  if (!bn || !BN_to_ASN1_INTEGER(bn.get(), X509_get_serialNumber(cert.get()))) {
    return ssl_error("serial number");
  }
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -300);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 86400L);
  X509_set_pubkey(cert.get(), subject);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("wsync"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(cert.get(), issuer ? X509_get_subject_name(issuer) : name);
  X509V3_CTX v3;
  X509V3_set_ctx_nodb(&v3);
  X509V3_set_ctx(&v3, issuer ? issuer : cert.get(), cert.get(), nullptr, nullptr, 0);
  std::vector<std::pair<int, std::string>> exts;
  if (ca) {
    exts = {{NID_basic_constraints, "critical,CA:TRUE"},
            {NID_key_usage, "critical,keyCertSign,cRLSign"},
            {NID_subject_key_identifier, "hash"}};
  } else {
    exts = {{NID_basic_constraints, "critical,CA:FALSE"},
            {NID_key_usage, "critical,digitalSignature,keyEncipherment"},
            {NID_ext_key_usage, "serverAuth,clientAuth"},
            {NID_subject_alt_name, std::string(is_ip(common_name) ? "IP:" : "DNS:") + common_name},
            {NID_authority_key_identifier, "keyid"}};
  }
  for (const auto& [nid, value] : exts) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &v3, nid, value.c_str());
    if (!ext) return ssl_error("extension " + value);
    X509_add_ext(cert.get(), ext, -1);
    X509_EXTENSION_free(ext);
  }
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) <= 0) return ssl_error("signing");
  return cert;
}

// Writes with O_EXCL (never overwrites) and the given mode; a file it made and could not fill
// is removed (a truncated key must not stay).
result<void> write_pem(const std::string& path, mode_t mode, EVP_PKEY* key, X509* cert) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    return make_error(errc::io_error, "certs: cannot create " + path + ": " + std::strerror(errno) +
                                          (errno == EEXIST ? " (remove it first)" : ""));
  }
  ::fchmod(fd, mode);  // whatever the umask says
  FILE* f = ::fdopen(fd, "w");
  if (!f) {
    ::close(fd);
    ::unlink(path.c_str());
    return make_error(errc::io_error, "certs: cannot write " + path);
  }
  bool ok = key ? PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr) == 1
                : PEM_write_X509(f, cert) == 1;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return make_error(errc::io_error, "certs: cannot write " + path);
  }
  return {};
}

bool node_name_ok(const std::string& n) {
  if (n.empty() || n.size() > 253 || n[0] == '.' || n[0] == '-') return false;
  for (char c : n) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' ||
          c == '_')) {
      return false;
    }
  }
  return true;
}

}  // namespace

result<std::vector<std::string>> certs_make(const certs_request& r) {
  if (r.out_dir.empty()) return make_error(errc::invalid_argument, "certs: --out: required");
  if (r.nodes.empty()) return make_error(errc::invalid_argument, "certs: --nodes: none given");
  if (r.days == 0) return make_error(errc::invalid_argument, "certs: --days: must be at least 1");
  std::set<std::string> seen;
  for (const auto& n : r.nodes) {
    if (!node_name_ok(n) || n == "ca") {
      return make_error(errc::invalid_argument,
                        "certs: --nodes: '" + n + "' is not a host name or IP address");
    }
    if (!seen.insert(n).second) {
      return make_error(errc::invalid_argument, "certs: --nodes: '" + n + "' given twice");
    }
  }
  std::error_code ec;
  std::filesystem::create_directories(r.out_dir, ec);
  if (ec)
    return make_error(errc::io_error, "certs: cannot create " + r.out_dir + ": " + ec.message());
  const std::filesystem::path dir(r.out_dir);
  // Refuse before writing anything, so a half-written set never mixes with an old one.
  std::vector<std::string> files{(dir / "ca.pem").string(), (dir / "ca.key").string()};
  for (const auto& n : r.nodes) {
    files.push_back((dir / (n + ".pem")).string());
    files.push_back((dir / (n + ".key")).string());
  }
  for (const auto& f : files) {
    if (std::filesystem::exists(f)) {
      return make_error(errc::io_error, "certs: " + f + " exists; remove it or pick another --out");
    }
  }
  // All or nothing: a failure part way (a full disk) removes what this run wrote, so a rerun
  // does not find a mixed set it refuses to touch.
  std::vector<std::string> written;
  auto undo = [&](error e) -> result<std::vector<std::string>> {
    for (const auto& f : written) std::filesystem::remove(f, ec);
    return e;
  };
  auto write = [&](const std::string& path, mode_t mode, EVP_PKEY* key, X509* cert) {
    auto ok = write_pem(path, mode, key, cert);
    if (ok) written.push_back(path);
    return ok;
  };
  auto ca_key = rsa_key();
  if (!ca_key) return ca_key.error();
  auto ca = certificate("wsync cluster CA", ca_key->get(), nullptr, ca_key->get(), r.days, true);
  if (!ca) return ca.error();
  if (auto ok = write(files[1], 0600, ca_key->get(), nullptr); !ok) return undo(ok.error());
  if (auto ok = write(files[0], 0644, nullptr, ca->get()); !ok) return undo(ok.error());
  for (std::size_t i = 0; i < r.nodes.size(); ++i) {
    auto key = rsa_key();
    if (!key) return undo(key.error());
    auto cert = certificate(r.nodes[i], key->get(), ca->get(), ca_key->get(), r.days, false);
    if (!cert) return undo(cert.error());
    if (auto ok = write(files[3 + 2 * i], 0600, key->get(), nullptr); !ok) {
      return undo(ok.error());
    }
    if (auto ok = write(files[2 + 2 * i], 0644, nullptr, cert->get()); !ok) {
      return undo(ok.error());
    }
  }
  return files;
}

}  // namespace wsync
