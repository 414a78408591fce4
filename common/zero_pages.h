// Anonymous memory for large tables and buffers (see ZeroPages).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <type_traits>

namespace ptk {

// Anonymous memory straight from mmap: zero until written and faulted in only where touched, 2 MiB
// aligned with transparent huge pages advised. Reserving the most a buffer may ever need costs
// nothing until it is used, and the buffer never moves (no copying, no zero-filling, no fresh pages
// for a bigger copy).
class ZeroPages {
 public:
  ZeroPages() = default;
  explicit ZeroPages(size_t bytes);  // fails (PTK_CHECK) when the system refuses the address space
  // The same, or an empty ZeroPages (bytes() == 0) when the system refuses (strict overcommit,
  // `ulimit -v`), for callers that can do with less.
  static ZeroPages Try(size_t bytes);
  ZeroPages(ZeroPages&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  ZeroPages& operator=(ZeroPages&& o) noexcept;
  ~ZeroPages();
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// n elements of a trivially copyable T on ZeroPages: filling a table costs page faults only where
// entries land, with huge pages a handful instead of one per 4 KB.
template <typename T>
class PageArray {
 public:
  // n elements, each `fill` (written only when fill is not all zero bytes).
  void Assign(size_t n, const T& fill) {
    static_assert(std::is_trivially_copyable_v<T>);
    mem_ = ZeroPages(n * sizeof(T));
    n_ = n;
    const T zero{};
    if (std::memcmp(&fill, &zero, sizeof(T)) != 0) std::fill(data(), data() + n, fill);
  }
  size_t size() const { return n_; }
  T* data() { return mem_.as<T>(); }
  const T* data() const { return mem_.as<T>(); }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + n_; }

 private:
  ZeroPages mem_;
  size_t n_ = 0;
};

}  // namespace ptk
