// Duplicate keys in parsed JSON. Python's json (and so transformers, Megatron) keeps a key's last
// value, simdjson's lookup finds its first: a reader of JSON that ptk writes, or of a file whose
// meaning ptk cannot keep with either value, refuses a duplicate by name instead of guessing.
// Header-only over simdjson's DOM types (common itself does not link simdjson).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>

namespace ptk {

// The first key given twice in one object anywhere in `e`, as a path ("model.num_layers",
// "settings[3].x"), or nullopt. `Element` is simdjson::dom::element.
template <typename Element>
std::optional<std::string> FirstDuplicateJsonKey(const Element& e, const std::string& path = "") {
  if (e.is_object()) {
    std::unordered_set<std::string_view> seen;
    const auto object = e.get_object().value_unsafe();  // a copy (a view): the result is a temporary
    for (auto field : object) {
      const std::string here = path.empty() ? std::string(field.key) : path + "." + std::string(field.key);
      if (!seen.insert(field.key).second) return here;
      if (auto d = FirstDuplicateJsonKey(field.value, here)) return d;
    }
  } else if (e.is_array()) {
    size_t i = 0;
    const auto array = e.get_array().value_unsafe();
    for (auto item : array)
      if (auto d = FirstDuplicateJsonKey(item, path + "[" + std::to_string(i++) + "]")) return d;
  }
  return std::nullopt;
}

}  // namespace ptk
