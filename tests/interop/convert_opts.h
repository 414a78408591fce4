// ConvertOptions for one ptk-convert direction (loader, saver, from, to), as the conversion tests
// build them.
#pragma once

#include <string>

#include "interop/hf_gpt2.h"

namespace ptk::testing {

inline ConvertOptions ConvertOpts(const std::string& loader, const std::string& saver, const std::string& from,
                                  const std::string& to) {
  ConvertOptions o;
  o.loader = loader;
  o.saver = saver;
  o.load_dir = from;
  o.save_dir = to;
  return o;
}

}  // namespace ptk::testing
