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
    int adv = MADV_NORMAL;
    switch (advice) {
      case Advice::kSequential: adv = MADV_SEQUENTIAL; break;
      case Advice::kRandom: adv = MADV_RANDOM; break;
      case Advice::kWillNeed: adv = MADV_WILLNEED; break;
      default: break;
    }
    if (adv != MADV_NORMAL) ::madvise(p, size, adv);
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return std::unique_ptr<MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace ptk
