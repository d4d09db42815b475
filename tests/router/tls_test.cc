// TLS on the router's public endpoints, through real handshakes: certificates
// are made with `openssl` at run time (a CA, a server certificate for
// 127.0.0.1, client certificates from that CA and from a stranger's), then
// the OpenAI HTTP server and the gRPC Generation service are served over TLS
// (and mutual TLS) to cpp-httplib's and gRPC's own clients.
#include "rpc/tls.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/generation_service.h"
#include "router/http_server.h"
#include "rpc/auth.h"
#include "rpc/server.h"
#include "tests/router/fake_backend.h"

namespace pdserve::router {
namespace {

using testing::FakeBackend;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ =
        new std::string(absl::StrCat(::testing::TempDir(), "/tls-", getpid()));
    std::filesystem::create_directories(*dir_);
    const std::string d = *dir_;
    // Everything the test trusts and presents, made fresh.
    const std::string script = absl::StrCat(
        "set -e; cd ", d, "; exec 2>openssl.log\n",
        "for ca in ca stranger; do\n",
        "  openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "
        "/CN=$ca -keyout $ca.key -out $ca.pem\n",
        "done\n",
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost "
        "-keyout server.key -out server.csr\n",
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext\n",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key "
        "-CAcreateserial -days 1 -extfile san.ext -out server.pem\n",
        "for who in ca stranger; do\n",
        "  openssl req -newkey rsa:2048 -nodes -subj /CN=client-$who "
        "-keyout client-$who.key -out client-$who.csr\n",
        "  openssl x509 -req -in client-$who.csr -CA $who.pem -CAkey $who.key "
        "-CAcreateserial -days 1 -out client-$who.pem\n",
        "done\n");
    std::ofstream(d + "/make.sh") << script;
    ASSERT_EQ(std::system(absl::StrCat("sh ", d, "/make.sh").c_str()), 0)
        << "openssl failed; see " << d << "/openssl.log";
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static std::string File(const std::string& name) {
    return absl::StrCat(*dir_, "/", name);
  }
  static rpc::TlsFiles ServerFiles(bool mutual) {
    rpc::TlsFiles files;
    files.cert_file = File("server.pem");
    files.key_file = File("server.key");
    if (mutual) files.client_ca_file = File("ca.pem");
    return files;
  }

  void TearDown() override {
    EXPECT_TRUE(backend_.WaitIdle(absl::Seconds(10)));
  }

  static std::string Completion() {
    return R"({"model": "stories260K", "prompt": "Hi", "max_tokens": 3})";
  }

  std::unique_ptr<OpenAiHttpServer> StartHttp(bool mutual) {
    HttpServerOptions options;
    options.tls = ServerFiles(mutual);
    absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> server =
        OpenAiHttpServer::Start(options, &backend_);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  // A gRPC GenerateUnary against `address` with `credentials`.
  static grpc::Status Generate(
      const std::string& address,
      std::shared_ptr<grpc::ChannelCredentials> credentials) {
    auto stub = v1::Generation::NewStub(rpc::CreateChannel(
        address, "", grpc::ChannelArguments(), std::move(credentials)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::GenerateRequest request;
    request.set_text("Hi");
    request.set_max_tokens(3);
    v1::GenerateResponse response;
    return stub->GenerateUnary(&context, request, &response);
  }

  static std::string* dir_;
  FakeBackend backend_;
};

std::string* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, HttpsServesClientsThatTrustItsCaAndNobodyInPlaintext) {
  std::unique_ptr<OpenAiHttpServer> server = StartHttp(/*mutual=*/false);
  ASSERT_NE(server, nullptr);
  httplib::SSLClient client("127.0.0.1", server->port());
  client.set_ca_cert_path(File("ca.pem").c_str());
  client.enable_server_certificate_verification(true);
  auto health = client.Get("/health");
  ASSERT_TRUE(health) << httplib::to_string(health.error());
  EXPECT_EQ(health->status, 200);
  auto res = client.Post("/v1/completions", Completion(), "application/json");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200) << res->body;

  // Plaintext HTTP to the TLS port gets no HTTP answer.
  httplib::Client plain("127.0.0.1", server->port());
  plain.set_read_timeout(5, 0);
  auto refused = plain.Get("/health");
  EXPECT_TRUE(!refused || refused->status != 200);
  // A client that trusts another CA refuses the server.
  httplib::SSLClient doubting("127.0.0.1", server->port());
  doubting.set_ca_cert_path(File("stranger.pem").c_str());
  doubting.enable_server_certificate_verification(true);
  auto doubted = doubting.Get("/health");
  EXPECT_FALSE(doubted);
  server->Stop();
}

TEST_F(TlsTest, MutualTlsOverHttpWantsACertificateFromTheClientCa) {
  std::unique_ptr<OpenAiHttpServer> server = StartHttp(/*mutual=*/true);
  ASSERT_NE(server, nullptr);
  auto client_with = [&](const std::string& who) {
    auto client =
        who.empty()
            ? std::make_unique<httplib::SSLClient>("127.0.0.1", server->port())
            : std::make_unique<httplib::SSLClient>(
                  "127.0.0.1", server->port(), File("client-" + who + ".pem"),
                  File("client-" + who + ".key"));
    client->set_ca_cert_path(File("ca.pem").c_str());
    client->enable_server_certificate_verification(true);
    return client;
  };
  auto ok = client_with("ca")->Post("/v1/completions", Completion(),
                                    "application/json");
  ASSERT_TRUE(ok) << httplib::to_string(ok.error());
  EXPECT_EQ(ok->status, 200) << ok->body;
  EXPECT_FALSE(client_with("")->Get("/health")) << "no client certificate";
  EXPECT_FALSE(client_with("stranger")->Get("/health"))
      << "a certificate from another CA";
  server->Stop();
}

TEST_F(TlsTest, GrpcOverTlsAndMutualTls) {
  GenerationService service(&backend_);
  for (const bool mutual : {false, true}) {
    SCOPED_TRACE(mutual ? "mutual TLS" : "TLS");
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
        rpc::ServerCredentialsFor(ServerFiles(mutual));
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    absl::StatusOr<std::unique_ptr<rpc::RunningServer>> server =
        rpc::RunningServer::Start("127.0.0.1:0", {&service}, *credentials);
    ASSERT_TRUE(server.ok()) << server.status();
    const std::string address = (*server)->address();

    auto client = [&](const std::string& ca, const std::string& who) {
      absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> c =
          rpc::ClientTlsCredentials(
              File(ca), who.empty() ? "" : File("client-" + who + ".pem"),
              who.empty() ? "" : File("client-" + who + ".key"));
      EXPECT_TRUE(c.ok()) << c.status();
      return *c;
    };
    const grpc::Status trusted = Generate(address, client("ca.pem", "ca"));
    EXPECT_TRUE(trusted.ok()) << trusted.error_message();
    EXPECT_EQ(
        Generate(address, grpc::InsecureChannelCredentials()).error_code(),
        grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(Generate(address, client("stranger.pem", "ca")).error_code(),
              grpc::StatusCode::UNAVAILABLE)
        << "the client must not trust a server its CA did not sign";
    const grpc::Status anonymous = Generate(address, client("ca.pem", ""));
    EXPECT_EQ(anonymous.ok(), !mutual) << anonymous.error_message();
    const grpc::Status stranger =
        Generate(address, client("ca.pem", "stranger"));
    EXPECT_EQ(stranger.ok(), !mutual) << stranger.error_message();
    (*server)->Shutdown();
  }
}

TEST_F(TlsTest, IncompleteOrWrongFilesArePreciseErrors) {
  rpc::TlsFiles files = ServerFiles(false);
  files.key_file.clear();
  EXPECT_EQ(rpc::CheckTlsFiles(files).code(),
            absl::StatusCode::kInvalidArgument);
  files = {};
  files.client_ca_file = File("ca.pem");
  EXPECT_EQ(rpc::CheckTlsFiles(files).code(),
            absl::StatusCode::kInvalidArgument);
  files = ServerFiles(false);
  files.cert_file = File("missing.pem");
  EXPECT_EQ(rpc::CheckTlsFiles(files).code(), absl::StatusCode::kNotFound);
  files = ServerFiles(false);
  files.key_file = File("san.ext");  // not PEM
  EXPECT_EQ(rpc::CheckTlsFiles(files).code(),
            absl::StatusCode::kInvalidArgument);
  // A key that is not the certificate's: the HTTP server refuses to start.
  HttpServerOptions options;
  options.tls = ServerFiles(false);
  options.tls.key_file = File("client-ca.key");
  absl::StatusOr<std::unique_ptr<OpenAiHttpServer>> server =
      OpenAiHttpServer::Start(options, &backend_);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument)
      << server.status();
}

}  // namespace
}  // namespace pdserve::router
