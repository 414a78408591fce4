// ptk-tokenize's first stage: input files -> batches of whole lines.
#include <cstdio>
#include <cstring>

#include "common/logging.h"
#include "common/status.h"
#include "common/utf8.h"
#include "dataprep/tokenize/tokenize_stages.h"

namespace ptk::tokenize_detail {

size_t LineReader::BatchTarget() const {
  // The first batch is whole: nothing is known yet of how much a stored byte decodes to.
  if (tail_share_ <= 0 || total_raw_ == 0 || raw_done_ == 0 || decoded_done_ == 0) return batch_bytes_;
  const uint64_t raw_left = total_raw_ > raw_done_ ? total_raw_ - raw_done_ : 0;
  // Decoded bytes a stored byte gives (compressed inputs), as seen so far (a decompressor reads
  // ahead, so early on this underestimates and batches shrink a little sooner than they need to).
  const double expand = static_cast<double>(decoded_done_) / static_cast<double>(raw_done_);
  const double want = static_cast<double>(raw_left) * expand * tail_share_;
  if (want >= static_cast<double>(batch_bytes_)) return batch_bytes_;
  return std::max(std::min(kMinTailBatch, batch_bytes_), static_cast<size_t>(want));
}

namespace {

// Splits b's first `end` bytes into lines as Python's universal newlines do (Megatron reads with
// open(..., "r")): "\n", "\r\n" and a bare "\r" each end a line.
void SplitLines(Batch* b, size_t end) {
  size_t pos = 0;
  while (pos < end) {
    const void* nl = std::memchr(b->data.get() + pos, '\n', end - pos);
    const size_t stop = nl ? static_cast<size_t>(static_cast<const char*>(nl) - b->data.get()) : end;
    while (true) {
      const void* cr = std::memchr(b->data.get() + pos, '\r', stop - pos);
      if (!cr) break;
      const size_t at = static_cast<size_t>(static_cast<const char*>(cr) - b->data.get());
      if (at + 1 == stop && nl) break;  // "\r\n"
      b->lines.push_back({pos, at - pos});
      pos = at + 1;
    }
    size_t len = stop - pos;
    if (len > 0 && b->data[pos + len - 1] == '\r') --len;
    if (pos < stop || nl) b->lines.push_back({pos, len});
    pos = stop + 1;
  }
}

}  // namespace

absl::Status LineReader::OpenNextFile() {
  PTK_ASSIGN_OR_RETURN(src_, OpenByteSource(files_[file_]));
  if (announce_) log::Out("Opening " + files_[file_]);  // Megatron's line (stdout)
  line_no_ = 1;
  at_file_start_ = true;
  consumed_ = 0;
  if (file_ == start_.file && start_.offset > 0) {  // resuming inside this file
    PTK_RETURN_IF_ERROR(src_->Skip(start_.offset));
    consumed_ = start_.offset;
    line_no_ = start_.line_no;
    at_file_start_ = false;
  }
  carry_.clear();
  last_raw_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<size_t> LineReader::FillBatch(Batch* b, size_t target, bool* eof) {
  size_t cap = std::max(batch_bytes_, carry_.size() * 2) + (64 << 10);
  if (b->data_cap < cap) {
    b->data.reset(new char[cap + kPadding]);
    b->data_cap = cap;
  }
  cap = b->data_cap;
  std::memcpy(b->data.get(), carry_.data(), carry_.size());
  size_t size = carry_.size();
  size_t scan_from = 0;
  size_t last_nl = std::string::npos;
  carry_.clear();
  *eof = false;
  while (true) {
    if (size >= target && last_nl != std::string::npos) break;
    if (size == cap) {
      if (last_nl != std::string::npos) break;
      size_t ncap = cap * 2;  // a line longer than the batch: grow until it ends
      std::unique_ptr<char[]> nd(new char[ncap + kPadding]);
      std::memcpy(nd.get(), b->data.get(), size);
      b->data = std::move(nd);
      b->data_cap = cap = ncap;
    }
    // Up to the target and a little past it, where the last line's end should lie; then on in
    // 64 KiB steps until a line ends.
    const size_t room = std::min(cap - size, size < target ? target - size + (16 << 10) : size_t{64 << 10});
    PTK_ASSIGN_OR_RETURN(size_t n, src_->Read(b->data.get() + size, room));
    if (n == 0) {
      *eof = true;
      break;
    }
    size += n;
    const void* nl = memrchr(b->data.get() + scan_from, '\n', size - scan_from);
    if (nl) last_nl = static_cast<size_t>(static_cast<const char*>(nl) - b->data.get());
    scan_from = size;
  }
  size_t end = size;
  if (!*eof) {
    end = last_nl + 1;
    carry_.assign(b->data.get() + end, size - end);
  }
  return end;
}

absl::StatusOr<std::unique_ptr<Batch>> LineReader::Next() {
  while (true) {
    if (!src_) {
      if (file_ >= static_cast<int>(files_.size())) return std::unique_ptr<Batch>();
      PTK_RETURN_IF_ERROR(OpenNextFile());
    }
    std::unique_ptr<Batch> b = pool_.Take();  // its buffers are reused, every field set below
    b->file = file_;
    b->lines.clear();
    bool eof = false;
    PTK_ASSIGN_OR_RETURN(const size_t end, FillBatch(b.get(), BatchTarget(), &eof));
    b->size = end;
    std::memset(b->data.get() + end, 0, kPadding);
    SplitLines(b.get(), end);
    if (at_file_start_ && !b->lines.empty()) {
      auto& l0 = b->lines[0];
      if (std::string_view(b->data.get() + l0.off, l0.len).starts_with(kUtf8Bom)) {  // the file's, not its text
        l0.off += kUtf8Bom.size();
        l0.len -= kUtf8Bom.size();
        // A file of a BOM only holds no line, as utf-8-sig reads it (not one blank line).
        if (eof && l0.len == 0 && l0.off == end) b->lines.erase(b->lines.begin());
      }
      at_file_start_ = false;
    }
    b->first_line_no = line_no_;
    b->first_global_line = global_line_;
    b->file_offset = consumed_;
    b->last_of_file = eof;
    consumed_ += end;
    line_no_ += static_cast<int64_t>(b->lines.size());
    global_line_ += static_cast<int64_t>(b->lines.size());
    uint64_t raw = src_->raw_bytes_read();
    b->raw_bytes = raw - last_raw_;
    last_raw_ = raw;
    raw_done_ += b->raw_bytes;
    decoded_done_ += end;
    if (eof) {
      src_.reset();
      ++file_;
    }
    if (b->lines.empty() && !eof) {
      pool_.Give(std::move(b));
      continue;
    }  // the last, even empty (an empty file): the sink learns that its file ended
    return b;
  }
}

}  // namespace ptk::tokenize_detail
