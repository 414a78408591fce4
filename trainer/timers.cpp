// Megatron's timers: levels, device-synchronised start and stop, the all-gather and the text.
#include "trainer/timers.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {

std::optional<TimingLogOption> ParseTimingLogOption(std::string_view text) {
  if (text == "max") return TimingLogOption::kMax;
  if (text == "minmax") return TimingLogOption::kMinMax;
  if (text == "all") return TimingLogOption::kAll;
  return std::nullopt;
}

Timers::Timers(int level, TimingLogOption option, std::function<absl::Status()> synchronize,
               std::function<absl::Status()> barrier)
    : level_(level), option_(option), synchronize_(std::move(synchronize)), barrier_(std::move(barrier)) {}

absl::Status Timers::Start(std::string_view name, int level) {
  if (level > level_) return absl::OkStatus();
  // Megatron's start(barrier=barrier_with_L1_time) of its level-1 timers: the barrier, then the
  // device's synchronisation, then the clock.
  if (level == 1 && barrier_) PTK_RETURN_IF_ERROR(barrier_());
  if (synchronize_) PTK_RETURN_IF_ERROR(synchronize_());
  Timer& t = timers_[std::string(name)];
  t.running = true;
  t.started = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

absl::Status Timers::Stop(std::string_view name) {
  auto it = timers_.find(name);
  if (it == timers_.end() || !it->second.running) return absl::OkStatus();
  if (synchronize_) PTK_RETURN_IF_ERROR(synchronize_());
  Timer& t = it->second;
  t.elapsed += std::chrono::duration<double>(std::chrono::steady_clock::now() - t.started).count();
  t.running = false;
  return absl::OkStatus();
}

double Timers::Elapsed(std::string_view name) const {
  auto it = timers_.find(name);
  if (it == timers_.end()) return 0;
  const Timer& t = it->second;
  return t.elapsed +
         (t.running ? std::chrono::duration<double>(std::chrono::steady_clock::now() - t.started).count() : 0.0);
}

void Timers::Reset() {
  const auto now = std::chrono::steady_clock::now();
  for (auto& [name, t] : timers_) {
    t.elapsed = 0;
    t.started = now;  // a running timer counts on from here, as Megatron's elapsed(reset=True)
  }
}

std::vector<std::string> Timers::NamesToLog(int level) {
  std::vector<std::string> names;
  if (level >= 1)
    names = {"forward-backward",
             "layernorm-grads-all-reduce",
             "embedding-grads-all-reduce",
             "all-grads-sync",
             "params-all-gather",
             "optimizer-copy-to-main-grad",
             "optimizer-unscale-and-check-inf",
             "optimizer-clip-main-grad",
             "optimizer-count-zeros",
             "optimizer-inner-step",
             "optimizer-copy-main-to-model-params",
             "optimizer"};
  if (level >= 2)
    for (const char* n :
         {"batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send", "backward-recv",
          "backward-send", "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
          "backward-send-backward-recv", "forward-backward-send-forward-backward-recv"})
      names.push_back(n);
  return names;
}

absl::StatusOr<std::vector<std::vector<double>>> Timers::GatherElapsed(const std::vector<std::string>& names,
                                                                       Communicator* world, bool reset) {
  const size_t n = names.size(), ranks = static_cast<size_t>(world->size()), me = static_cast<size_t>(world->rank());
  std::vector<double> all(n * ranks, 0.0);
  for (size_t i = 0; i < n; ++i) all[me * n + i] = Elapsed(names[i]);
  if (reset) Reset();
  if (ranks > 1 && n > 0) {
    const std::vector<int64_t> bytes(ranks, static_cast<int64_t>(n * sizeof(double)));
    PTK_RETURN_IF_ERROR(world->AllGather(all.data(), bytes));
  }
  std::vector<std::vector<double>> out(ranks);
  for (size_t r = 0; r < ranks; ++r) out[r].assign(all.begin() + r * n, all.begin() + (r + 1) * n);
  return out;
}

namespace {

// Megatron's name column: the name and a space, padded with dots to 48 characters.
std::string Dotted(const std::string& name) {
  std::string s = name + " ";
  if (s.size() < 48) s.append(48 - s.size(), '.');
  return s;
}

// The (min, max) over the ranks that timed name i (above 0); nullopt when none did.
std::optional<std::pair<double, double>> MinMax(const std::vector<std::vector<double>>& times, size_t i) {
  std::optional<std::pair<double, double>> mm;
  for (const std::vector<double>& rank : times) {
    const double t = i < rank.size() ? rank[i] : 0.0;
    if (!(t > 0.0)) continue;
    mm = mm ? std::make_pair(std::min(mm->first, t), std::max(mm->second, t)) : std::make_pair(t, t);
  }
  return mm;
}

}  // namespace

std::optional<std::string> FormatTimers(const std::vector<std::string>& names,
                                        const std::vector<std::vector<double>>& times, TimingLogOption option,
                                        double normalizer) {
  const double ms = normalizer / 1000.0;
  bool any = false;
  std::string out;
  if (option == TimingLogOption::kAll) {
    out = "times across ranks (ms):";
    for (size_t i = 0; i < names.size(); ++i) {
      bool named = false;
      for (size_t r = 0; r < times.size(); ++r) {
        const double t = i < times[r].size() ? times[r][i] : 0.0;
        if (!(t > 0.0)) continue;
        if (!named) out += fmt::format("\n  {}:", names[i]);
        named = any = true;
        out += fmt::format("\n     rank {:2d}: {:.2f}", r, t / ms);
      }
    }
  } else {
    const bool max_only = option == TimingLogOption::kMax;
    out = max_only ? "max time across ranks (ms):" : "(min, max) time across ranks (ms):";
    for (size_t i = 0; i < names.size(); ++i) {
      const auto mm = MinMax(times, i);
      if (!mm) continue;
      any = true;
      out += max_only ? fmt::format("\n    {}: {:.2f}", Dotted(names[i]), mm->second / ms)
                      : fmt::format("\n    {}: ({:.2f}, {:.2f})", Dotted(names[i]), mm->first / ms, mm->second / ms);
    }
  }
  if (!any) return std::nullopt;
  return out;
}

std::vector<std::pair<std::string, double>> TimerScalars(const std::vector<std::string>& names,
                                                         const std::vector<std::vector<double>>& times,
                                                         double normalizer) {
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < names.size(); ++i)
    if (const auto mm = MinMax(times, i)) out.emplace_back(names[i] + "-time", mm->second / normalizer);
  return out;
}

absl::Status LogTimers(Timers* timers, Communicator* world, int64_t iteration, double normalizer, SummaryWriter* tb,
                       const std::function<void(const std::string&)>& print, bool reset) {
  const std::vector<std::string> names = Timers::NamesToLog(timers->level());
  if (names.empty()) return absl::OkStatus();
  PTK_ASSIGN_OR_RETURN(const auto times, timers->GatherElapsed(names, world, reset));
  if (tb)
    for (const auto& [tag, seconds] : TimerScalars(names, times, normalizer)) tb->AddScalar(tag, seconds, iteration);
  if (world->rank() == world->size() - 1)
    if (const std::optional<std::string> text = FormatTimers(names, times, timers->option(), normalizer))
      print(kTimersLogPrefix + *text);
  return absl::OkStatus();
}

}  // namespace ptk
