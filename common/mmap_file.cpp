// Read-only memory-mapped file.
#include "common/mmap_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <fmt/core.h>

#include "common/file_io.h"
#include "common/status.h"

namespace ptk {

namespace {

void AdviseRange(const uint8_t* data, size_t size, MappedFile::Advice advice) {
  int adv = MADV_NORMAL;
  switch (advice) {
    case MappedFile::Advice::kSequential: adv = MADV_SEQUENTIAL; break;
    case MappedFile::Advice::kRandom: adv = MADV_RANDOM; break;
    case MappedFile::Advice::kWillNeed: adv = MADV_WILLNEED; break;
    default: break;
  }
  ::madvise(const_cast<uint8_t*>(data), size, adv);  // a hint: its failure changes nothing
}

}  // namespace

void MappedFile::Advise(Advice advice) const {
  if (data_ != nullptr) AdviseRange(data_, size_, advice);
}

absl::StatusOr<std::unique_ptr<MappedFile>> MappedFile::Open(const std::string& path, Advice advice) {
  PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path));  // a FIFO refused, not waited on
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return ErrnoToStatus(e, fmt::format("stat {}", path));
  }
  size_t size = static_cast<size_t>(st.st_size);
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      return ErrnoToStatus(e, fmt::format("mmap {}", path));
    }
    data = static_cast<const uint8_t*>(p);
    if (advice != Advice::kNormal) AdviseRange(data, size, advice);
  }
  ::close(fd);
  return std::unique_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace ptk
