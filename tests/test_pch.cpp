// Compiles tests/test_pch.h once into the precompiled header every test reuses (cmake/PtkHelpers.cmake).
#include "tests/test_pch.h"
