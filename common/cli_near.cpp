// The near-miss suggestions of ptk's command lines (cli.h): how near a misspelt name is to the one meant.
#include <algorithm>
#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/cli.h"

namespace ptk::cli {

size_t EditDistance(const std::string& a, const std::string& b) {
  // Three rows: a transposition (ab -> ba) looks two characters back.
  std::vector<size_t> before(b.size() + 1), prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) cur[j] = std::min(cur[j], before[j - 2] + 1);
    }
    std::swap(before, prev);
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<size_t> NearestNames(const std::string& name, const std::vector<std::string>& candidates, size_t most) {
  std::vector<size_t> nearest;
  size_t best = most;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const size_t d = EditDistance(name, candidates[i]);
    if (d > best) continue;  // (a candidate one edit past `most` was suggested when none was nearer)
    if (d < best) nearest.clear();
    best = d;
    nearest.push_back(i);
  }
  return nearest;
}

std::string NearestName(const std::string& name, const std::vector<std::string>& candidates, size_t most) {
  const std::vector<size_t> nearest = NearestNames(name, candidates, most);
  return nearest.empty() ? "" : candidates[nearest.front()];
}

namespace {

// "--Local_Rank" -> "local-rank": a flag's words as argparse would match them, for comparing.
std::string FlagStem(const std::string& flag) {
  std::string stem = flag.substr(std::min(flag.find_first_not_of('-'), flag.size()));
  for (char& c : stem) c = c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return stem;
}

// `stem`'s words are whole words of `flag_stem`, in a row ("layers" in "num-layers", not in "numlayers").
bool HoldsWords(const std::string& flag_stem, const std::string& stem) {
  for (size_t at = flag_stem.find(stem); at != std::string::npos; at = flag_stem.find(stem, at + 1)) {
    const size_t end = at + stem.size();
    if ((at == 0 || flag_stem[at - 1] == '-') && (end == flag_stem.size() || flag_stem[end] == '-')) return true;
  }
  return false;
}

std::vector<std::string> Words(const std::string& stem) {
  std::vector<std::string> words;
  for (size_t start = 0; start <= stem.size();) {
    const size_t end = std::min(stem.find('-', start), stem.size());
    words.push_back(stem.substr(start, end - start));
    start = end + 1;
  }
  return words;
}

// `flag_stem` has `stem`'s words but one of them, a word the tool's flags use (`known`), in place of
// another more than one edit from it: the name is the tool's own words put together, no misspelling of
// that flag ("input-prefix" is three edits from "output-prefix", but "input" is ptk-merge's word for what
// it reads; "sizes" for "size" is still one).
bool SwapsAKnownWord(const std::string& stem, const std::string& flag_stem, const std::vector<std::string>& known) {
  const std::vector<std::string> a = Words(stem), b = Words(flag_stem);
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (EditDistance(a[i], b[i]) > 1 && std::find(known.begin(), known.end(), a[i]) != known.end()) return true;
  return false;
}

}  // namespace

std::string NearestFlagName(const std::string& name, const std::vector<std::string>& flags) {
  const std::string stem = FlagStem(name);
  if (stem.empty()) return "";
  std::vector<std::string> stems, known;
  for (const std::string& f : flags) {
    stems.push_back(FlagStem(f));
    for (std::string& w : Words(stems.back())) known.push_back(std::move(w));
  }
  // A typo: a quarter of the name's letters at most (one edit in a name of up to seven), no word the
  // tool's flags use traded for another.
  std::vector<std::string> typo_stems;
  std::vector<size_t> typo_flags;
  for (size_t i = 0; i < flags.size(); ++i)
    if (!SwapsAKnownWord(stem, stems[i], known)) {
      typo_stems.push_back(stems[i]);
      typo_flags.push_back(i);
    }
  if (const std::vector<size_t> near = NearestNames(stem, typo_stems, std::max<size_t>(1, stem.size() / 4));
      !near.empty())
    return flags[typo_flags[near.front()]];
  // Part of a flag's name (--layers for --num-layers): the flag that adds least to it, no more than the
  // name itself has (so that --size names no flag of the many that end in it), and at most half what any
  // other flag holding it adds: --iters is as near to --train-iters as to --eval-iters, and names neither.
  size_t best = SIZE_MAX, second = SIZE_MAX, found = flags.size();
  for (size_t i = 0; i < flags.size(); ++i) {
    if (!HoldsWords(stems[i], stem)) continue;
    const size_t extra = stems[i].size() - stem.size();
    if (extra < best) {
      second = best;
      best = extra;
      found = i;
    } else if (extra < second) {
      second = extra;
    }
  }
  const bool clear = best <= stem.size() && (second == SIZE_MAX || second >= 2 * best);
  return found < flags.size() && clear ? flags[found] : "";
}

// CLI11's "--loader: megatorn not in {ptk,hf,megatron}", with the choice most likely meant, as an unknown
// flag gets the flag meant: "...; did you mean megatron?".
std::string WithNearestChoice(const std::string& message) {
  const size_t in = message.rfind(" not in {"), colon = message.find(": ");
  if (in == std::string::npos || colon == std::string::npos || colon > in || message.back() != '}') return message;
  const std::string value = message.substr(colon + 2, in - colon - 2);
  const std::string list = message.substr(in + 9, message.size() - in - 10);
  std::vector<std::string> choices;
  for (size_t start = 0; start <= list.size();) {
    const size_t end = std::min(list.find(',', start), list.size());
    choices.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  const std::string best = NearestName(value, choices, std::max<size_t>(2, value.size() / 3));
  return best.empty() ? message : fmt::format("{}; did you mean {}?", message, best);
}

namespace {

// The flag a bare word was most likely meant for: an input flag the tool has and was not given (a list
// one for several words), else the one required option with a value not given; null when none is clear.
const CLI::Option* FlagForBareWords(const CLI::App& app, size_t words) {
  const CLI::Option* single = nullptr;
  for (const char* name : {"input", "inputs", "repo"})
    for (const CLI::Option* opt : app.get_options())
      if (opt->check_lname(name)) {
        if (opt->count() > 0) return nullptr;  // the input is given: the words are something else
        if (words > 1 && opt->get_expected_max() > 1) return opt;
        if (single == nullptr) single = opt;
      }
  if (single != nullptr) return single;
  std::vector<const CLI::Option*> missing;
  for (const CLI::Option* opt : app.get_options())
    if (opt->get_required() && opt->count() == 0 && opt->get_type_size() != 0 && !opt->get_lnames().empty())
      missing.push_back(opt);
  return missing.size() == 1 ? missing.front() : nullptr;
}

// "(ptk-merge takes every value after its flag)", or for a tool with bare arguments of its own
// "(ptk-inspect's bare argument is its prefix; every other value goes after its flag)".
std::string BareRule(const CLI::App& app, const std::string& tool) {
  std::string names;
  for (const CLI::Option* opt : app.get_options())
    if (opt->get_positional()) names += (names.empty() ? "" : ", ") + opt->get_name(true, false);
  if (names.empty()) return fmt::format("({} takes every value after its flag)", tool);
  return fmt::format("({}'s bare argument is its {}; every other value goes after its flag)", tool, names);
}

// A bare word that is a flag of another of the tool's commands than the one given, where it belongs
// ("--chunk-index is not a flag of `ptk-concat`, but of `ptk-concat run`: give it after `run`"); CLI11
// left it as a bare word, called one "given without a flag". Empty when no bare word is such a flag.
std::string MisplacedFlag(const CLI::App& app, const CLI::App& parsed, const std::vector<std::string>& bare) {
  const auto command = [&](const CLI::App& a) {
    return &a == &app ? app.get_name() : fmt::format("{} {}", app.get_name(), a.get_name());
  };
  std::vector<const CLI::App*> commands = {&app};
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) commands.push_back(sub);
  for (const std::string& w : bare) {
    if (w.size() < 3 || w.compare(0, 2, "--") != 0) continue;
    const std::string name = w.substr(0, w.find('='));
    std::string owners, last_sub;
    int n = 0;
    for (const CLI::App* a : commands) {
      if (a == &parsed || a->get_option_no_throw(name) == nullptr) continue;
      owners += fmt::format("{}`{}`{}", n++ ? " and " : "", command(*a), a == &app ? " without a subcommand" : "");
      last_sub = a == &app ? "" : a->get_name();
    }
    if (n == 0) continue;
    return fmt::format("{} is not a flag of `{}`, but of {}{}", name, command(parsed), owners,
                       n == 1 && !last_sub.empty() ? fmt::format(": give it after `{}`", last_sub) : "");
  }
  return "";
}

}  // namespace

std::string ParseErrorMessage(const CLI::App& app, const CLI::ParseError& e) {
  const bool extras = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr;
  const bool required = dynamic_cast<const CLI::RequiredError*>(&e) != nullptr;
  const CLI::App* parsed = &app;  // the subcommand given, whose words and flags these are
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    if (sub->parsed()) parsed = sub;
  const std::vector<std::string> bare = parsed->remaining();
  if (!(extras || required) || bare.empty()) return WithNearestChoice(e.what());
  std::string words;
  for (const std::string& w : bare) words += (words.empty() ? "" : " ") + w;
  if (const std::string misplaced = MisplacedFlag(app, *parsed, bare); !misplaced.empty())
    return required ? fmt::format("{}; {}", e.what(), misplaced) : misplaced;
  const std::string tool = parsed == &app ? app.get_name() : app.get_name() + " " + parsed->get_name();
  const CLI::Option* flag = FlagForBareWords(*parsed, bare.size());
  const std::string given =
      fmt::format("{} {} given without a flag {}", words, bare.size() > 1 ? "were" : "was", BareRule(*parsed, tool));
  if (flag != nullptr && (flag->get_expected_max() > 1 || bare.size() == 1))
    return fmt::format("{}{}; did you mean {} {}?", required ? std::string(e.what()) + ": " : "", given,
                       flag->get_name(false, true), words);
  return required ? fmt::format("{}; {}", e.what(), given) : given;
}

}  // namespace ptk::cli
