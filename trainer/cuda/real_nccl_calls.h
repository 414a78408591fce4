// NcclGuard's calls (nccl_guard.h) on a real NCCL communicator, for comm_nccl.cpp.
#pragma once

#include <nccl.h>

#include <string>

#include "trainer/cuda/nccl_guard.h"

namespace ptk::cuda {

static_assert(kNcclSuccess == ncclSuccess && kNcclInternalError == ncclInternalError &&
              kNcclInProgress == ncclInProgress);

// NcclGuard's calls on a real communicator.
class RealNcclCalls : public NcclCalls {
 public:
  explicit RealNcclCalls(ncclComm_t comm) : comm_(comm) {}
  int GetAsyncError(int* async) override {
    ncclResult_t a = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &a);
    *async = a;
    return r;
  }
  std::string LastError() override {
    const char* e = ncclGetLastError(comm_);
    return e ? e : "";
  }
  std::string ErrorString(int result) override { return ncclGetErrorString(static_cast<ncclResult_t>(result)); }
  int Finalize() override { return ncclCommFinalize(comm_); }
  int Destroy() override { return ncclCommDestroy(comm_); }
  int Abort() override { return ncclCommAbort(comm_); }

 private:
  ncclComm_t comm_;
};

}  // namespace ptk::cuda
