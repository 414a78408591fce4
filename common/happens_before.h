// Happens-before marks for ThreadSanitizer where the synchronisation is inside a library TSan
// cannot see (Debian's oneTBB is not instrumented): a hand-off of an object from one pipeline stage
// to the next, or the end of a parallel region. No-ops in every other build.
#pragma once

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define PTK_HAPPENS_BEFORE(p) __tsan_release(const_cast<void*>(static_cast<const volatile void*>(p)))
#define PTK_HAPPENS_AFTER(p) __tsan_acquire(const_cast<void*>(static_cast<const volatile void*>(p)))
#else
#define PTK_HAPPENS_BEFORE(p) ((void)(p))
#define PTK_HAPPENS_AFTER(p) ((void)(p))
#endif
