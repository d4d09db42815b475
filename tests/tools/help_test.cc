// Every binary's --help and -h, run for real: exit 0, the usage on stdout
// (nothing on stderr), every group header, a sample of flags known to exist
// with their defaults, and no flag without a meaning. Also `pdserve` itself:
// its command list, and `pdserve help COMMAND`. A binary this build tree
// leaves out (-DPDSERVE_EXCLUDE) is skipped.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct CommandResult {
  int exit_code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

CommandResult RunCommand(const std::string& command) {
  char err_path[] = "/tmp/pdserve_help_test_XXXXXX";
  const int fd = mkstemp(err_path);
  if (fd >= 0) close(fd);
  CommandResult result;
  FILE* pipe = popen((command + " 2>" + err_path + " </dev/null").c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    result.out.append(buffer.data(), n);
  }
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_path);
  std::stringstream text;
  text << err.rdbuf();
  result.err = text.str();
  std::remove(err_path);
  return result;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Flag entries of a usage text: "--name" -> its line and continuation lines.
// Fails the test for a flag line without a meaning after the name.
std::map<std::string, std::string> FlagEntries(const std::string& usage) {
  std::map<std::string, std::string> entries;
  std::string current;
  for (const std::string& line : Lines(usage)) {
    if (line.rfind("  --", 0) == 0) {
      const size_t name_end = line.find(' ', 2);
      current = line.substr(
          2, name_end == std::string::npos ? std::string::npos : name_end - 2);
      EXPECT_TRUE(name_end != std::string::npos &&
                  line.find_first_not_of(' ', name_end) != std::string::npos)
          << "flag without a meaning: '" << line << "'";
      EXPECT_EQ(entries.count(current), 0u) << current << " listed twice";
      entries[current] = line;
    } else if (!current.empty() && line.rfind("    ", 0) == 0) {
      entries[current] += "\n" + line;
    } else {
      current.clear();
    }
  }
  return entries;
}

struct Binary {
  std::string name;     // for messages
  std::string command;  // path and subcommand
  std::vector<std::string> groups;
  // Flags known to exist -> their default as printed ("" = not checked).
  std::map<std::string, std::string> flags;
};

std::vector<Binary> Binaries() {
  std::vector<Binary> b;
#ifdef HELP_ROUTER
  b.push_back(
      {"router",
       HELP_ROUTER,
       {"Model", "Workers", "Scheduling", "Network", "Security", "Metrics"},
       {{"--metrics-port", "-1"},
        {"--api-key-file", "(none)"},
        {"--tls-cert", "(none)"},
        {"--tls-key", ""},
        {"--model-name", "the --model file or folder name"},
        {"--prefill-policy", "least-loaded"},
        {"--decode-policy", "prefix-aware"},
        {"--max-queued", "0"},
        {"--stagger-choices", "1"},
        {"--internal-token-file", ""}}});
#endif
#ifdef HELP_DECODE_WORKER
  b.push_back({"decode_worker",
               HELP_DECODE_WORKER,
               {"Model", "KV cache", "Scheduling", "Speculation", "Network",
                "Security", "Metrics"},
               {{"--kv-lease-seconds", "30"},
                {"--internal-token-file", "(none)"},
                {"--num-blocks", "512"},
                {"--kv-memory-mb", "0"},
                {"--speculation", "off"},
                {"--metrics-port", "-1"},
                {"--metrics-host", "--host"},
                {"--cuda-graphs", "1"},
                {"--model-name", "the --model file or folder name"}}});
#endif
#ifdef HELP_PREFILL_WORKER
  b.push_back({"prefill_worker",
               HELP_PREFILL_WORKER,
               {"Model", "Pipeline", "Scheduling", "KV cache", "Network",
                "Security", "Metrics"},
               {{"--layer-split", "auto"},
                {"--peers", "(none)"},
                {"--orphan-seconds", "30"},
                {"--heartbeat-ms", "200"},
                {"--internal-token-file", ""},
                {"--scored-share", "0"},
                {"--metrics-port", "-1"},
                {"--model-name", "the --model file or folder name"}}});
#endif
#ifdef HELP_PDSERVE
  b.push_back({"pdserve local",
               std::string(HELP_PDSERVE) + " local",
               {"Model", "Layout", "KV cache", "Scheduling", "Speculation",
                "Network", "Security", "Metrics", "Processes"},
               {{"--metrics-port-base", "9100"},
                {"--layer-split", "auto"},
                {"--model-name", ""},
                {"--prefill-policy", ""},
                {"--decode-policy", ""},
                {"--supervise", "1"},
                {"--api-key-file", "(none)"},
                {"--speculation", "ngram"},
                {"--stages", "2"},
                {"--tp", "2"}}});
  b.push_back({"pdserve client",
               std::string(HELP_PDSERVE) + " client",
               {"Request", "Sampling", "Output", "Security"},
               {{"--router", "127.0.0.1:50051"},
                {"--prompt", "(none)"},
                {"--seed", ""},
                {"--stop", "(none)"},
                {"--tls-ca", "(none)"},
                {"--logprobs", "-1"}}});
  b.push_back({"pdserve plan",
               std::string(HELP_PDSERVE) + " plan",
               {"Model and profile", "Workload", "SLO and resources"},
               {{"--perf-model", "(none)"},
                {"--profile", "1"},
                {"--rate", "1.5"},
                {"--slo-tpot-ms", "60"},
                {"--cores", "2"}}});
  b.push_back({"pdserve generate",
               std::string(HELP_PDSERVE) + " generate",
               {"Model", "KV cache", "Request", "Sampling"},
               {{"--model", "(none)"},
                {"--prompt", "(none)"},
                {"--max-tokens", "64"},
                {"--top-p", "1"},
                {"--format", "auto"}}});
#endif
#ifdef HELP_LAYOUT_REPORT
  b.push_back({"layout_report",
               HELP_LAYOUT_REPORT,
               {"Scrape", "Prometheus"},
               {{"--metrics", "(none)"},
                {"--interval", "10"},
                {"--prometheus", "(none)"},
                {"--window", "5m"}}});
#endif
#ifdef HELP_LOAD_BENCH
  b.push_back({"load_bench",
               HELP_LOAD_BENCH,
               {"Model", "Load", "SLO"},
               {{"--rate", "20"},
                {"--requests", "200"},
                {"--slo-ttft-ms", "200"},
                {"--short-prompt", "16:64"},
                {"--only", ""}}});
#endif
#ifdef HELP_PLANNER_BENCH
  b.push_back({"planner_bench",
               HELP_PLANNER_BENCH,
               {"Model", "Load"},
               {{"--requests", "60"},
                {"--rate", "1.5"},
                {"--perf-model", "(profile now)"},
                {"--top", "3"}}});
#endif
#ifdef HELP_PREFILL_BENCH
  b.push_back({"prefill_bench",
               HELP_PREFILL_BENCH,
               {"Model", "Workload", "Pipeline", "Scheduling"},
               {{"--stages", "1,2"},
                {"--prompt", "2048"},
                {"--prompt-logprobs", "-1"},
                {"--policy", "equal-cost"}}});
#endif
  return b;
}

TEST(HelpTest, EveryBinaryListsEveryFlagWithMeaningAndDefault) {
  const std::vector<Binary> binaries = Binaries();
  if (binaries.empty()) GTEST_SKIP() << "no binaries in this build tree";
  for (const Binary& binary : binaries) {
    SCOPED_TRACE(binary.name);
    const CommandResult help = RunCommand(binary.command + " --help");
    ASSERT_EQ(help.exit_code, 0) << help.out << help.err;
    EXPECT_EQ(help.err, "");
    EXPECT_EQ(help.out.rfind("usage: ", 0), 0u) << help.out;
    for (const std::string& group : binary.groups) {
      EXPECT_NE(help.out.find("\n" + group + ":\n"), std::string::npos)
          << "no group '" << group << "'\n"
          << help.out;
    }
    const std::map<std::string, std::string> entries = FlagEntries(help.out);
    EXPECT_GE(entries.size(), binary.flags.size()) << help.out;
    for (const auto& [flag, entry] : entries) {
      EXPECT_NE(entry.find("[default: "), std::string::npos)
          << flag << " shows no default:\n"
          << entry;
    }
    for (const auto& [flag, shown_default] : binary.flags) {
      auto it = entries.find(flag);
      ASSERT_NE(it, entries.end()) << flag << " missing\n" << help.out;
      if (!shown_default.empty()) {
        EXPECT_NE(it->second.find("[default: " + shown_default),
                  std::string::npos)
            << it->second;
      }
    }
    // Wrapped to 80 columns.
    for (const std::string& line : Lines(help.out)) {
      EXPECT_LE(line.size(), 80u) << line;
    }

    const CommandResult short_help = RunCommand(binary.command + " -h");
    EXPECT_EQ(short_help.exit_code, 0) << short_help.err;
    EXPECT_EQ(short_help.out, help.out);
    EXPECT_EQ(short_help.err, "");
  }
}

TEST(HelpTest, UnknownFlagIsStillAnErrorWithoutHelp) {
  for (const Binary& binary : Binaries()) {
    SCOPED_TRACE(binary.name);
    const CommandResult bad = RunCommand(binary.command + " --no-such-flag 1");
    EXPECT_NE(bad.exit_code, 0) << bad.out << bad.err;
    EXPECT_NE(bad.err.find("unknown flag --no-such-flag"), std::string::npos)
        << bad.out << bad.err;
    // With help it is the usage instead.
    const CommandResult help =
        RunCommand(binary.command + " --no-such-flag 1 --help");
    EXPECT_EQ(help.exit_code, 0) << help.err;
    EXPECT_EQ(help.out.rfind("usage: ", 0), 0u) << help.out;
  }
}

#ifdef HELP_PDSERVE
TEST(HelpTest, PdserveListsItsCommands) {
  const std::string pdserve = HELP_PDSERVE;
  std::string listing;
  for (const char* help : {" --help", " -h", " help"}) {
    SCOPED_TRACE(help);
    const CommandResult r = RunCommand(pdserve + help);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    for (const char* command :
         {"generate", "local", "client", "plan", "help"}) {
      EXPECT_NE(r.out.find("\n  " + std::string(command) + " "),
                std::string::npos)
          << command << "\n"
          << r.out;
    }
    for (const std::string& line : Lines(r.out)) {
      EXPECT_LE(line.size(), 80u) << line;
    }
    if (listing.empty()) listing = r.out;
    EXPECT_EQ(r.out, listing);
  }
  // No command: the same list, as a usage error on stderr.
  const CommandResult none = RunCommand(pdserve);
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_EQ(none.out, "");
  EXPECT_EQ(none.err, listing);
  // An unknown command names itself and lists the commands.
  const CommandResult unknown = RunCommand(pdserve + " frobnicate");
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("unknown command 'frobnicate'"), std::string::npos)
      << unknown.err;
  // `pdserve help COMMAND` is `pdserve COMMAND --help`.
  for (const char* command : {"generate", "local", "client", "plan"}) {
    SCOPED_TRACE(command);
    const CommandResult via_help = RunCommand(pdserve + " help " + command);
    const CommandResult via_flag =
        RunCommand(pdserve + " " + command + " --help");
    EXPECT_EQ(via_help.exit_code, 0) << via_help.err;
    EXPECT_EQ(via_help.out, via_flag.out);
    EXPECT_NE(via_help.out.find("usage: pdserve " + std::string(command)),
              std::string::npos)
        << via_help.out;
  }
}
#endif

}  // namespace
