// File helpers, one header per concern: atomic_file.h (atomic writes, several files published
// together), file_io.h (reads, writes, copies, fsync, rename, remove, mkdir), file_paths.h (names,
// natural order, globs, identity, directory walks), human_format.h (sizes and durations). This
// header includes all four, for code that has not yet moved to the one it needs.
#pragma once

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"
