// The near-miss suggestions of ptk's command lines (cli.h): how near a misspelt name is to the one meant.
#include <algorithm>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/cli.h"

namespace ptk::cli {

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::vector<size_t> NearestNames(const std::string& name, const std::vector<std::string>& candidates, size_t most) {
  std::vector<size_t> nearest;
  size_t best = most + 1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const size_t d = EditDistance(name, candidates[i]);
    if (d < best) {
      nearest.clear();
      best = d;
    }
    if (d == best) nearest.push_back(i);
  }
  return nearest;
}

std::string NearestName(const std::string& name, const std::vector<std::string>& candidates, size_t most) {
  const std::vector<size_t> nearest = NearestNames(name, candidates, most);
  return nearest.empty() ? "" : candidates[nearest.front()];
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

}  // namespace ptk::cli
