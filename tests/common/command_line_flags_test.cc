// CommandLineFlags: parsing, --help / -h, and the usage generated from the
// lookups (groups, defaults, meanings).
#include "common/command_line_flags.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

namespace pdserve {
namespace {

// argv for Parse from a list of words (argv[0] is the program).
class Argv {
 public:
  explicit Argv(std::vector<std::string> words) : words_(std::move(words)) {
    words_.insert(words_.begin(), "prog");
    for (std::string& w : words_) pointers_.push_back(w.data());
    pointers_.push_back(nullptr);
  }
  int argc() const { return static_cast<int>(words_.size()); }
  char** argv() { return pointers_.data(); }

 private:
  std::vector<std::string> words_;
  std::vector<char*> pointers_;
};

// The lookups of a small binary, in two groups.
struct Parsed {
  std::string model;
  int port = 0;
  double timeout = 0;
  bool tls = false;
  std::string token_file;
};

Parsed LookUp(CommandLineFlags& flags) {
  Parsed p;
  flags.Group("Model");
  p.model = flags.Str("model", "", "The model folder.");
  flags.Group("Network");
  p.port = flags.Num<int>("port", 50051, "The gRPC port.");
  p.timeout = flags.Num<double>("timeout-seconds", 2.5, "How long to wait.");
  flags.Group("Security");
  p.tls = flags.Bool("tls", false, "Serve over TLS.");
  p.token_file =
      flags.Str("token-file", "", "Shared token file.", "(none: no token)");
  return p;
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(CommandLineFlagsTest, ParsesBothSpellingsAndConsumes) {
  Argv args({"--model", "m", "--port=8080", "--timeout-seconds", "0.5", "--tls",
             "true"});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  EXPECT_FALSE(flags.help_requested());
  EXPECT_TRUE(flags.Has("model"));
  const Parsed p = LookUp(flags);
  EXPECT_EQ(p.model, "m");
  EXPECT_EQ(p.port, 8080);
  EXPECT_DOUBLE_EQ(p.timeout, 0.5);
  EXPECT_TRUE(p.tls);
  EXPECT_EQ(p.token_file, "");
  EXPECT_FALSE(flags.Has("model"));  // consumed
  EXPECT_TRUE(flags.Check().ok());
}

TEST(CommandLineFlagsTest, DefaultsWhenAbsent) {
  Argv args({});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  const Parsed p = LookUp(flags);
  EXPECT_EQ(p.port, 50051);
  EXPECT_DOUBLE_EQ(p.timeout, 2.5);
  EXPECT_FALSE(p.tls);
  EXPECT_TRUE(flags.Check().ok());
}

TEST(CommandLineFlagsTest, HelpTakesNoValue) {
  for (const char* help : {"--help", "-h"}) {
    Argv args({"--port", "1", help});
    CommandLineFlags flags;
    ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok()) << help;
    EXPECT_TRUE(flags.help_requested()) << help;
    EXPECT_EQ(LookUp(flags).port, 1) << help;
  }
  // Help first, with flags after it: those still parse.
  Argv args({"-h", "--model", "x"});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  EXPECT_TRUE(flags.help_requested());
  EXPECT_EQ(LookUp(flags).model, "x");
}

TEST(CommandLineFlagsTest, HelpWinsOverParseErrors) {
  Argv args({"stray", "--help", "--port"});
  CommandLineFlags flags;
  EXPECT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  EXPECT_TRUE(flags.help_requested());
}

TEST(CommandLineFlagsTest, ErrorsWithoutHelp) {
  {
    Argv args({"stray"});
    CommandLineFlags flags;
    EXPECT_EQ(flags.Parse(args.argc(), args.argv()).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    Argv args({"--port"});
    CommandLineFlags flags;
    const absl::Status s = flags.Parse(args.argc(), args.argv());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("--port needs a value"), std::string::npos) << s;
  }
  {
    // -h is help only as a whole word; -x is an unexpected argument.
    Argv args({"-x"});
    CommandLineFlags flags;
    EXPECT_FALSE(flags.Parse(args.argc(), args.argv()).ok());
  }
}

TEST(CommandLineFlagsTest, UnknownFlagIsAnErrorWithoutHelp) {
  Argv args({"--model", "m", "--bogus", "1"});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  EXPECT_FALSE(flags.help_requested());
  LookUp(flags);
  const absl::Status s = flags.Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unknown flag --bogus"), std::string::npos) << s;
}

TEST(CommandLineFlagsTest, BadValuesAreErrors) {
  {
    Argv args({"--port", "eighty"});
    CommandLineFlags flags;
    ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
    LookUp(flags);
    const absl::Status s = flags.Check();
    EXPECT_NE(s.message().find("--port: 'eighty' is not a number"),
              std::string::npos)
        << s;
  }
  {
    Argv args({"--tls", "maybe"});
    CommandLineFlags flags;
    ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
    LookUp(flags);
    EXPECT_FALSE(flags.Check().ok());
  }
  for (const char* on : {"1", "7", "yes", "ON", "true"}) {
    Argv args({"--tls", on});
    CommandLineFlags flags;
    ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
    EXPECT_TRUE(LookUp(flags).tls) << on;
    EXPECT_TRUE(flags.Check().ok()) << on;
  }
  for (const char* off : {"0", "no", "false", "off"}) {
    Argv args({"--tls", off});
    CommandLineFlags flags;
    ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
    EXPECT_FALSE(LookUp(flags).tls) << off;
  }
}

TEST(CommandLineFlagsTest, UsageListsEveryFlagByGroupWithDefaults) {
  Argv args({"--help"});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  LookUp(flags);
  const std::string usage =
      flags.Usage("prog --model PATH [flags]", "Notes go last.");
  EXPECT_EQ(usage.rfind("usage: prog --model PATH [flags]\n", 0), 0u) << usage;
  // Groups in the order first named, each flag under its own group.
  const size_t model = usage.find("\nModel:\n");
  const size_t network = usage.find("\nNetwork:\n");
  const size_t security = usage.find("\nSecurity:\n");
  ASSERT_NE(model, std::string::npos) << usage;
  ASSERT_NE(network, std::string::npos) << usage;
  ASSERT_NE(security, std::string::npos) << usage;
  EXPECT_LT(model, network);
  EXPECT_LT(network, security);
  EXPECT_GT(usage.find("\n  --model"), model);
  EXPECT_LT(usage.find("\n  --model"), network);
  EXPECT_GT(usage.find("\n  --port"), network);
  EXPECT_LT(usage.find("\n  --port"), security);
  EXPECT_GT(usage.find("\n  --tls"), security);
  // Meanings and defaults as given; "(none)" for an empty string; a shown
  // default overrides.
  EXPECT_NE(usage.find("The model folder. [default: (none)]"),
            std::string::npos)
      << usage;
  EXPECT_NE(usage.find("The gRPC port. [default: 50051]"), std::string::npos)
      << usage;
  EXPECT_NE(usage.find("How long to wait. [default: 2.5]"), std::string::npos)
      << usage;
  EXPECT_NE(usage.find("Serve over TLS. [default: 0]"), std::string::npos)
      << usage;
  EXPECT_NE(usage.find("[default: (none: no token)]"), std::string::npos)
      << usage;
  EXPECT_NE(usage.find("\nNotes go last.\n"), std::string::npos) << usage;
  // Every flag line carries its meaning on the same line.
  int flag_lines = 0;
  for (const std::string& line : Lines(usage)) {
    if (line.rfind("  --", 0) != 0) continue;
    ++flag_lines;
    const size_t name_end = line.find(' ', 2);
    ASSERT_NE(name_end, std::string::npos) << line;
    EXPECT_NE(line.find_first_not_of(' ', name_end), std::string::npos) << line;
  }
  EXPECT_EQ(flag_lines, 5);
}

TEST(CommandLineFlagsTest, UsageWrapsLongMeaningsToEightyColumns) {
  Argv args({});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  flags.Group("Scheduling");
  std::string help;
  for (int i = 0; i < 40; ++i) help += "word" + std::to_string(i) + " ";
  flags.Num<int>("max-running", 64, help);
  flags.Num<int>("a-much-longer-flag-name-than-the-column", 1, help);
  const std::string usage = flags.Usage("prog");
  for (const std::string& line : Lines(usage)) {
    EXPECT_LE(line.size(), 80u) << line;
  }
  // Nothing lost: every word is there, the default last and in one piece.
  EXPECT_NE(usage.find("word39 [default: 64]"), std::string::npos) << usage;
  EXPECT_NE(usage.find("[default: 1]\n"), std::string::npos) << usage;
  // Continuation lines are indented under the meaning.
  const std::vector<std::string> lines = Lines(usage);
  bool continued = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    if (lines[i - 1].find("--max-running") != std::string::npos) {
      const size_t column = lines[i - 1].find("word0");
      EXPECT_EQ(lines[i].find_first_not_of(' '), column) << usage;
      continued = true;
    }
  }
  EXPECT_TRUE(continued) << usage;
}

// A default longer than the room after the meaning column (an absolute
// path under a deep checkout) moves left instead of past column 80.
TEST(CommandLineFlagsTest, LongDefaultMovesLeftToStayInEightyColumns) {
  Argv args({});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  flags.Group("Model");
  const std::string path =
      "/check/work/shared/models/bench-configs/llama-110m.json";
  const std::string longer_path =
      "/check/work/shared/models/bench-configs/a-model-with-a-long-name.json";
  flags.Str("model", path, "Model every cluster loads.");
  flags.Str("draft", longer_path, "Draft model.");
  flags.Str("perf-model", "", "A saved profile.");
  const std::string usage = flags.Usage("prog");
  for (const std::string& line : Lines(usage)) {
    EXPECT_LE(line.size(), 80u) << line;
  }
  EXPECT_NE(usage.find("[default: " + path + "]\n"), std::string::npos)
      << usage;
  // Longer than any line: the value goes on the line after "[default:".
  EXPECT_NE(usage.find(longer_path + "]\n"), std::string::npos) << usage;
  EXPECT_NE(usage.find("[default:\n"), std::string::npos) << usage;
}

TEST(CommandLineFlagsTest, FlagLookedUpTwiceIsListedOnce) {
  Argv args({});
  CommandLineFlags flags;
  ASSERT_TRUE(flags.Parse(args.argc(), args.argv()).ok());
  flags.Str("host", "127.0.0.1", "Interface to listen on.");
  flags.Str("host", "0.0.0.0", "Again.");
  const std::string usage = flags.Usage("prog");
  EXPECT_EQ(usage.find("--host"), usage.rfind("--host")) << usage;
  // Without a group the flags are listed under "Flags".
  EXPECT_NE(usage.find("\nFlags:\n"), std::string::npos) << usage;
}

}  // namespace
}  // namespace pdserve
