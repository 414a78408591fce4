// Reading a ptk checkpoint's JSON header: what trainer/checkpoint.cpp (loading a checkpoint) and
// trainer/checkpoint_settings.cpp (its recorded settings alone) share. Internal to trainer/.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <simdjson.h>

#include "trainer/param_layout.h"

namespace ptk {

// The first bytes of every ptk checkpoint file.
inline constexpr char kMagic[8] = {'P', 'T', 'K', 'C', 'K', 'P', 'T', '1'};

// The header's "settings" ([[flag, value], ...], the run's settings as given) into *out, cleared
// first; none when the header has no such key (a checkpoint of ptk before it recorded them). False
// when the key holds anything else.
bool ReadHeaderSettings(simdjson::dom::element header, std::vector<std::pair<std::string, std::string>>* out);

// The fields of the model configuration that must match for a checkpoint to load, as the header's
// "model" JSON object (what ModelDifferences compares).
std::string ModelJson(const GPTConfig& c);

// The settings two model descriptions (the header's "model") differ in, as the flags that set them:
// "--num-layers 2 (this run: 3), --hidden-size 32 (this run: 64)".
std::string ModelDifferences(simdjson::dom::element saved, simdjson::dom::element mine);

}  // namespace ptk
