// TensorBoard event files: events.out.tfevents.<time>.<host>.<pid>.<n>, a sequence of TFRecords
// (length, masked CRC32C of the length, an Event protobuf, masked CRC32C of the data) as
// TensorFlow's and PyTorch's SummaryWriter write them; scalars as Summary.Value.simple_value.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ptk {

// CRC-32C (Castagnoli) of `data`, continuing `crc` (0 to start), as TFRecord framing uses it.
uint32_t Crc32c(std::string_view data, uint32_t crc = 0);
// TFRecord's mask: rotate right by 15 bits, add 0xa282ead8.
uint32_t MaskedCrc32c(std::string_view data);
// One TFRecord: u64 length (little-endian), masked CRC of those 8 bytes, the data, masked CRC of it.
std::string FrameRecord(std::string_view data);

struct SummaryWriterOptions {
  std::string host;            // empty: gethostname()
  double wall_time = -1;       // the file's start time; < 0: now
  std::string writer = "ptk";  // Event.source_metadata.writer
};

// Appends scalar events to a new event file in `dir` (created if missing). One writer per file:
// a run that starts again (a resume) writes a new file beside the old ones, which TensorBoard
// reads in the order of their names. Events collect in memory until Flush, which writes them with
// their errors checked (a full disk is kResourceExhausted naming the file); a reader sees whole
// records up to the last flush. Not thread-safe.
class SummaryWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SummaryWriter>> Create(const std::string& dir,
                                                               const SummaryWriterOptions& options = {});
  ~SummaryWriter();
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  // A scalar as TensorBoard's add_scalar writes it: float32 simple_value under `tag` at `step`.
  // wall_time < 0: now.
  void AddScalar(std::string_view tag, double value, int64_t step, double wall_time = -1);
  // Writes what was added since the last flush and flushes it to the kernel.
  absl::Status Flush();
  // Flush and fsync: what was added is on disk (a checkpoint saves after it, so that the events of
  // the iterations it covers outlive a kill or a crash right after it).
  absl::Status Sync();
  // Flush, fsync and close. Further calls do nothing.
  absl::Status Close();

  const std::string& path() const { return path_; }

 private:
  SummaryWriter(std::string path, FILE* f) : path_(std::move(path)), f_(f) {}
  void AddEvent(const std::string& serialized);
  std::string path_;
  FILE* f_ = nullptr;
  std::string pending_;  // framed records not yet written
};

// Wall-clock time in seconds since the epoch, as TensorBoard's events carry it.
double WallTimeNow();

}  // namespace ptk
