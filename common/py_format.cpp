// Python-compatible formatting.
#include "common/py_format.h"

#include <cmath>

#include <fmt/core.h>

namespace ptk::py {

std::string FloatRepr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

int64_t RoundHalfEven(double x) {
  double r = std::nearbyint(x);  // the default rounding mode rounds half to even
  return static_cast<int64_t>(r);
}

double NumpySum(const double* a, size_t n) {
  if (n < 8) {
    double res = 0.;
    for (size_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  size_t n2 = n / 2;
  n2 -= n2 % 8;
  return NumpySum(a, n2) + NumpySum(a + n2, n - n2);
}

std::vector<double> NumpyNormalize(const std::vector<double>& w) {
  double s = NumpySum(w.data(), w.size());
  std::vector<double> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i] / s;
  return out;
}

namespace {
void WriteString(std::string* out, const std::string& s) {
  out->push_back('"');
  const unsigned char* p = reinterpret_cast<const unsigned char*>(s.data());
  const unsigned char* end = p + s.size();
  while (p < end) {
    unsigned char c = *p;
    if (c < 0x80) {
      switch (c) {
        case '"': *out += "\\\""; break;
        case '\\': *out += "\\\\"; break;
        case '\n': *out += "\\n"; break;
        case '\r': *out += "\\r"; break;
        case '\t': *out += "\\t"; break;
        case '\b': *out += "\\b"; break;
        case '\f': *out += "\\f"; break;
        default:
          if (c < 0x20 || c == 0x7f)
            *out += fmt::format("\\u{:04x}", c);
          else
            out->push_back(static_cast<char>(c));
      }
      ++p;
      continue;
    }
    // ensure_ascii: non-ASCII as \uXXXX (surrogate pairs above the BMP).
    uint32_t cp;
    int len;
    if (c >= 0xF0 && end - p >= 4) {
      cp = ((c & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
      len = 4;
    } else if (c >= 0xE0 && end - p >= 3) {
      cp = ((c & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
      len = 3;
    } else if (c >= 0xC0 && end - p >= 2) {
      cp = ((c & 0x1Fu) << 6) | (p[1] & 0x3Fu);
      len = 2;
    } else {
      cp = 0xFFFD;
      len = 1;
    }
    if (cp >= 0x10000) {
      cp -= 0x10000;
      *out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
    } else {
      *out += fmt::format("\\u{:04x}", cp);
    }
    p += len;
  }
  out->push_back('"');
}
}  // namespace

void Json::Write(std::string* out, int indent, int level) const {
  const std::string pad_in(static_cast<size_t>(indent * (level + 1)), ' '),
      pad(static_cast<size_t>(indent * level), ' ');
  if (std::holds_alternative<std::nullptr_t>(v_)) {
    *out += "null";
  } else if (auto* b = std::get_if<bool>(&v_)) {
    *out += *b ? "true" : "false";
  } else if (auto* i = std::get_if<int64_t>(&v_)) {
    *out += std::to_string(*i);
  } else if (auto* d = std::get_if<double>(&v_)) {
    if (std::isnan(*d))
      *out += "NaN";
    else if (std::isinf(*d))
      *out += *d > 0 ? "Infinity" : "-Infinity";
    else
      *out += FloatRepr(*d);
  } else if (auto* s = std::get_if<std::string>(&v_)) {
    WriteString(out, *s);
  } else if (auto* a = std::get_if<std::shared_ptr<Array>>(&v_)) {
    if ((*a)->empty()) {
      *out += "[]";
      return;
    }
    *out += "[\n";
    for (size_t k = 0; k < (*a)->size(); ++k) {
      if (k) *out += ",\n";
      *out += pad_in;
      (**a)[k].Write(out, indent, level + 1);
    }
    *out += "\n" + pad + "]";
  } else if (auto* o = std::get_if<std::shared_ptr<Object>>(&v_)) {
    if ((*o)->empty()) {
      *out += "{}";
      return;
    }
    *out += "{\n";
    for (size_t k = 0; k < (*o)->size(); ++k) {
      if (k) *out += ",\n";
      *out += pad_in;
      WriteString(out, (**o)[k].first);
      *out += ": ";
      (**o)[k].second.Write(out, indent, level + 1);
    }
    *out += "\n" + pad + "}";
  }
}

std::string Json::Dumps(int indent) const {
  std::string out;
  Write(&out, indent, 0);
  return out;
}

}  // namespace ptk::py
