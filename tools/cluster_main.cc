// pdserve-cluster: the `local` and `client` subcommands of `pdserve` (which
// execs this binary for them). A separate executable because these link gRPC
// and libprotobuf, which the single-process `pdserve generate` must not load
// next to the tokenizer's SentencePiece.
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  const std::string command = argc >= 2 ? argv[1] : "";
  absl::Status status;
  if (command == "local") {
    status = pdserve::tools::RunLocalCluster(argc, argv);
  } else if (command == "client") {
    status = pdserve::tools::RunClient(argc, argv);
  } else {
    std::fprintf(
        stderr, "usage: pdserve-cluster local|client ... (see pdserve help)\n");
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "pdserve %s: %s\n", command.c_str(),
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}
