// The tests' precompiled header (PTK_PRECOMPILED_HEADERS, cmake/PtkHelpers.cmake): what most tests
// include and what costs most to parse. Each test still includes what it uses; this only makes the
// common part parse once. Nothing here may depend on a definition only some tests have.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
