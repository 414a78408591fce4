// (in progress)
#include "trainer/cuda/ops_cuda.h"
