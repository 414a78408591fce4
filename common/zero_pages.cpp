#include "common/zero_pages.h"

#include <sys/mman.h>

#include <cstdint>

#include "common/status.h"

namespace ptk {

ZeroPages::ZeroPages(size_t bytes) {
  *this = Try(bytes);
  PTK_CHECK(bytes == 0 || p_ != nullptr);
}

ZeroPages ZeroPages::Try(size_t bytes) {
  ZeroPages z;
  if (bytes == 0) return z;
  constexpr size_t kHuge = 2u << 20;
  const size_t alloc = (bytes + kHuge - 1) / kHuge * kHuge;
  // NORESERVE: what is reserved but never touched is not counted against the commit limit.
  void* raw =
      ::mmap(nullptr, alloc + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return z;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) ::munmap(raw, aligned - start);
  if (start + kHuge > aligned) ::munmap(reinterpret_cast<void*>(aligned + alloc), start + kHuge - aligned);
  z.p_ = reinterpret_cast<void*>(aligned);
  z.bytes_ = alloc;
  ::madvise(z.p_, alloc, MADV_HUGEPAGE);
  return z;
}

ZeroPages& ZeroPages::operator=(ZeroPages&& o) noexcept {
  if (this != &o) {
    if (p_) ::munmap(p_, bytes_);
    p_ = o.p_;
    bytes_ = o.bytes_;
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

ZeroPages::~ZeroPages() {
  if (p_) ::munmap(p_, bytes_);
}

}  // namespace ptk
