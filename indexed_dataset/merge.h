// Merging indexed datasets (tools/merge_datasets.py).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ptk {

// The prefixes in `dir` as tools/merge_datasets.py finds them: every PREFIX with both PREFIX.bin
// and PREFIX.idx, sorted by Python's sorted() (code-point = byte order). A lone .bin or .idx is an
// error naming it. The pair at `output_prefix` (the merge's output, however spelled: a merge into
// its input directory finds there what its earlier run wrote) is never an input; a pair there that no
// merge wrote (its sidecar records another source, or there is none) is an input the merge would
// replace: FailedPrecondition naming it.
absl::StatusOr<std::vector<std::string>> FindPrefixesInDir(const std::string& dir,
                                                           const std::string& output_prefix = "");

// Refuses a merge of `inputs` where one is a merge made from another of them, or two hold one dataset,
// at any depth (a merge of a merge of a merge; a merge into its input directory, met again by the next
// merge of that directory): its documents would be in twice. FailedPrecondition naming the inputs and
// the dataset. A merge's recorded source (MergeSource) lists its inputs.
absl::Status CheckNoInputHoldsAnother(const std::vector<std::string>& inputs);

struct MergeStats {
  int64_t documents = 0, sequences = 0, tokens = 0;
  std::vector<std::string> warnings;  // for the caller to print: the inputs' trailing-bytes warnings
};
// What a merge of `input_prefixes` records as its "source" (MergeDatasets' `source`): a fingerprint
// of the inputs in order (each .bin and .idx by path, size and modification time, and the .ptk-done
// sidecar ptk wrote beside them, with their content checksums) and of --multimodal. An output whose
// sidecar records it (DatasetMadeFrom) is that merge, whole: a rerun can skip it. An input that
// cannot be stat'ed is an error naming it.
absl::StatusOr<std::string> MergeSource(const std::vector<std::string>& input_prefixes, bool multimodal);

// Appends the inputs in the given order into `output_prefix` (dtype of the first input; every
// input must share it). An input that is the output, however spelled (the same .bin or .idx file),
// is an error naming both. `source`, when given, is recorded in the sidecar (IndexedDatasetBuilder::SetSource).
// `progress`: a progress line (datasets and bytes copied, rate, ETA; ProgressReporter) while the inputs are
// copied, and from 1 GiB a line before the output's one checksum pass over its .bin.
// `lock_wait`: how long to keep trying for the output's lock while another run holds it (--lock-wait).
absl::StatusOr<MergeStats> MergeDatasets(const std::vector<std::string>& input_prefixes,
                                         const std::string& output_prefix, bool multimodal = false,
                                         const std::string& source = "", bool progress = false,
                                         std::chrono::milliseconds lock_wait = std::chrono::milliseconds(0));

}  // namespace ptk
