// TensorBoard event files through protobuf (the Event/Summary messages) and ISA-L's CRC-32C.
#include "tensorboard/summary_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/core.h>
#include <isa-l/crc.h>

#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/status.h"
#include "tensorboard_event.pb.h"

namespace ptk {
namespace {

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t Crc32c(std::string_view data, uint32_t crc) {
  // ISA-L works on the register (pre- and post-inverted CRC); its length is an int.
  uint32_t reg = ~crc;
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  size_t n = data.size();
  while (n > 0) {
    const int chunk = static_cast<int>(std::min<size_t>(n, 1 << 30));
    reg = crc32_iscsi(const_cast<unsigned char*>(p), chunk, reg);
    p += chunk;
    n -= static_cast<size_t>(chunk);
  }
  return ~reg;
}

uint32_t MaskedCrc32c(std::string_view data) {
  const uint32_t crc = Crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string FrameRecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  PutLe(&out, data.size(), 8);
  PutLe(&out, MaskedCrc32c(out), 4);
  out.append(data);
  PutLe(&out, MaskedCrc32c(data), 4);
  return out;
}

double WallTimeNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

absl::StatusOr<std::unique_ptr<SummaryWriter>> SummaryWriter::Create(const std::string& dir,
                                                                     const SummaryWriterOptions& options) {
  PTK_RETURN_IF_ERROR(MakeDirs(dir));
  std::string host = options.host;
  if (host.empty()) {
    char buf[256] = {};
    if (gethostname(buf, sizeof buf - 1) != 0) return ErrnoToStatus(errno, "gethostname");
    host = buf;
  }
  const double start = options.wall_time >= 0 ? options.wall_time : WallTimeNow();
  // PyTorch's name (time, host, pid, a counter); O_EXCL: never append to another writer's file.
  std::string path;
  int fd = -1;
  for (int n = 0; fd < 0; ++n) {
    path = JoinPath(
        dir, fmt::format("events.out.tfevents.{:010d}.{}.{}.{}", static_cast<int64_t>(start), host, ::getpid(), n));
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && (errno != EEXIST || n >= 1000)) return ErrnoToStatus(errno, "create " + path);
  }
  FILE* f = ::fdopen(fd, "wb");
  if (!f) {
    const int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, "open " + path);
  }
  std::unique_ptr<SummaryWriter> w(new SummaryWriter(path, f));
  // The first record names the format, as every TensorFlow event file's does.
  tensorboard::proto::Event e;
  e.set_wall_time(start);
  e.set_file_version("brain.Event:2");
  e.mutable_source_metadata()->set_writer(options.writer);
  w->AddEvent(e.SerializeAsString());
  PTK_RETURN_IF_ERROR(w->Flush());
  return w;
}

SummaryWriter::~SummaryWriter() {
  if (f_) std::fclose(f_);
}

void SummaryWriter::AddEvent(const std::string& serialized) { pending_ += FrameRecord(serialized); }

void SummaryWriter::AddScalar(std::string_view tag, double value, int64_t step, double wall_time) {
  tensorboard::proto::Event e;
  e.set_wall_time(wall_time >= 0 ? wall_time : WallTimeNow());
  e.set_step(step);
  tensorboard::proto::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(std::string(tag));
  v->set_simple_value(static_cast<float>(value));
  AddEvent(e.SerializeAsString());
}

absl::Status SummaryWriter::Flush() {
  if (!f_) return absl::OkStatus();
  if (!pending_.empty() && std::fwrite(pending_.data(), 1, pending_.size(), f_) != pending_.size())
    return ErrnoToStatus(errno, "write " + path_);
  pending_.clear();
  if (std::fflush(f_) != 0) return ErrnoToStatus(errno, "write " + path_);
  return absl::OkStatus();
}

absl::Status SummaryWriter::Sync() {
  if (!f_) return absl::OkStatus();
  PTK_RETURN_IF_ERROR(Flush());
  if (::fsync(::fileno(f_)) != 0) return ErrnoToStatus(errno, "fsync " + path_);
  return absl::OkStatus();
}

absl::Status SummaryWriter::Close() {
  if (!f_) return absl::OkStatus();
  absl::Status st = Flush();
  if (st.ok() && ::fsync(::fileno(f_)) != 0) st = ErrnoToStatus(errno, "fsync " + path_);
  if (std::fclose(f_) != 0 && st.ok()) st = ErrnoToStatus(errno, "close " + path_);
  f_ = nullptr;
  return st;
}

}  // namespace ptk
