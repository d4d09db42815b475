// TLS for the router's public endpoints (gRPC and HTTP): the files a server
// presents and, optionally, the CA its clients' certificates must chain to
// (mutual TLS). Internal RPCs authenticate with the cluster token instead
// (rpc/auth.h) and run on loopback or a private network.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdserve::rpc {

struct TlsFiles {
  std::string cert_file;       // PEM certificate chain; "" = no TLS
  std::string key_file;        // PEM private key of the certificate
  std::string client_ca_file;  // "" = any client; else clients must present
                               // a certificate this CA signed
  bool enabled() const { return !cert_file.empty(); }
};

// OK for no TLS or a complete, readable set; INVALID_ARGUMENT for a
// certificate without a key (or the reverse) or a client CA without a
// certificate; NOT_FOUND for a file that cannot be read.
absl::Status CheckTlsFiles(const TlsFiles& files);

// Insecure credentials without TLS; otherwise TLS with the files' contents
// (and client certificates required and verified with a client CA).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsFiles& files);

// What a client of a TLS server uses: the CA that signed the server's
// certificate ("" = the system's roots) and, for mutual TLS, its own
// certificate and key ("" = none).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientTlsCredentials(
    const std::string& ca_file, const std::string& cert_file = "",
    const std::string& key_file = "");

// The whole of a (small) file; NOT_FOUND naming it when it cannot be read.
absl::StatusOr<std::string> ReadPemFile(const std::string& path);

}  // namespace pdserve::rpc
