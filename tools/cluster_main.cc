// pdserve-cluster: the `local`, `client` and `plan` subcommands of `pdserve`
// (which execs this binary for them). A separate executable because these link
// gRPC and libprotobuf, which the single-process `pdserve generate` must not
// load next to the tokenizer's SentencePiece.
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
  } else if (command == "plan") {
    status = pdserve::tools::RunPlan(argc, argv);
  } else {
    // Not meant to be run by hand: point at pdserve's own help.
    const bool help = command == "-h" || command == "--help";
    std::fputs(
        "usage: pdserve-cluster local|client|plan [flags]  (run by `pdserve "
        "local` "
        "and `pdserve client`;\n`pdserve help` lists the commands, `pdserve "
        "local --help` a command's flags)\n",
        help ? stdout : stderr);
    return help ? 0 : 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "pdserve %s: %s\n", command.c_str(),
                 status.ToString().c_str());
    return 1;
  }
  return 0;
}
