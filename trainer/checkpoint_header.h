// Reading a ptk checkpoint's JSON header: what trainer/checkpoint.cpp (loading a checkpoint) and
// trainer/checkpoint_settings.cpp (its recorded settings alone) share. Internal to trainer/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <simdjson.h>

#include "absl/status/status.h"

#include "trainer/param_layout.h"

namespace ptk {

// The first bytes of every ptk checkpoint file.
inline constexpr char kMagic[8] = {'P', 'T', 'K', 'C', 'K', 'P', 'T', '1'};
// The header's "version"; the file: magic, the header's length (8 bytes), the header, the arrays, then the hex
// SHA-256 of all before it.
inline constexpr int kFormatVersion = 1;
inline constexpr size_t kDigestChars = 64;

// The tag of an iteration directory being removed (iter_0000100.ptk-removing-PID): renamed so before it is
// deleted (RemoveCheckpointIteration), never read by a load, deleted by RecoverCheckpointDir.
inline constexpr char kRemovingTag[] = ".ptk-removing-";

// SetSaveStepHookForTesting's hook, called before each step of a save or a removal (`name`: the step's).
absl::Status CheckpointStep(std::string_view name);

// Why a checkpoint file of `size` bytes, whose first bytes are `head` (its fixed start and header, or all
// of it when shorter), is not the length its header records: "cut short: 1000 bytes of the 5208 its header
// records ..." (a copy or download stopped by a kill or a full disk), or longer; "" when the length is
// right or the header is unreadable (the SHA-256 then decides).
std::string CheckpointLengthProblem(std::string_view head, uint64_t size);
// The cheap part of VerifyCheckpointFile: `file` is there, a ptk checkpoint whose length is the one its header
// records (what a finished save leaves and a copy cut short or a rank's file gone lacks); its SHA-256 unread.
absl::Status CheckCheckpointFileLength(const std::string& file);

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
