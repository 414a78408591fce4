// IndexedDataset's checks beyond Open(): no trailing bytes in the .bin, the .ptk-done sidecar's checksums.
#include <simdjson.h>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/hash.h"
#include "common/status.h"
#include "indexed_dataset/indexed_dataset.h"

namespace ptk {

absl::Status IndexedDataset::Verify() const {
  const uint64_t want = static_cast<uint64_t>(num_tokens_) * itemsize();
  if (bin_->size() != want)
    return absl::DataLossError(
        fmt::format("{}: file is {} bytes but the index {} describes {} bytes ({} trailing bytes): the two files are "
                    "not one dataset's (another dataset's .idx or .bin?)",
                    BinPath(prefix_), bin_->size(), IdxPath(prefix_), want, bin_->size() - want));
  return absl::OkStatus();
}

absl::StatusOr<bool> IndexedDataset::VerifyChecksums() const {
  const std::string side_path = DoneSidecarPath(prefix_);
  if (!PathExists(side_path)) return false;
  PTK_ASSIGN_OR_RETURN(std::string side, ReadFileToString(side_path));
  simdjson::dom::parser parser;
  simdjson::dom::element e;
  uint64_t bin_size, idx_size;
  std::string_view bin_sum, idx_sum;
  if (parser.parse(side).get(e) || e["bin_size"].get(bin_size) || e["idx_size"].get(idx_size) ||
      e["bin_xxh3_128"].get(bin_sum) || e["idx_xxh3_128"].get(idx_sum))
    return absl::DataLossError(fmt::format("{}: not a ptk dataset sidecar (damaged?)", side_path));
  auto check = [&](const MappedFile& f, const std::string& path, uint64_t size, std::string_view sum) -> absl::Status {
    if (f.size() != size)
      return absl::DataLossError(fmt::format("{}: is {} bytes but {} recorded {}", path, f.size(), side_path, size));
    Xxh3 h;
    h.Update(f.data(), f.size());
    if (h.HexDigest() != sum)
      return absl::DataLossError(
          fmt::format("{}: content checksum differs from the one {} recorded when it was written: the file was "
                      "changed or damaged since",
                      path, side_path));
    return absl::OkStatus();
  };
  PTK_RETURN_IF_ERROR(check(*idx_, IdxPath(prefix_), idx_size, idx_sum));
  PTK_RETURN_IF_ERROR(check(*bin_, BinPath(prefix_), bin_size, bin_sum));
  return true;
}

}  // namespace ptk
