// Python-compatible formatting, for file names and cache keys that must match what Megatron's
// Python code computes: float repr, json.dumps(indent=4), numpy's pairwise float sum, round().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace ptk::py {

// repr(float): shortest round-trip digits, always with '.', 'e', 'inf' or 'nan' ("1.0", "1e-05").
std::string FloatRepr(double v);

// Python's round(x) to an integer: half to even.
int64_t RoundHalfEven(double x);

// numpy.sum over float64 (pairwise summation with numpy's blocking: 8 accumulators, blocks of
// 128), so that sums and normalized weights match numpy bit for bit.
double NumpySum(const double* a, size_t n);
// numpy.array(w, float64) / numpy.sum(w), then .tolist()
std::vector<double> NumpyNormalize(const std::vector<double>& w);

// A JSON value with Python json.dumps(obj, indent=4) rendering (ensure_ascii, ", "-free indent
// style: items separated by ",\n", keys by ": ", no trailing newline).
class Json {
 public:
  using Object = std::vector<std::pair<std::string, Json>>;  // insertion order (an OrderedDict)
  using Array = std::vector<Json>;
  Json() : v_(nullptr) {}
  Json(std::nullptr_t) : v_(nullptr) {}
  Json(bool b) : v_(b) {}
  Json(int v) : v_(static_cast<int64_t>(v)) {}
  Json(int64_t v) : v_(v) {}
  Json(double v) : v_(v) {}
  Json(const char* s) : v_(std::string(s)) {}
  Json(std::string s) : v_(std::move(s)) {}
  Json(Array a) : v_(std::make_shared<Array>(std::move(a))) {}
  Json(Object o) : v_(std::make_shared<Object>(std::move(o))) {}

  std::string Dumps(int indent = 4) const;

 private:
  void Write(std::string* out, int indent, int level) const;
  std::variant<std::nullptr_t, bool, int64_t, double, std::string, std::shared_ptr<Array>, std::shared_ptr<Object>> v_;
};

}  // namespace ptk::py
