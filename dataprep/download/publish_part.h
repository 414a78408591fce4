// What a file's two downloaders (whole, file_fetch.cpp; in ranges, ranged_fetch.cpp) do with a
// complete, verified `.part`. Internal to dataprep/download/.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/output_lock.h"
#include "dataprep/download/download_internal.h"

namespace ptk::download_detail {

// Hands the `.part` of `f` (`part_path`, open as *fd, which becomes -1; its record `meta_path`; `bytes`
// long) and the file's lock to Publish: made durable, renamed to f.local_path, its done-log line
// appended, the lock released.
absl::Status PublishPart(Session& s, DoneLog& done, const RemoteFile& f, int* fd, const std::string& part_path,
                         const std::string& meta_path, uint64_t bytes, std::unique_ptr<OutputLock> lock);

}  // namespace ptk::download_detail
