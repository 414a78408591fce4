// Command-line conventions shared by every tool (CLI11 underneath): one option table per tool,
// exit codes 0 ok / 1 failure / 2 usage, one clear error line.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "common/status.h"
#include "common/version.h"  // VersionString, BuildDescription

namespace ptk::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitDiskFull = 3;

// Creates an App with ptk's formatting conventions and a --version flag.
std::unique_ptr<CLI::App> MakeApp(const std::string& name, const std::string& description);

// Parses argv. Returns nullopt to continue, or the exit code to return (0 after --help/--version,
// kExitUsage after a usage error, which is printed as one line plus a hint). Long flags are read
// as Python's argparse reads them (unambiguous prefixes, --flag=value); an unknown one, or a long
// flag written with one dash (-input), is a usage error suggesting the flag meant. A flag given
// more than once takes its last occurrence, as argparse does, a list flag its last list too
// (--input a b --input c reads c), with a warning naming it; only a flag made Repeatable adds up.
// With the environment variable PTK_CHECK_OPTIONS=1 it runs CheckOptionTable instead and returns 0 or 1.
// What a tool says of a flag it does not have that users give it anyway ("--rank": the rank comes
// from the launcher's environment), keyed by the flag with '-' between words; Parse prints it for
// that unknown flag (spelt with '_' too) in place of a suggestion.
using UnknownFlagHints = std::map<std::string, std::string>;

// `hints`: what to say of an unknown flag instead of a suggestion.
std::optional<int> Parse(CLI::App& app, int argc, char** argv, const UnknownFlagHints& hints = {});

// Edit distance (insertions, deletions, substitutions, and swaps of two neighbours: optimal string
// alignment): how near a misspelt flag or path is to the one meant, for "did you mean ...?".
size_t EditDistance(const std::string& a, const std::string& b);

// The indices of the `candidates` at the least edit distance from `name`, in their order, when that
// distance is at most `most`; none otherwise.
std::vector<size_t> NearestNames(const std::string& name, const std::vector<std::string>& candidates, size_t most);
// The first of NearestNames' candidates, or "" when there is none.
std::string NearestName(const std::string& name, const std::vector<std::string>& candidates, size_t most);

// The flag among `flags` an unknown `name` most likely meant, or "": case and '_' for '-' aside, one
// within a quarter of its letters in edits (at least one: --svae for --save, not --rank for --save) that
// trades none of its words the flags use for a word more than an edit away (--input-prefix is not
// --output-prefix), else the one flag holding its words that adds the least to them, no more than they
// are long and at most half what any other holder adds (--layers for --num-layers; --size names none of
// the many that end in it, --iters neither --eval-iters nor --train-iters).
std::string NearestFlagName(const std::string& name, const std::vector<std::string>& flags);

// CLI11's "--loader: megatorn not in {ptk,hf,megatron}" with the choice most likely meant added
// ("...; did you mean megatron?"), as Parse prints it; any other message as it is.
std::string WithNearestChoice(const std::string& message);
// Parse's message for a parse error `e` of `app`. Bare words that no flag took (a file or repo given
// without its flag, as huggingface-cli download and most Unix tools take them) are named in the order
// given, with the flag they were likely meant for: the one required flag missing, else an input flag
// (--input, --inputs, --repo) not given ("in.jsonl was given without a flag; did you mean --input
// in.jsonl?"). CLI11 said "The following arguments were not expected: b a" (in reverse order), or only
// "--input is required". Any other error as WithNearestChoice says it.
std::string ParseErrorMessage(const CLI::App& app, const CLI::ParseError& e);

// Marks a list option as repeatable (argparse's action="append"): each occurrence adds to the list,
// as ptk-extract's --drop-set A --drop-set B drops both. Its help should say "repeatable".
CLI::Option* Repeatable(CLI::Option* opt);

// Checks the table: every option has a long name and help text, no flag is repeated, and every
// numeric option has a range (IntIn, RealIn) whose ends its variable can hold.
absl::Status CheckOptionTable(const CLI::App& app);

// Option group of flags accepted only to be refused with a reason (Megatron/NeMo flags ptk does
// not implement), and of flags accepted and ignored with a note (Megatron's that change nothing in
// what the tool does). An abbreviation that also matches a supported flag means the supported one.
// The name IntIn and RealIn give their validators (CheckOptionTable looks for it).
inline constexpr const char* kRangeValidator = "ptk-range";
inline constexpr const char* kUnsupportedGroup = "Not supported (accepted to say why)";
inline constexpr const char* kIgnoredGroup = "Accepted and ignored, as Megatron does (noted when given)";
// The option is in kUnsupportedGroup or kIgnoredGroup: it is there for another program's command lines.
bool IsCompatOnly(const CLI::Option& opt);

// Flags of the program a tool replaces that it does not implement, in kUnsupportedGroup: the
// parser accepts them so that using one is a usage error saying why and what to do instead.
class Refusals {
 public:
  explicit Refusals(CLI::App& app) : app_(app) {}
  // `names` as CLI11 takes them ("--chunk_size,--chunk-size"); a flag, or an option with a value.
  void Flag(const std::string& names, std::string why) { Add(app_.add_flag(names), std::move(why)); }
  void Option(const std::string& names, std::string why) { Add(app_.add_option(names)->expected(1), std::move(why)); }
  // An option with one value or more (argparse's nargs='+').
  void List(const std::string& names, std::string why) {
    Add(app_.add_option(names)->expected(1, CLI::detail::expected_max_vector_size)->allow_extra_args(), std::move(why));
  }
  // After parsing: a usage error for the first refused flag given ("--apply-ftfy is not supported: ...").
  absl::Status Check() const;

 private:
  void Add(CLI::Option* opt, std::string why);
  CLI::App& app_;
  std::vector<std::pair<const CLI::Option*, std::string>> refused_;
};

// The type an argparse option converts its value with (type=int; str by default).
enum class ArgType { kStr, kInt };

// Whether `text` is what Python's int() reads in base 10 (argparse's type=int): ASCII whitespace around,
// a sign, decimal digits with single underscores between them ("1_000"); not "1.0", "1e3", "0x10", "".
bool IsPythonInt(const std::string& text);

// Flags of the program a tool replaces that it accepts and ignores there too (in kIgnoredGroup):
// Megatron's preprocess_data.py takes every tokenizer's flags, and its GPT2BPETokenizer reads few.
// Their values are used for nothing, but one that the program's argparse refuses (--vocab-size abc,
// type=int) is refused too: CheckValues.
class IgnoredFlags {
 public:
  // `as`: how the program replaced ignores them ("as Megatron does with GPT2BPETokenizer").
  IgnoredFlags(CLI::App& app, std::string as) : app_(app), as_(std::move(as)) {}
  void Flag(const std::string& names, std::string why) { Add(app_.add_flag(names), std::move(why)); }
  void Option(const std::string& names, std::string why, ArgType type = ArgType::kStr) {
    Add(app_.add_option(names)->expected(1), std::move(why), type);
  }
  // An option with one value or more (argparse's nargs='+'); returned for a tool that checks its values.
  const CLI::Option* List(const std::string& names, std::string why) {
    CLI::Option* opt = app_.add_option(names)->expected(1, CLI::detail::expected_max_vector_size)->allow_extra_args();
    Add(opt, std::move(why));
    return opt;
  }
  // After parsing: a usage error for the first value given that the program's argparse would refuse,
  // in its words ("argument --vocab-size: invalid int value: 'abc' ...").
  absl::Status CheckValues() const;
  // After parsing: a warning line for each one given ("--vocab-size 50257: ignored, as Megatron does
  // with GPT2BPETokenizer: the vocab file defines the size").
  void Note() const;

 private:
  struct Ignored {
    const CLI::Option* opt;
    std::string why;
    ArgType type;
  };
  void Add(CLI::Option* opt, std::string why, ArgType type = ArgType::kStr);
  CLI::App& app_;
  std::string as_;
  std::vector<Ignored> ignored_;
};

// The range every numeric flag carries where it is declared (CheckOptionTable refuses a numeric
// flag without one; CLI11 runs it on the text before converting it). A value outside the range, or
// not a decimal number, is a usage error naming the flag and the range in one line:
// "--workers: must be an integer in [1, 2147483647], not "0"". Refused as well: inf and nan, and a
// real that a double cannot hold (1e400 would be inf, 1e-400 would be 0), and an integer beyond
// the range however many digits it has (strtoll would saturate it).
CLI::Validator IntIn(int64_t lo, int64_t hi);
// A finite number in the range from lo to hi (hi infinite: no upper end), each end open or closed.
CLI::Validator RealIn(double lo, bool lo_open, double hi, bool hi_open);
inline constexpr int64_t kMaxInt = 2147483647;  // the most an int flag holds
inline constexpr double kMaxSeconds = 1e9;      // a duration flag's most (31 years; beyond, clocks overflow)
// --lock-wait SECONDS, on every tool that writes under an output's lock (OutputLock): how long a run keeps
// trying for an output another run is writing before it fails (a line every 10 s naming the output and the
// holder); 0, the default, fails at once. A node that died holding the lock on NFS keeps it for the server's
// lease (~90 s): a requeued task waits that out. Given, it sets *wait (the tool's options carry it to the
// library call that takes the lock: OutputLock::Acquire's `wait`); nothing process-wide.
CLI::Option* AddLockWait(CLI::App& app, std::chrono::milliseconds* wait);
const CLI::Validator& Positive();     // a finite number > 0
const CLI::Validator& NonNegative();  // a finite number >= 0

// An output prefix (--output-prefix): a directory, then the start of the file names. One that ends
// in '/' (or names . or ..) has no file name part, and would write hidden files such as
// outdir/_text_document.bin: a usage error showing what to give. `example_suffix` is what the tool
// appends ("_text_document.bin").
absl::Status CheckOutputPrefix(const std::string& flag, const std::string& prefix, const std::string& example_suffix);

// The directory an output prefix (or file) is in must exist: otherwise a NotFound "FLAG PREFIX:
// directory DIR does not exist", or, where a file stands in its place (or in the place of a
// directory above it), "FLAG PREFIX: PATH is not a directory".
absl::Status CheckOutputDirectory(const std::string& flag, const std::string& prefix);

// The directory an output prefix is in, created when missing (as ptk-extract and ptk-concat create their
// --output-dir): CheckOutputDirectory's "is not a directory" where a file stands in the way, else
// "FLAG PREFIX: cannot create directory DIR: why".
absl::Status CreateOutputDirectory(const std::string& flag, const std::string& prefix);

// A file a flag names, when given, must be a file that can be read: otherwise a NotFound "FLAG
// PATH: no such file" (is a directory, cannot be read), followed by "; " and `hint` when one is given.
absl::Status CheckInputFile(const std::string& flag, const std::string& path, const std::string& hint = "");

// --vocab-file / --merge-file, when given, must name files that can be read: otherwise a NotFound
// naming the flag and saying that ptk has GPT-2's files built in (leave both flags out).
absl::Status CheckGpt2FileFlags(const std::string& vocab_file, const std::string& merge_file);

// For a main whose unfinished outputs are worth nothing once it ends (ptk-extract, ptk-concat, ptk-merge; not
// ptk-tokenize, which resumes from its temporary): on SIGINT, SIGTERM or SIGHUP the temporaries of
// its unfinished outputs (RemoveLiveTemporaries) and its lock files (RemoveLiveLocks) are removed
// before it dies of the signal, as gzip and zstd remove their partial output; a kill -9 still leaves them to the next
// run. A signal the process inherited as ignored stays ignored. Call it before any thread starts: the signals are
// blocked in every thread and awaited by one of their own.
void RemoveTemporariesOnSignals();

// Maps a failed Status to the exit code main returns after printing it: kResourceExhausted 3, a
// usage error (ptk::UsageError, common/status.h: the payload, not the message, says so) 2, others 1.
int ExitCodeFor(const absl::Status& status);

// Prints a failed Status as RunMain does: one line "prog: error: ..." (a usage error as "prog: usage
// error: ..." and a hint to run --help), on standard error.
void PrintFailure(const absl::Status& status);

// Runs `body` in main: prints a failed Status (PrintFailure) and returns its code. Standard output that
// could not be written (a full disk under a redirection) fails the run: exit 3 for ENOSPC.
int RunMain(const std::function<absl::Status()>& body);

}  // namespace ptk::cli
