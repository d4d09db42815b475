#include "rpc/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace pdserve::rpc {

absl::StatusOr<std::string> ReadPemFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a PEM file (no -----BEGIN line)"));
  }
  return text.str();
}

absl::Status CheckTlsFiles(const TlsFiles& files) {
  if (files.cert_file.empty() != files.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert and --tls-key go together (give both or neither)");
  }
  if (!files.enabled()) {
    if (!files.client_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "--tls-client-ca needs --tls-cert and --tls-key");
    }
    return absl::OkStatus();
  }
  for (const std::string* path :
       {&files.cert_file, &files.key_file, &files.client_ca_file}) {
    if (path->empty()) continue;
    if (absl::StatusOr<std::string> pem = ReadPemFile(*path); !pem.ok()) {
      return pem.status();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsFiles& files) {
  if (absl::Status s = CheckTlsFiles(files); !s.ok()) return s;
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  absl::StatusOr<std::string> cert = ReadPemFile(files.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(files.key_file);
  if (!key.ok()) return key.status();
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (!files.client_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(files.client_ca_file);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
    options.client_certificate_request =
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientTlsCredentials(
    const std::string& ca_file, const std::string& cert_file,
    const std::string& key_file) {
  grpc::SslCredentialsOptions options;
  if (!ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile(ca_file);
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate needs its key (and the reverse)");
  }
  if (!cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile(cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile(key_file);
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::SslCredentials(options);
}

}  // namespace pdserve::rpc
