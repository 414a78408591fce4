// Streaming byte sources.
#include "dataprep/input/byte_source.h"

#include <fcntl.h>
#include <lzma.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>
#include <zstd_errors.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/status.h"

namespace ptk {
namespace {

bool EndsWith(const std::string& s, std::string_view suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

class FdSource : public ByteSource {
 public:
  // `head`: bytes already read from fd (a stream's first bytes, read to tell its format), given first.
  FdSource(std::string name, int fd, bool own, std::string head = "")
      : fd_(fd), own_(own), head_(std::move(head)), raw_(head_.size()) {
    name_ = std::move(name);
  }
  ~FdSource() override {
    if (own_ && fd_ >= 0) ::close(fd_);
  }
  absl::StatusOr<size_t> Read(char* buf, size_t size) override {
    if (head_pos_ < head_.size()) {
      const size_t n = std::min(size, head_.size() - head_pos_);
      std::memcpy(buf, head_.data() + head_pos_, n);
      head_pos_ += n;
      return n;
    }
    while (true) {
      ssize_t n = ::read(fd_, buf, size);
      if (n >= 0) {
        raw_ += static_cast<uint64_t>(n);
        return static_cast<size_t>(n);
      }
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, fmt::format("read {}", name_));
    }
  }
  uint64_t raw_bytes_read() const override { return raw_; }
  absl::Status Skip(uint64_t n) override {
    struct stat st;
    if (own_ && ::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)) {
      const off_t at = ::lseek(fd_, 0, SEEK_CUR);
      if (at < 0 || static_cast<uint64_t>(st.st_size) < static_cast<uint64_t>(at) + n)
        return absl::DataLossError(fmt::format("{}: shorter than the {} bytes to skip (changed?)", name_, n));
      if (::lseek(fd_, static_cast<off_t>(n), SEEK_CUR) < 0) return ErrnoToStatus(errno, fmt::format("seek {}", name_));
      raw_ += n;
      return absl::OkStatus();
    }
    return ByteSource::Skip(n);
  }

 private:
  int fd_;
  bool own_;
  std::string head_;
  size_t head_pos_ = 0;
  uint64_t raw_ = 0;
};

// Base for decoders: pulls compressed input from an FdSource.
class DecoderSource : public ByteSource {
 protected:
  explicit DecoderSource(std::unique_ptr<FdSource> in) : in_(std::move(in)), inbuf_(1 << 17) { name_ = in_->name(); }
  // Refills the input buffer when empty; sets eof_ at end of file.
  absl::Status Fill() {
    if (in_pos_ < in_len_ || eof_) return absl::OkStatus();
    PTK_ASSIGN_OR_RETURN(size_t n, in_->Read(inbuf_.data(), inbuf_.size()));
    in_base_ += in_len_;
    in_pos_ = 0;
    in_len_ = n;
    if (n == 0) eof_ = true;
    return absl::OkStatus();
  }
  uint64_t raw_offset() const { return in_base_ + in_pos_; }
  uint64_t raw_bytes_read() const override { return in_->raw_bytes_read(); }

  std::unique_ptr<FdSource> in_;
  std::vector<char> inbuf_;
  size_t in_pos_ = 0, in_len_ = 0;
  uint64_t in_base_ = 0;
  bool eof_ = false;
};

class ZstdSource : public DecoderSource {
 public:
  explicit ZstdSource(std::unique_ptr<FdSource> in) : DecoderSource(std::move(in)) {
    dctx_ = ZSTD_createDCtx();
    // Accept windows up to 2 GiB (zstd --long=31); the default limit rejects --long archives.
    ZSTD_DCtx_setParameter(dctx_, ZSTD_d_windowLogMax, 31);
  }
  ~ZstdSource() override { ZSTD_freeDCtx(dctx_); }
  absl::StatusOr<size_t> Read(char* buf, size_t size) override {
    if (done_) return size_t{0};
    ZSTD_outBuffer out{buf, size, 0};
    while (true) {
      PTK_RETURN_IF_ERROR(Fill());
      ZSTD_inBuffer in{inbuf_.data(), in_len_, in_pos_};
      const size_t before = in.pos, out_before = out.pos;
      size_t ret = ZSTD_decompressStream(dctx_, &out, &in);
      in_pos_ = in.pos;
      // The first bytes after a complete frame: whether they can start another one.
      if (frames_ > 0 && head_.size() < 4)
        head_.append(inbuf_.data() + before, std::min(in.pos - before, 4 - head_.size()));
      if (ZSTD_isError(ret)) {
        // As zstd -d: after a complete frame comes another frame or nothing (zero bytes included).
        if (frames_ > 0 && ZSTD_getErrorCode(ret) == ZSTD_error_prefix_unknown) return TrailingGarbage();
        return absl::DataLossError(
            fmt::format("{}: corrupt zstd data near byte {}: {}", name_, in_base_ + before, ZSTD_getErrorName(ret)));
      }
      if (in.pos > before) any_input_ = true;
      // ret == 0: a frame ended and is fully flushed. A call that neither consumed nor produced
      // anything says nothing new (it may hint at the size of a next frame header).
      if (in.pos > before || out.pos > out_before) frame_open_ = ret != 0;
      if (ret == 0 && (in.pos > before || out.pos > out_before)) {
        ++frames_;
        frame_end_ = in_base_ + in.pos;
        head_.clear();
      }
      // Fill the caller's buffer: large reads mean large, copy-free writes downstream.
      if (out.pos == out.size) return out.pos;
      if (eof_) {
        if (out.pos > 0) return out.pos;  // the next call checks how the stream ended
        if (!any_input_) return absl::DataLossError(fmt::format("{}: empty file is not a zstd stream", name_));
        if (frame_open_) {
          if (frames_ > 0 && !MayStartFrame(head_)) return TrailingGarbage();
          return absl::DataLossError(
              fmt::format("{}: truncated zstd data: the stream ends inside a frame at byte {}", name_, raw_offset()));
        }
        done_ = true;
        return size_t{0};
      }
    }
  }

 private:
  // Whether `head` is how a zstd frame or a skippable frame (magic 0x184D2A5?) starts.
  static bool MayStartFrame(std::string_view head) {
    static constexpr unsigned char kFrame[4] = {0x28, 0xB5, 0x2F, 0xFD}, kSkippable[4] = {0x50, 0x2A, 0x4D, 0x18};
    bool frame = true, skippable = true;
    for (size_t i = 0; i < head.size() && i < 4; ++i) {
      const auto c = static_cast<unsigned char>(head[i]);
      frame &= c == kFrame[i];
      skippable &= i == 0 ? (c & 0xF0) == kSkippable[0] : c == kSkippable[i];
    }
    return frame || skippable;
  }
  absl::Status TrailingGarbage() const {
    return absl::DataLossError(
        fmt::format("{}: trailing garbage at byte {}, after the last complete zstd frame", name_, frame_end_));
  }

  ZSTD_DCtx* dctx_;
  bool frame_open_ = false, done_ = false, any_input_ = false;
  uint64_t frames_ = 0, frame_end_ = 0;  // complete frames (skippable ones too); where the last ended
  std::string head_;                     // up to 4 bytes read since then
};

// Concatenated streams, each followed by optional stream padding (zero bytes, a multiple of four), as
// xz reads them; the streams are decoded one at a time so that what follows one is judged here.
class XzSource : public DecoderSource {
 public:
  explicit XzSource(std::unique_ptr<FdSource> in) : DecoderSource(std::move(in)) {
    init_ = lzma_stream_decoder(&strm_, UINT64_MAX, 0);
  }
  ~XzSource() override { lzma_end(&strm_); }
  absl::StatusOr<size_t> Read(char* buf, size_t size) override {
    if (init_ != LZMA_OK) return absl::InternalError(fmt::format("{}: cannot initialise the xz decoder", name_));
    if (done_) return size_t{0};
    strm_.next_out = reinterpret_cast<uint8_t*>(buf);
    strm_.avail_out = size;
    while (strm_.avail_out > 0) {
      PTK_RETURN_IF_ERROR(Fill());
      if (between_streams_) {
        PTK_ASSIGN_OR_RETURN(const bool next, NextStream());
        if (!next) {
          if (!eof_) continue;
          done_ = true;
          break;
        }
      }
      strm_.next_in = reinterpret_cast<const uint8_t*>(inbuf_.data()) + in_pos_;
      strm_.avail_in = in_len_ - in_pos_;
      lzma_ret r = lzma_code(&strm_, eof_ ? LZMA_FINISH : LZMA_RUN);
      in_pos_ = in_len_ - strm_.avail_in;
      if (r == LZMA_STREAM_END) {
        between_streams_ = true;
        stream_end_ = raw_offset();
        ++streams_;
        continue;
      }
      if (r == LZMA_OK) {
        if (eof_ && strm_.avail_out == size) return Truncated();
        if (eof_ && strm_.avail_out < size) break;  // hand over what there is; the next call reports the end
        continue;
      }
      if (r == LZMA_BUF_ERROR && eof_) return Truncated();
      if (r == LZMA_FORMAT_ERROR && streams_ > 0) return TrailingGarbage(stream_end_);
      const char* what = r == LZMA_FORMAT_ERROR ? "not an xz stream"
                         : r == LZMA_DATA_ERROR ? "corrupt xz data"
                         : r == LZMA_MEM_ERROR  ? "out of memory"
                                                : "xz decoder error";
      return absl::DataLossError(fmt::format("{}: {} near byte {}", name_, what, raw_offset()));
    }
    return size - strm_.avail_out;
  }

 private:
  // After a stream: skips the stream padding in the buffer. True when another stream starts here
  // (the decoder is then ready for it); false when more input is needed or the file ended.
  absl::StatusOr<bool> NextStream() {
    while (in_pos_ < in_len_ && inbuf_[in_pos_] == 0) {
      ++in_pos_;
      ++padding_;
    }
    if (in_pos_ == in_len_ && !eof_) return false;
    if (padding_ % 4 != 0)  // xz -d: "Compressed data is corrupt"
      return absl::DataLossError(
          fmt::format("{}: {} zero bytes after the xz stream that ends at byte {}: stream "
                      "padding must be a multiple of 4 bytes",
                      name_, padding_, stream_end_));
    if (in_pos_ == in_len_) return false;
    if (static_cast<unsigned char>(inbuf_[in_pos_]) != 0xFD) return TrailingGarbage(raw_offset());
    between_streams_ = false;
    padding_ = 0;
    stream_end_ = raw_offset();  // a stream that is not one is garbage from here
    init_ = lzma_stream_decoder(&strm_, UINT64_MAX, 0);
    if (init_ != LZMA_OK) return absl::InternalError(fmt::format("{}: cannot initialise the xz decoder", name_));
    return true;
  }
  absl::Status Truncated() const {
    if (raw_offset() == 0) return absl::DataLossError(fmt::format("{}: empty file is not xz data", name_));
    return absl::DataLossError(fmt::format("{}: truncated xz data at byte {}", name_, raw_offset()));
  }
  absl::Status TrailingGarbage(uint64_t at) const {
    return absl::DataLossError(
        fmt::format("{}: trailing garbage at byte {}, after the last complete xz stream", name_, at));
  }

  lzma_stream strm_ = LZMA_STREAM_INIT;
  lzma_ret init_;
  bool done_ = false, between_streams_ = false;
  uint64_t streams_ = 0, stream_end_ = 0, padding_ = 0;
};

// Concatenated members (as C4/Dolma/OSCAR ship them). Zero bytes after the last member (what tape
// and block writers pad with) end the data, as gzip -d accepts them silently; anything else after
// a member that is not a member is trailing garbage (gzip -d warns and exits 2).
class GzipSource : public DecoderSource {
 public:
  explicit GzipSource(std::unique_ptr<FdSource> in) : DecoderSource(std::move(in)) {
    init_ = inflateInit2(&strm_, 16 + MAX_WBITS);  // gzip wrapper
  }
  ~GzipSource() override { inflateEnd(&strm_); }
  absl::StatusOr<size_t> Read(char* buf, size_t size) override {
    if (init_ != Z_OK) return absl::InternalError(fmt::format("{}: cannot initialise the gzip decoder", name_));
    if (done_) return size_t{0};
    size = std::min<size_t>(size, 1u << 30);
    strm_.next_out = reinterpret_cast<Bytef*>(buf);
    strm_.avail_out = static_cast<uInt>(size);
    while (strm_.avail_out > 0) {
      PTK_RETURN_IF_ERROR(Fill());
      if (members_ > 0 && !member_open_) PTK_RETURN_IF_ERROR(SkipPadding());
      if (in_pos_ == in_len_ && eof_) {
        if (!any_input_) return absl::DataLossError(fmt::format("{}: empty file is not gzip data", name_));
        if (member_open_)
          return absl::DataLossError(fmt::format("{}: truncated gzip data at byte {}", name_, raw_offset()));
        done_ = true;
        break;
      }
      if (in_pos_ == in_len_) continue;
      strm_.next_in = reinterpret_cast<Bytef*>(inbuf_.data() + in_pos_);
      strm_.avail_in = static_cast<uInt>(in_len_ - in_pos_);
      const uInt in_before = strm_.avail_in;
      const int r = inflate(&strm_, Z_NO_FLUSH);
      in_pos_ = in_len_ - strm_.avail_in;
      if (strm_.avail_in < in_before) {
        any_input_ = true;
        member_open_ = true;
      }
      if (r == Z_STREAM_END) {
        member_open_ = false;  // another member may follow (concatenated .gz files)
        ++members_;
        member_end_ = raw_offset();
        inflateReset(&strm_);
        continue;
      }
      if (r == Z_OK || r == Z_BUF_ERROR) continue;  // needs more input (end of file is checked above)
      // Not the two magic bytes where a next member would start: gzip -d's "trailing garbage".
      if (r == Z_DATA_ERROR && members_ > 0 && strm_.total_in <= 2) return TrailingGarbage(member_end_);
      return absl::DataLossError(fmt::format("{}: corrupt gzip data near byte {}: {}", name_, raw_offset(),
                                             strm_.msg ? strm_.msg : "inflate error"));
    }
    return size - strm_.avail_out;
  }

 private:
  // Between members: skips zero bytes in the buffer. What follows them is garbage (gzip -d reads
  // zeros only as padding to the end), and so is a first byte that cannot start a member.
  absl::Status SkipPadding() {
    while (in_pos_ < in_len_ && inbuf_[in_pos_] == 0) {
      ++in_pos_;
      padded_ = true;
    }
    if (in_pos_ < in_len_ && (padded_ || static_cast<unsigned char>(inbuf_[in_pos_]) != 0x1F))
      return TrailingGarbage(raw_offset());
    return absl::OkStatus();
  }
  absl::Status TrailingGarbage(uint64_t at) const {
    return absl::DataLossError(
        fmt::format("{}: trailing garbage at byte {}, after the last complete gzip member", name_, at));
  }

  z_stream strm_ = {};
  int init_;
  bool done_ = false, member_open_ = false, any_input_ = false, padded_ = false;
  uint64_t members_ = 0, member_end_ = 0;
};

// A binary format ptk does not read, recognised by its first bytes ("" when none).
std::string_view OtherBinaryFormat(const unsigned char* m, ssize_t n) {
  if (n >= 3 && std::memcmp(m, "BZh", 3) == 0) return "bzip2";
  if (n >= 4 && std::memcmp(m, "PK\x03\x04", 4) == 0) return "zip";
  if (n >= 6 && std::memcmp(m, "7z\xBC\xAF\x27\x1C", 6) == 0) return "7z";
  if (n >= 4 && m[0] == 0x04 && m[1] == 0x22 && m[2] == 0x4D && m[3] == 0x18) return "lz4";
  if (n >= 4 && std::memcmp(m, "PAR1", 4) == 0) return "parquet";
  return "";
}

}  // namespace

absl::Status ByteSource::Skip(uint64_t n) {
  std::vector<char> buf(1 << 20);
  while (n > 0) {
    PTK_ASSIGN_OR_RETURN(size_t got, Read(buf.data(), static_cast<size_t>(std::min<uint64_t>(n, buf.size()))));
    if (got == 0) return absl::DataLossError(fmt::format("{}: ends {} bytes before the point to skip to", name_, n));
    n -= got;
  }
  return absl::OkStatus();
}

namespace {

// The format the first bytes of a file or stream announce (kNone: none of the three).
Compression CompressionOf(const unsigned char* m, ssize_t n) {
  if (n >= 4 && m[0] == 0x28 && m[1] == 0xB5 && m[2] == 0x2F && m[3] == 0xFD) return Compression::kZstd;
  // A zstd skippable frame (magic 0x184D2A50..5F) first: pzstd starts every file with one.
  if (n >= 4 && (m[0] & 0xF0) == 0x50 && m[1] == 0x2A && m[2] == 0x4D && m[3] == 0x18) return Compression::kZstd;
  if (n >= 6 && m[0] == 0xFD && std::memcmp(m + 1, "7zXZ", 4) == 0 && m[5] == 0) return Compression::kXz;
  if (n >= 2 && m[0] == 0x1F && m[1] == 0x8B) return Compression::kGzip;
  return Compression::kNone;
}

// The bytes of `fd` as read through compression c's decoder (kNone: as they are).
std::unique_ptr<ByteSource> Decompressing(std::unique_ptr<FdSource> fd, Compression c) {
  switch (c) {
    case Compression::kZstd: return std::unique_ptr<ByteSource>(new ZstdSource(std::move(fd)));
    case Compression::kXz: return std::unique_ptr<ByteSource>(new XzSource(std::move(fd)));
    case Compression::kGzip: return std::unique_ptr<ByteSource>(new GzipSource(std::move(fd)));
    case Compression::kNone: break;
  }
  return std::unique_ptr<ByteSource>(std::move(fd));
}

// The refusal of an input in another binary format (OtherBinaryFormat's name for it: `other`).
absl::Status OtherFormatError(std::string_view name, std::string_view other) {
  return absl::InvalidArgumentError(fmt::format(
      "{}: {} data, which ptk does not read (it reads plain text, .zst, .xz and .gz); convert it first", name, other));
}

// Standard input, its format told by its first bytes as a file's is (`zstd -dc`-less pipes: `curl
// URL.zst | ptk-tokenize --input -` read the compressed bytes as text, every line a bad record).
absl::StatusOr<std::unique_ptr<ByteSource>> OpenStdin() {
  std::string head(6, '\0');
  size_t n = 0;
  while (n < head.size()) {
    const ssize_t r = ::read(STDIN_FILENO, head.data() + n, head.size() - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoToStatus(errno, "read <stdin>");
    if (r == 0) break;
    n += static_cast<size_t>(r);
  }
  head.resize(n);
  const auto* m = reinterpret_cast<const unsigned char*>(head.data());
  if (std::string_view other = OtherBinaryFormat(m, static_cast<ssize_t>(n)); !other.empty())
    return OtherFormatError("<stdin>", other);
  const Compression c = CompressionOf(m, static_cast<ssize_t>(n));
  auto fd = std::make_unique<FdSource>("<stdin>", STDIN_FILENO, false, std::move(head));
  return Decompressing(std::move(fd), c);
}

}  // namespace

Compression DetectCompression(const std::string& path) {
  if (path == "-") return Compression::kNone;
  auto opened = OpenRegularFile(path);  // a FIFO is neither waited on nor read from here
  if (opened.ok()) {
    const int fd = *opened;
    unsigned char m[6] = {0};
    ssize_t n = ::read(fd, m, sizeof(m));
    ::close(fd);
    if (n > 0) return CompressionOf(m, n);  // the content decides, not the name
  }
  // Unreadable or empty: the name is all there is (an empty .zst is then reported as such).
  if (EndsWith(path, ".zst") || EndsWith(path, ".zstd")) return Compression::kZstd;
  if (EndsWith(path, ".xz")) return Compression::kXz;
  if (EndsWith(path, ".gz")) return Compression::kGzip;
  return Compression::kNone;
}

std::string StripCompressionSuffix(const std::string& path) {
  for (std::string_view suf : kCompressionSuffixes)
    if (EndsWith(path, suf)) return path.substr(0, path.size() - suf.size());
  return path;
}

std::vector<std::string> CompressedSuffixes() {
  return std::vector<std::string>(std::begin(kCompressionSuffixes), std::end(kCompressionSuffixes));
}

std::vector<std::string> JsonInputSuffixes() {
  std::vector<std::string> out;
  for (std::string_view base : {".jsonl", ".json"}) {
    out.emplace_back(base);
    for (std::string_view suf : kCompressionSuffixes) out.push_back(std::string(base) + std::string(suf));
  }
  return out;
}

std::string DescribeSuffixes(const std::vector<std::string>& suffixes) {
  std::string s;
  for (size_t i = 0; i < suffixes.size(); ++i)
    s += (i == 0 ? "" : i + 1 == suffixes.size() ? " and " : ", ") + suffixes[i];
  return s;
}

absl::StatusOr<std::unique_ptr<ByteSource>> OpenByteSource(const std::string& path) {
  if (path == "-") return OpenStdin();
  return OpenByteSource(path, DetectCompression(path));
}

absl::StatusOr<std::unique_ptr<ByteSource>> OpenByteSource(const std::string& path, Compression c) {
  std::unique_ptr<FdSource> fd;
  if (path == "-") {
    fd = std::make_unique<FdSource>("<stdin>", STDIN_FILENO, false);
  } else {
    // Streams come from `-`; a named FIFO or device is refused (inputs are regular files).
    PTK_ASSIGN_OR_RETURN(const int f, OpenRegularFile(path));
    ::posix_fadvise(f, 0, 0, POSIX_FADV_SEQUENTIAL);
    if (c == Compression::kNone) {
      unsigned char m[8] = {0};
      ssize_t n = ::pread(f, m, sizeof(m), 0);
      std::string_view other = OtherBinaryFormat(m, n);
      if (!other.empty()) {
        ::close(f);
        return OtherFormatError(path, other);
      }
      // Named as compressed, yet none of the three: a damaged or mislabelled file (random bytes
      // named .zst were "extracted" as they were, exit 0). The content decides the format, but
      // only among the formats it can be; a plain-text file is renamed, not guessed at.
      if (const std::string plain = StripCompressionSuffix(path); plain != path && n > 0) {
        ::close(f);
        std::string first;
        for (ssize_t i = 0; i < std::min<ssize_t>(n, 4); ++i) first += fmt::format("{}{:02x}", i ? " " : "", m[i]);
        return absl::DataLossError(
            fmt::format("{}: named {} but it is not compressed data (it starts with bytes {}, which are no zstd, xz "
                        "or gzip header); a damaged file, or plain text to rename {}",
                        path, path.substr(plain.size()), first, Basename(plain)));
      }
    }
    fd = std::make_unique<FdSource>(path, f, true);
  }
  return Decompressing(std::move(fd), c);
}

}  // namespace ptk
