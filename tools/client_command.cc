// pdserve client --router HOST:PORT (--prompt TEXT | --ids 1,2,3) [flags]
//   (`pdserve client --help` lists every flag, its default and meaning)
//
// Streams the continuation's text to stdout; a summary (tokens, finish
// reason, time to first token) goes to stderr. Errors print the gRPC status.
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/command_line_flags.h"
#include "common/status_macros.h"
#include "pdserve/v1/generate.grpc.pb.h"
#include "rpc/auth.h"
#include "rpc/status_conversion.h"
#include "rpc/tls.h"
#include "tools/commands.h"

namespace pdserve::tools {
namespace {

const char* FinishName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    case v1::FINISH_REASON_CANCELLED:
      return "cancelled";
    case v1::FINISH_REASON_ERROR:
      return "error";
    default:
      return "unspecified";
  }
}

constexpr char kClientSynopsis[] =
    "pdserve client --router HOST:PORT (--prompt TEXT | --ids 1,2,3) "
    "[flags]\n"
    "Sends one request to a router's gRPC API and streams the "
    "continuation's text to stdout; a summary (tokens, finish reason, time "
    "to first token) goes to stderr.\n";

}  // namespace

absl::Status RunClient(int argc, char** argv) {
  CommandLineFlags flags;
  PDS_RETURN_IF_ERROR(flags.Parse(argc, argv, /*first=*/2));
  v1::GenerateRequest request;
  flags.Group("Request");
  const std::string router =
      flags.Str("router", "127.0.0.1:50051", "The router's gRPC HOST:PORT.");
  const std::string prompt =
      flags.Str("prompt", "", "Prompt text (or give --ids).");
  const std::string ids_text =
      flags.Str("ids", "", "Prompt as token ids 1,2,3 (or give --prompt).");
  request.set_model(flags.Str("model", "",
                              "Model name to ask for (the router's "
                              "--model-name).",
                              "(none: the router's model)"));
  request.set_max_tokens(flags.Num<int>(
      "max-tokens", 64,
      "Most tokens to generate (0 with --echo 1 --logprobs N: only score "
      "the prompt)."));
  const bool has_stop = flags.Has("stop");
  std::string stop = flags.Str(
      "stop", "", "Stop string: the output ends where it would appear.");
  if (has_stop) request.add_stop(std::move(stop));
  const double timeout_s = flags.Num<double>(
      "timeout-seconds", 120, "Deadline of the whole request, in seconds.");
  flags.Group("Sampling");
  request.mutable_sampling()->set_temperature(flags.Num<float>(
      "temperature", 0.0f, "Sampling temperature; 0: greedy."));
  request.mutable_sampling()->set_top_p(
      flags.Num<float>("top-p", 1.0f, "Nucleus sampling mass (0, 1]."));
  request.mutable_sampling()->set_top_k(flags.Num<int>(
      "top-k", 0, "Sample among the k most likely tokens; 0: all."));
  // No --seed: the router picks a fresh one per request.
  const bool has_seed = flags.Has("seed");
  const int64_t seed =
      flags.Num<int64_t>("seed", 0, "Sampling seed, for reproducible samples.",
                         "(none: the router picks one per request)");
  if (has_seed)
    request.mutable_sampling()->set_seed(static_cast<uint64_t>(seed));
  flags.Group("Output");
  const bool show_ids =
      flags.Bool("show-ids", false,
                 "After the text, print the generated token ids (ids: 1,2,3).");
  const int logprobs =
      flags.Num<int>("logprobs", -1,
                     "Print each token's log-probability and its N most likely "
                     "alternatives (0-20); -1: off.");
  request.set_echo(flags.Bool(
      "echo", false,
      "Print the prompt first; with --logprobs, score its tokens too."));
  if (logprobs >= 0) {
    request.set_include_logprobs(true);
    request.set_top_logprobs(logprobs);
  }
  flags.Group("Security");
  const std::string api_key_file = flags.Str(
      "api-key-file", "",
      "File of API keys (a router started with --api-key-file): its first "
      "key is sent.");
  const std::string tls_ca = flags.Str(
      "tls-ca", "",
      "TLS to the router, verified with this PEM CA (system: the system's "
      "roots).");
  const std::string tls_cert =
      flags.Str("tls-cert", "",
                "PEM client certificate for mutual TLS (with --tls-key).");
  const std::string tls_key =
      flags.Str("tls-key", "", "PEM private key of --tls-cert.");
  if (flags.help_requested()) {
    std::fputs(flags.Usage(kClientSynopsis).c_str(), stdout);
    return absl::OkStatus();
  }
  PDS_RETURN_IF_ERROR(flags.Check());
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (!tls_ca.empty() || !tls_cert.empty()) {
    PDS_ASSIGN_OR_RETURN(
        credentials, rpc::ClientTlsCredentials(tls_ca == "system" ? "" : tls_ca,
                                               tls_cert, tls_key));
  }
  std::string api_key;
  if (!api_key_file.empty()) {
    PDS_ASSIGN_OR_RETURN(rpc::BearerTokens keys,
                         rpc::BearerTokens::FromFile(api_key_file));
    api_key = keys.first();
  }
  if (prompt.empty() == ids_text.empty()) {
    return absl::InvalidArgumentError("give exactly one of --prompt, --ids");
  }
  if (!ids_text.empty()) {
    for (absl::string_view part : absl::StrSplit(ids_text, ',')) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(part, &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--ids: '", part, "' is not a token id"));
      }
      request.mutable_token_ids()->add_ids(id);
    }
  } else {
    request.set_text(prompt);
  }

  auto stub = v1::Generation::NewStub(rpc::CreateChannel(router, api_key));
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s)));
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  v1::GenerateResponse last;
  std::vector<int32_t> ids;
  std::vector<float> token_logprobs;
  std::vector<v1::TopLogprobs> alternatives;
  v1::PromptEcho echo;
  while (reader->Read(&response)) {
    if (response.has_echo()) {
      echo = response.echo();
      std::fputs(echo.text().c_str(), stdout);
    }
    std::fputs(response.text().c_str(), stdout);
    std::fflush(stdout);
    ids.insert(ids.end(), response.token_ids().begin(),
               response.token_ids().end());
    token_logprobs.insert(token_logprobs.end(), response.logprobs().begin(),
                          response.logprobs().end());
    alternatives.insert(alternatives.end(), response.top_logprobs().begin(),
                        response.top_logprobs().end());
    last = response;
  }
  if (!ids.empty() || !echo.text().empty()) std::printf("\n");
  PDS_RETURN_IF_ERROR(rpc::FromGrpcStatus(reader->Finish()));
  // The prompt's scores (echo + logprobs): token 0 has none; "p" marks
  // prompt lines, then the total a scorer adds up.
  double prompt_total = 0;
  for (int k = 0; k < echo.token_ids_size(); ++k) {
    if (k == 0) {
      std::printf("p%5d         -\n", echo.token_ids(0));
      continue;
    }
    const float logprob =
        k - 1 < echo.logprobs_size() ? echo.logprobs(k - 1) : 0;
    prompt_total += logprob;
    std::string line =
        absl::StrFormat("p%5d %9.4f", echo.token_ids(k), logprob);
    if (k - 1 < echo.top_logprobs_size()) {
      for (const v1::TopLogprob& t : echo.top_logprobs(k - 1).alternatives()) {
        absl::StrAppendFormat(&line, "  %d:%.4f", t.token_id(), t.logprob());
      }
    }
    std::printf("%s\n", line.c_str());
  }
  if (echo.token_ids_size() > 1) {
    std::printf("prompt log-likelihood %.4f over %d tokens\n", prompt_total,
                echo.token_ids_size() - 1);
  }
  // One line per token: id, logprob, then the alternatives as id:logprob.
  for (size_t i = 0; i < token_logprobs.size() && i < ids.size(); ++i) {
    std::string line = absl::StrFormat("%6d %9.4f", ids[i], token_logprobs[i]);
    if (i < alternatives.size()) {
      for (const v1::TopLogprob& t : alternatives[i].alternatives()) {
        absl::StrAppendFormat(&line, "  %d:%.4f", t.token_id(), t.logprob());
      }
    }
    std::printf("%s\n", line.c_str());
  }
  if (show_ids) {
    std::string list;
    for (int32_t id : ids) absl::StrAppend(&list, list.empty() ? "" : ",", id);
    std::printf("ids: %s\n", list.c_str());
  }
  std::fprintf(stderr,
               "[%s: %d prompt tokens, %d generated, finish %s, first token "
               "%.1f ms, total %.1f ms]\n",
               last.request_id().c_str(), last.usage().prompt_tokens(),
               last.usage().completion_tokens(),
               FinishName(last.finish_reason()),
               last.timing().time_to_first_token_seconds() * 1e3,
               last.timing().total_seconds() * 1e3);
  return absl::OkStatus();
}

}  // namespace pdserve::tools
