// cli::Parse (common/cli.h): a flag given more than once takes its last occurrence, as argparse
// does, a list flag its whole last list; a Repeatable flag adds up.
#include <gtest/gtest.h>

#include <limits>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/cli.h"

namespace ptk {
namespace {

// Parses `args` (without the program name); returns Parse's result.
std::optional<int> ParseArgs(CLI::App& app, std::vector<std::string> args) {
  args.insert(args.begin(), "ptk-x");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return cli::Parse(app, static_cast<int>(argv.size()), argv.data());
}

struct Flags {
  int64_t doc = -1, offset = 0;
  uint64_t size = 0;
  bool verify = false;
  std::string format = "both";
  std::vector<std::string> inputs, drop;
};

// Parse's result for `args` and what it wrote to stderr.
struct Parsed {
  std::optional<int> rc;
  std::string err;
};
Parsed ParseCapturingStderr(CLI::App& app, std::vector<std::string> args) {
  testing::internal::CaptureStderr();
  std::optional<int> rc = ParseArgs(app, std::move(args));
  return {rc, testing::internal::GetCapturedStderr()};
}

std::unique_ptr<CLI::App> MakeTestApp(Flags& f) {
  auto app = cli::MakeApp("ptk-x", "test");
  app->add_option("--doc", f.doc, "a number")->check(cli::IntIn(0, std::numeric_limits<int64_t>::max()));
  app->add_option("--offset", f.offset, "a signed number");
  app->add_option("--size", f.size, "an unsigned number");
  app->add_flag("--verify", f.verify, "a flag");
  app->add_option("--format", f.format, "a choice")->check(CLI::IsMember({"ids", "text", "both"}));
  app->add_option("--input", f.inputs, "a list");
  cli::Repeatable(app->add_option("--drop-set", f.drop, "repeatable"));
  return app;
}

// ptk-inspect refused --doc 1 --doc 2 ("At Most 1 required but received 2"), while ptk-train took
// the last value.
TEST(CliParse, AFlagGivenTwiceTakesTheLastValueAsArgparse) {
  Flags f;
  auto app = MakeTestApp(f);
  const auto [rc, err] = ParseCapturingStderr(
      *app, {"--doc", "1", "--verify", "--format=ids", "--doc", "2", "--verify", "--form", "text"});
  EXPECT_EQ(rc, std::nullopt);
  EXPECT_EQ(f.doc, 2);
  EXPECT_TRUE(f.verify);
  EXPECT_EQ(f.format, "text");
  // Named, with its abbreviation counted as the flag.
  EXPECT_NE(err.find("--doc given 2 times: only the last counts (as in argparse)"), std::string::npos) << err;
  EXPECT_NE(err.find("--format given 2 times"), std::string::npos) << err;
}

// ptk-tokenize --input a --input b read both (ptk-inspect's --data-path too); argparse, and
// ptk-train, take the last list.
TEST(CliParse, AListGivenTwiceTakesTheLastListAsArgparse) {
  Flags f;
  auto app = MakeTestApp(f);
  const auto [rc, err] = ParseCapturingStderr(*app, {"--input", "a", "b", "--doc", "1", "--input", "c", "d"});
  EXPECT_EQ(rc, std::nullopt);
  EXPECT_EQ(f.inputs, (std::vector<std::string>{"c", "d"}));
  EXPECT_NE(err.find("--input given 2 times"), std::string::npos) << err;
  EXPECT_EQ(err.find("--doc"), std::string::npos) << err;
}

TEST(CliParse, ARepeatableFlagAddsUpWithoutAWarning) {
  Flags f;
  auto app = MakeTestApp(f);
  const auto [rc, err] = ParseCapturingStderr(*app, {"--drop-set", "A", "--drop-set", "B", "C"});
  EXPECT_EQ(rc, std::nullopt);
  EXPECT_EQ(f.drop, (std::vector<std::string>{"A", "B", "C"}));
  EXPECT_EQ(err, "");
}

// A tool with subcommands, as ptk-concat: the tool and `run` both have --plan and --jobs, `list`
// has a repeatable --with and `run` a --with taking one value; the tool has --chunks, `run`
// --chunk-index. A flag is counted per (sub)command: the tool's --plan and run's are two flags.
struct SubFlags {
  std::string top_plan, run_plan, run_with;
  int top_jobs = 1, run_jobs = 1, chunks = 0, chunk_index = -1;
  std::vector<std::string> list_with;
};
std::unique_ptr<CLI::App> MakeSubcommandApp(SubFlags& f) {
  auto app = cli::MakeApp("ptk-x", "test");
  app->add_option("--plan", f.top_plan, "plan");
  app->add_option("--jobs", f.top_jobs, "jobs");
  app->add_option("--chunks", f.chunks, "chunks");
  auto* run = app->add_subcommand("run", "run");
  run->add_option("--plan", f.run_plan, "plan");
  run->add_option("--jobs", f.run_jobs, "jobs");
  run->add_option("--chunk-index", f.chunk_index, "chunk");
  run->add_option("--with", f.run_with, "one value");
  auto* list = app->add_subcommand("list", "list");
  cli::Repeatable(list->add_option("--with", f.list_with, "repeatable"));
  return app;
}

TEST(CliParse, AFlagIsCountedPerSubcommand) {
  {  // the tool's --plan and --jobs, then run's: once each, no warning
    SubFlags f;
    auto app = MakeSubcommandApp(f);
    const auto [rc, err] = ParseCapturingStderr(*app, {"--plan", "a", "--jobs", "2", "run", "--plan", "b", "--jobs=3"});
    EXPECT_EQ(rc, std::nullopt);
    EXPECT_EQ(err, "");
    EXPECT_EQ(f.top_plan, "a");
    EXPECT_EQ(f.run_plan, "b");
    EXPECT_EQ(f.run_jobs, 3);
  }
  {  // run's --with (one value) given twice is named with its subcommand; list's adds up
    SubFlags f;
    auto app = MakeSubcommandApp(f);
    const auto [rc, err] = ParseCapturingStderr(*app, {"run", "--with", "x", "--with", "y"});
    EXPECT_EQ(rc, std::nullopt);
    EXPECT_NE(err.find("run --with given 2 times: only the last counts"), std::string::npos) << err;
    EXPECT_EQ(f.run_with, "y");
  }
  {
    SubFlags f;
    auto app = MakeSubcommandApp(f);
    const auto [rc, err] = ParseCapturingStderr(*app, {"list", "--with", "x", "--with", "y"});
    EXPECT_EQ(rc, std::nullopt);
    EXPECT_EQ(err, "");
    EXPECT_EQ(f.list_with, (std::vector<std::string>{"x", "y"}));
  }
  {  // a value that is a subcommand's name is a value; a prefix is run's own flag (not also --chunks)
    SubFlags f;
    auto app = MakeSubcommandApp(f);
    const auto [rc, err] = ParseCapturingStderr(*app, {"--plan", "list", "run", "--chunk", "5", "--plan", "p"});
    EXPECT_EQ(rc, std::nullopt);
    EXPECT_EQ(err, "");
    EXPECT_EQ(f.top_plan, "list");
    EXPECT_EQ(f.chunk_index, 5);
    EXPECT_EQ(f.run_plan, "p");
  }
}

// A value outside a flag's choices (--format id, ptk-convert --loader megatorn) gets the choice meant, as
// an unknown flag gets the flag meant; one far from every choice gets none.
TEST(CliParse, AChoiceNearAnotherSuggestsIt) {
  Flags f;
  auto app = MakeTestApp(f);
  Parsed near = ParseCapturingStderr(*app, {"--format", "id"});
  EXPECT_EQ(near.rc, cli::kExitUsage);
  EXPECT_NE(near.err.find("usage error: --format: id not in {ids,text,both}; did you mean ids?\n"), std::string::npos)
      << near.err;
  Flags g;
  auto app2 = MakeTestApp(g);
  Parsed far = ParseCapturingStderr(*app2, {"--format", "json"});
  EXPECT_EQ(far.rc, cli::kExitUsage);
  EXPECT_NE(far.err.find("usage error: --format: json not in {ids,text,both}\n"), std::string::npos) << far.err;
}

// Regression: ptk-train --rank suggested --save, and --world-size --vocab-size: NearestNames gave a name one
// edit past its limit when none was nearer, and four letters allowed two edits. Now a typo is within a
// quarter of the name's letters (one at least; a swap of two is one edit), '_' is read as '-', and a
// name that is part of one flag's (--layers) suggests that flag.
TEST(CliParse, AnUnknownFlagSuggestsOnlyAFlagItIsNear) {
  const std::vector<std::string> flags = {
      "--save",        "--seed",       "--local-rank",         "--q-lora-rank", "--vocab-size",
      "--hidden-size", "--num-layers", "--encoder-num-layers", "--seq-length",  "--num-attention-heads"};
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--rank", ""},
      {"--world-size", ""},
      {"--size", ""},
      {"--heads", ""},
      {"--svae", "--save"},
      {"--sed", "--seed"},
      {"--local_rank", "--local-rank"},
      {"--Hidden_Size", "--hidden-size"},
      {"--seq-lenght", "--seq-length"},
      {"--layers", "--num-layers"},
      {"--attention-heads", "--num-attention-heads"},
  };
  for (const auto& [name, want] : cases) EXPECT_EQ(cli::NearestFlagName(name, flags), want) << name;
  // Regression: ptk-merge --input-prefix suggested --output-prefix (three edits in twelve letters), the
  // flag naming what it writes for one meant to name what it reads: "input" is a word of its flags, so
  // trading it for another is no typo. A misspelt word next to it still is.
  const std::vector<std::string> merge = {"--input",      "--inputs", "--output-prefix",
                                          "--multimodal", "--quiet",  "--force"};
  EXPECT_EQ(cli::NearestFlagName("--input-prefix", merge), "");
  EXPECT_EQ(cli::NearestFlagName("--output-prefx", merge), "--output-prefix");
  EXPECT_EQ(cli::NearestFlagName("--ouput-prefix", merge), "--output-prefix");
  EXPECT_EQ(cli::NearestFlagName("--inptus", merge), "--inputs");
  EXPECT_EQ(cli::NearestFlagName("--micro-batch-sizes", {"--micro-batch-size", "--sizes"}), "--micro-batch-size");
  // Regression: ptk-train --iters suggested --eval-iters, the flag that adds least to the name, one letter
  // less than --train-iters, the one a user means. A part of names is suggested only when one flag is
  // clearly nearest: it adds at most half what any other flag holding it adds.
  const std::vector<std::string> iters = {"--eval-iters",          "--train-iters",    "--lr-warmup-iters",
                                          "--ft-num-warmup-iters", "--hidden-dropout", "--attention-dropout",
                                          "--num-layers",          "--mtp-num-layers"};
  EXPECT_EQ(cli::NearestFlagName("--iters", iters), "");
  EXPECT_EQ(cli::NearestFlagName("--dropout", iters), "");
  EXPECT_EQ(cli::NearestFlagName("--warmup-iters", iters), "--lr-warmup-iters");
  EXPECT_EQ(cli::NearestFlagName("--layers", iters), "--num-layers");
  EXPECT_EQ(cli::EditDistance("rank", "save"), 3u);
  EXPECT_EQ(cli::EditDistance("svae", "save"), 1u);
  EXPECT_EQ(cli::NearestNames("--rank", flags, 2), std::vector<size_t>{});
  EXPECT_EQ(cli::NearestNames("--svae", flags, 1), std::vector<size_t>{0});
}

// A tool's hint for a flag it does not have (ptk-train's --rank: the launcher's environment) replaces
// the suggestion, for the flag spelt with '_' or one dash too.
TEST(CliParse, AnUnknownFlagWithAHintGetsTheHint) {
  const cli::UnknownFlagHints hints = {{"--master-port", "MASTER_PORT is read from the environment"}};
  for (const char* given : {"--master-port", "--master_port", "-master-port", "--master-port=29500"}) {
    Flags f;
    auto app = MakeTestApp(f);
    std::vector<std::string> args = {"ptk-x", given, "29500"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    testing::internal::CaptureStderr();
    const std::optional<int> rc = cli::Parse(*app, static_cast<int>(argv.size()), argv.data(), hints);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, cli::kExitUsage) << given;
    const std::string flag = std::string(given).substr(0, std::string(given).find('='));
    EXPECT_NE(err.find("usage error: unknown flag " + flag + ": MASTER_PORT is read from the environment\n"),
              std::string::npos)
        << err;
  }
  Flags f;
  auto app = MakeTestApp(f);
  Parsed none = ParseCapturingStderr(*app, {"--master-port", "29500"});  // no hints: no guess either
  EXPECT_NE(none.err.find("usage error: unknown flag --master-port\n"), std::string::npos) << none.err;
}

// Regression: bare words no flag takes (a file or a repo id given as huggingface-cli download and most Unix
// tools take them) were "The following arguments were not expected: b a" (reversed, nothing to do), or only
// "--input is required" when the input itself was the bare word. They are named in order, with the flag meant.
TEST(CliParse, BareWordsAreNamedInOrderWithTheFlagMeant) {
  Flags f;
  auto app = MakeTestApp(f);
  Parsed two = ParseCapturingStderr(*app, {"a.jsonl", "--verify", "b.jsonl"});
  EXPECT_EQ(two.rc, cli::kExitUsage);
  EXPECT_NE(two.err.find("usage error: a.jsonl b.jsonl were given without a flag (ptk-x takes every value after its "
                         "flag); did you mean --input a.jsonl b.jsonl?\n"),
            std::string::npos)
      << two.err;
  // The input given, a stray word is only named.
  Flags g;
  auto app2 = MakeTestApp(g);
  Parsed stray = ParseCapturingStderr(*app2, {"--input", "a.jsonl", "--verify", "extra"});
  EXPECT_EQ(stray.rc, cli::kExitUsage);
  EXPECT_NE(stray.err.find("usage error: extra was given without a flag (ptk-x takes every value after its flag)\n"),
            std::string::npos)
      << stray.err;
  // A required flag missing: named first, then the word, with the one flag it can be.
  std::string repo, dir;
  auto app3 = cli::MakeApp("ptk-x", "test");
  app3->add_option("--repo", repo, "the repo");
  app3->add_option("--local-dir", dir, "where")->required();
  Parsed req = ParseCapturingStderr(*app3, {"org/name"});
  EXPECT_EQ(req.rc, cli::kExitUsage);
  EXPECT_NE(req.err.find("usage error: --local-dir is required: org/name was given without a flag (ptk-x takes every "
                         "value after its flag); did you mean --repo org/name?\n"),
            std::string::npos)
      << req.err;
  // A tool with a bare argument of its own says which it is.
  std::string prefix;
  auto app4 = cli::MakeApp("ptk-x", "test");
  app4->add_option("prefix", prefix, "the dataset");
  Parsed pos = ParseCapturingStderr(*app4, {"a", "b"});
  EXPECT_EQ(pos.rc, cli::kExitUsage);
  EXPECT_NE(pos.err.find("usage error: b was given without a flag (ptk-x's bare argument is its prefix; every other "
                         "value goes after its flag)\n"),
            std::string::npos)
      << pos.err;
}

TEST(CliParse, AnEarlierBadValueIsStillAUsageError) {
  Flags f;
  auto app = MakeTestApp(f);
  const auto [rc, err] = ParseCapturingStderr(*app, {"--doc", "-1", "--doc", "2"});
  EXPECT_EQ(rc, cli::kExitUsage);
  EXPECT_NE(err.find("--doc: must be an integer in [0, 9223372036854775807], not \"-1\""), std::string::npos) << err;
}

// strtoll and strtoull, under CLI11, saturate a number too large for the type and wrap a negative
// one: --doc 99999999999999999999 was taken as 9223372036854775807, an unsigned -1 as 2**64 - 1.
TEST(CliParse, AnIntegerOutsideItsTypeIsAUsageError) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--doc", "99999999999999999999"}, "--doc: must be an integer in [0, 9223372036854775807], not \"9999"},
      {{"--offset", "9223372036854775808"}, "--offset: \"9223372036854775808\" is out of range"},
      {{"--offset", "-9223372036854775809"}, "--offset: \"-9223372036854775809\" is out of range"},
      {{"--size", "-1"}, "--size: \"-1\" is negative (the flag takes a number >= 0)"},
      {{"--size", "18446744073709551616"},
       "--size: \"18446744073709551616\" is too large (at most 18446744073709551615)"},
  };
  for (const auto& [args, expected] : cases) {
    Flags f;
    auto app = MakeTestApp(f);
    const auto [rc, err] = ParseCapturingStderr(*app, args);
    EXPECT_EQ(rc, cli::kExitUsage) << args[1];
    EXPECT_NE(err.find(expected), std::string::npos) << err;
  }
  Flags f;
  auto app = MakeTestApp(f);
  EXPECT_EQ(ParseArgs(*app, {"--doc", "9223372036854775807", "--size", "18446744073709551615"}), std::nullopt);
  EXPECT_EQ(f.doc, 9223372036854775807);
  EXPECT_EQ(f.size, 18446744073709551615u);
  EXPECT_EQ(ParseArgs(*app, {"--offset", "-9223372036854775808", "--size", "+7"}), std::nullopt);
  EXPECT_EQ(f.offset, std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f.size, 7u);
}

// Every numeric flag carries its range (cli::IntIn, cli::RealIn): a value outside it, one a double
// cannot hold, inf, nan or an integer too large for any type is refused in one line naming the flag
// and the range. ptk-tokenize --max-bad-fraction 1e400 said "must be a number >= 0" (which 1e400 is),
// 1e-400 was taken as 0, --workers 99999999999 said "Could not convert".
struct RangeFlags {
  double fraction = 0, seconds = 1;
  int count = 1;
};
std::unique_ptr<CLI::App> MakeRangeApp(RangeFlags& r) {
  auto app = cli::MakeApp("ptk-x", "test");
  app->add_option("--fraction", r.fraction, "a fraction")->check(cli::RealIn(0, false, 1, false));
  app->add_option("--seconds", r.seconds, "a duration")->check(cli::Positive());
  app->add_option("--count", r.count, "a count")->check(cli::IntIn(1, cli::kMaxInt));
  return app;
}

TEST(CliRange, AValueOutsideTheRangeNamesTheFlagAndTheRange) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"--fraction", "1e400"}, "--fraction: must be a number in [0, 1], not \"1e400\" (beyond a double's range)\n"},
      {{"--fraction", "1e-400"}, "--fraction: must be a number in [0, 1], not \"1e-400\" (below a double's range)\n"},
      {{"--fraction", "inf"}, "--fraction: must be a number in [0, 1], not \"inf\"\n"},
      {{"--fraction", "-inf"}, "--fraction: must be a number in [0, 1], not \"-inf\"\n"},
      {{"--fraction", "nan"}, "--fraction: must be a number in [0, 1], not \"nan\"\n"},
      {{"--fraction", "1.5"}, "--fraction: must be a number in [0, 1], not \"1.5\"\n"},
      {{"--seconds", "1e400"}, "--seconds: must be a finite number > 0, not \"1e400\" (beyond a double's range)\n"},
      {{"--seconds", "-0"}, "--seconds: must be a finite number > 0, not \"-0\"\n"},
      {{"--count", "-0"}, "--count: must be an integer in [1, 2147483647], not \"-0\"\n"},
      {{"--count", "99999999999"}, "--count: must be an integer in [1, 2147483647], not \"99999999999\"\n"},
      {{"--count", "99999999999999999999999"},
       "--count: must be an integer in [1, 2147483647], not \"99999999999999999999999\"\n"},
      {{"--count", "1e3"}, "--count: must be an integer in [1, 2147483647], not \"1e3\"\n"},
  };
  for (const auto& [args, expected] : cases) {
    RangeFlags r;
    auto app = MakeRangeApp(r);
    const auto [rc, err] = ParseCapturingStderr(*app, args);
    EXPECT_EQ(rc, cli::kExitUsage) << args[1];
    EXPECT_EQ(err, "ptk-x: usage error: " + expected + "Run with --help for more information.\n") << args[1];
  }
  RangeFlags r;
  auto app = MakeRangeApp(r);
  EXPECT_EQ(ParseArgs(*app, {"--fraction", "-0", "--seconds", "1e-300", "--count", "2147483647"}), std::nullopt);
  EXPECT_EQ(r.fraction, 0.0);
  EXPECT_EQ(r.seconds, 1e-300);
  EXPECT_EQ(r.count, 2147483647);
}

// The option table check (PTK_CHECK_OPTIONS=1, run on every tool by option_tables_test.sh) refuses
// a numeric flag declared without its range, and an integer one given a range of reals (which
// would let 1.5 or 99999999999 through to CLI11's conversion).
TEST(CliRange, TheOptionTableCheckRefusesANumericFlagWithoutARange) {
  int workers = 1;
  double fraction = 0;
  auto app = cli::MakeApp("ptk-x", "test");
  app->add_option("--workers", workers, "threads")->check(cli::Positive());
  app->add_option("--fraction", fraction, "a fraction");
  const absl::Status st = cli::CheckOptionTable(*app);
  EXPECT_EQ(std::string(st.message()),
            "ptk-x: integer option --workers has a range of reals (a finite number > 0): give it cli::IntIn; numeric "
            "option --fraction has no range (cli::IntIn, cli::RealIn)");
  auto good = cli::MakeApp("ptk-y", "test");
  good->add_option("--workers", workers, "threads")->check(cli::IntIn(1, 64));
  good->add_option("--fraction", fraction, "a fraction")->check(cli::RealIn(0, false, 1, false));
  EXPECT_TRUE(cli::CheckOptionTable(*good).ok());
}

// A flag of a fixed number of values (ptk-train's --rampup-batch-size START INCR SAMPLES) given more or
// fewer: CLI11 kept the last three of four and took one or two (then read past the end).
TEST(CliParse, AFixedCountListGivenAnotherCountIsAUsageError) {
  for (const auto& [args, ok] :
       std::vector<std::pair<std::vector<std::string>, bool>>{{{"--ramp", "2", "2", "8"}, true},
                                                              {{"--ramp", "2", "2", "8", "--doc", "1"}, true},
                                                              {{"--ramp", "2", "2", "8", "4"}, false},
                                                              {{"--ramp", "2", "2"}, false},
                                                              {{"--ramp", "2", "--doc", "1"}, false},
                                                              {{"--ra", "2", "2", "8", "4"}, false}}) {
    Flags f;
    std::vector<int64_t> ramp;
    auto app = MakeTestApp(f);
    app->add_option("--ramp", ramp, "three numbers")->expected(3);
    const auto [rc, err] = ParseCapturingStderr(*app, args);
    if (ok) {
      EXPECT_EQ(rc, std::nullopt) << err;
      EXPECT_EQ(ramp, (std::vector<int64_t>{2, 2, 8}));
    } else {
      EXPECT_EQ(rc, std::optional<int>(2)) << args.size();
      EXPECT_NE(err.find("usage error: --ramp 2"), std::string::npos) << err;
      EXPECT_NE(err.find(": takes 3 values, not "), std::string::npos) << err;
    }
  }
}

// --help showed "--doc INT:NONNEGATIVE=-1" and ptk-train "--ffn-hidden-size INT:an integer in [1, ...]=0": a
// default the option itself refuses (a sentinel for "not given") read as a real default. Not shown; a
// default the check accepts still is.
TEST(CliParse, HelpShowsNoDefaultTheOptionsCheckRefuses) {
  Flags f;
  int64_t chunks = 72, per_chunk = 0;
  auto app = MakeTestApp(f);
  app->add_option("--chunks", chunks, "balanced")->check(cli::IntIn(1, 100));
  app->add_option("--files-per-chunk", per_chunk, "groups")->check(cli::IntIn(1, 100));
  testing::internal::CaptureStdout();
  EXPECT_EQ(ParseArgs(*app, {"--help"}), cli::kExitOk);
  const std::string help = testing::internal::GetCapturedStdout();
  EXPECT_EQ(help.find("=-1"), std::string::npos) << help;
  EXPECT_EQ(help.find("100]=0"), std::string::npos) << help;
  EXPECT_NE(help.find("--doc INT:an integer in [0, 9223372036854775807]\n"), std::string::npos) << help;
  EXPECT_NE(help.find("--files-per-chunk INT:an integer in [1, 100]\n"), std::string::npos) << help;
  EXPECT_NE(help.find("--chunks INT:an integer in [1, 100]=72"), std::string::npos) << help;
  EXPECT_NE(help.find("--format TEXT:{ids,text,both}=both"), std::string::npos) << help;
  EXPECT_NE(help.find("--offset INT=0"), std::string::npos) << help;  // no check: 0 is the default
}

// ptk-train --help showed "--check-for-nan-in-loss-and-grad, --no-check-for-nan-in-loss-and-grad{false}":
// CLI11 annotates a negated flag with the value it sets, which read as "off by default". A flag's
// names show bare (its help text says what it does); a valued option's default still shows.
TEST(CliParse, HelpShowsFlagsWithoutTheValueTheySet) {
  auto help_of = [](std::vector<std::string> args) {
    Flags f;
    bool nan_check = true, log_scale = true;
    auto app = MakeTestApp(f);
    app->add_flag("--check-nan,!--no-check-nan", nan_check, "check");
    app->add_flag("!--no-log-scale", log_scale, "log");
    app->add_subcommand("sub", "a subcommand")->add_flag("--keep,!--no-keep", f.verify, "keep");
    testing::internal::CaptureStdout();
    EXPECT_EQ(ParseArgs(*app, std::move(args)), cli::kExitOk);
    return testing::internal::GetCapturedStdout();
  };
  const std::string help = help_of({"--help"}) + help_of({"sub", "--help"});
  EXPECT_EQ(help.find("{false}"), std::string::npos) << help;
  EXPECT_EQ(help.find("{true}"), std::string::npos) << help;
  EXPECT_NE(help.find("--check-nan,--no-check-nan "), std::string::npos) << help;
  EXPECT_NE(help.find("--no-log-scale "), std::string::npos) << help;
  EXPECT_NE(help.find("--keep,--no-keep "), std::string::npos) << help;
  EXPECT_NE(help.find("--format TEXT:{ids,text,both}=both"), std::string::npos) << help;
  EXPECT_NE(help.find("--offset INT=0"), std::string::npos) << help;
}

// A tool whose run asks for more memory than there is ends in one line saying so, exit 1 (was
// "unexpected exception: std::bad_alloc").
TEST(CliRunMain, OutOfMemoryIsNamed) {
  ::testing::internal::CaptureStderr();
  const int rc = cli::RunMain([]() -> absl::Status { throw std::bad_alloc(); });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("out of memory: an allocation failed (std::bad_alloc)"), std::string::npos) << err;
  EXPECT_EQ(err.find("unexpected exception"), std::string::npos) << err;
}

}  // namespace
}  // namespace ptk
