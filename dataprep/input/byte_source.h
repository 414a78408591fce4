// Streaming byte sources: plain files, stdin, zstd (multi-frame), xz (concatenated streams) and
// gzip (concatenated members, as C4/Dolma/OSCAR ship .json.gz).
// Compressed data is decoded on the fly; a truncated or corrupt stream yields kDataLoss naming the
// file and the compressed byte offset, never silently short data. What may follow the last frame,
// stream or member is what the format's own tool accepts: xz's stream padding (zero bytes, a
// multiple of four) and zero bytes after a gzip member (gzip -d ignores them silently); any other
// trailing byte, zero bytes after zstd frames included (zstd -d refuses them), is kDataLoss
// "trailing garbage at byte N".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace ptk {

enum class Compression { kNone, kZstd, kXz, kGzip };

// By the file's magic bytes, whatever its name says; by extension (.zst/.zstd, .xz, .gz) only
// when the file cannot be read (the open then reports why).
Compression DetectCompression(const std::string& path);
// "x.jsonl.zst" -> "x.jsonl" (.zst, .zstd, .xz, .gz); unchanged when not compressed.
std::string StripCompressionSuffix(const std::string& path);

// The names of the compressed files ptk reads: what ptk-extract takes below a directory.
inline constexpr std::string_view kCompressionSuffixes[] = {".zst", ".zstd", ".xz", ".gz"};
std::vector<std::string> CompressedSuffixes();
// What ptk-concat takes below a directory: .jsonl and .json, plain or compressed (every suffix of
// kCompressionSuffixes), so it reads every file ptk-extract would decompress.
std::vector<std::string> JsonInputSuffixes();
// "a, b and c" of `suffixes`, for --help and messages.
std::string DescribeSuffixes(const std::vector<std::string>& suffixes);

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Reads up to `size` decoded bytes; 0 means end of data (only after the stream was complete).
  virtual absl::StatusOr<size_t> Read(char* buf, size_t size) = 0;
  // Skips `n` decoded bytes (a plain file seeks; a compressed one decodes and discards). Reaching
  // the end first is kDataLoss.
  virtual absl::Status Skip(uint64_t n);
  // Raw (compressed) bytes consumed so far, for progress.
  virtual uint64_t raw_bytes_read() const = 0;
  const std::string& name() const { return name_; }

 protected:
  std::string name_;
};

// "-" is stdin, its format told by its first bytes too. `compression` overrides detection when given. A file that
// starts like another binary format (bzip2, zip, 7z, lz4, brotli-less guesses aside) is refused naming the format.
absl::StatusOr<std::unique_ptr<ByteSource>> OpenByteSource(const std::string& path);
absl::StatusOr<std::unique_ptr<ByteSource>> OpenByteSource(const std::string& path, Compression compression);

}  // namespace ptk
