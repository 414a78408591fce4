// The versions a CUDA run depends on (the driver, the CUDA runtime, cuBLASLt, cuDNN, NCCL, the GPU),
// as loaded at run time beside the headers the build used, in one line, and a warning for each
// runtime library older than its headers (an API the build compiled against may be missing or
// behave differently). Pure host code: the line and the warnings are checked without a GPU;
// QueryCudaVersions (cuda_common.cu) fills the numbers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <fmt/core.h>

namespace ptk::cuda {

struct CudaVersions {
  // CUDA's encoding: 1000 * major + 10 * minor (12080 is 12.8).
  int driver = 0, runtime = 0, runtime_headers = 0;
  // major * 10000 + minor * 100 + patch (cuBLAS 13.1.0 is 130100, cuDNN 9.19.0 is 91900, NCCL
  // 2.28.9 is 22809); 0: unknown (not loaded).
  int64_t cublaslt = 0, cublaslt_headers = 0, cudnn = 0, cudnn_headers = 0, nccl = 0, nccl_headers = 0;
  std::string gpu;  // "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB"
};

inline std::string CudaVersionString(int v) { return v > 0 ? fmt::format("{}.{}", v / 1000, (v % 1000) / 10) : "?"; }
inline std::string LibVersionString(int64_t v) {
  return v > 0 ? fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100) : "?";
}

// "CUDA: driver 12.8, runtime 13.0 (built with 13.0), cuBLASLt 13.1.0 (13.1.0), cuDNN 9.19.0
// (9.19.0), NCCL 2.28.9 (2.28.9), GPU NVIDIA H100 ..."; *warnings gets one line per library
// older than its headers.
inline std::string DescribeCudaVersions(const CudaVersions& v, std::vector<std::string>* warnings) {
  if (v.driver > 0 && v.driver < v.runtime_headers)
    warnings->push_back(
        fmt::format("the NVIDIA driver supports CUDA {}, older than the CUDA {} this ptk-train was built "
                    "with: update the driver",
                    CudaVersionString(v.driver), CudaVersionString(v.runtime_headers)));
  auto older = [&](const char* name, const std::string& loaded, const std::string& built, bool is_older) {
    if (is_older)
      warnings->push_back(
          fmt::format("{} {} was loaded, older than the {} headers this ptk-train was built with: "
                      "update it, or build ptk against it",
                      name, loaded, built));
  };
  older("the CUDA runtime", CudaVersionString(v.runtime), CudaVersionString(v.runtime_headers),
        v.runtime > 0 && v.runtime < v.runtime_headers);
  older("cuBLASLt", LibVersionString(v.cublaslt), LibVersionString(v.cublaslt_headers),
        v.cublaslt > 0 && v.cublaslt < v.cublaslt_headers);
  older("cuDNN", LibVersionString(v.cudnn), LibVersionString(v.cudnn_headers),
        v.cudnn > 0 && v.cudnn < v.cudnn_headers);
  older("NCCL", LibVersionString(v.nccl), LibVersionString(v.nccl_headers), v.nccl > 0 && v.nccl < v.nccl_headers);
  return fmt::format(
      "CUDA: driver {}, runtime {} (built with {}), cuBLASLt {} (built with {}), cuDNN {} (built with {}), NCCL {} "
      "(built with {}), GPU {}",
      CudaVersionString(v.driver), CudaVersionString(v.runtime), CudaVersionString(v.runtime_headers),
      LibVersionString(v.cublaslt), LibVersionString(v.cublaslt_headers), LibVersionString(v.cudnn),
      LibVersionString(v.cudnn_headers), LibVersionString(v.nccl), LibVersionString(v.nccl_headers),
      v.gpu.empty() ? "?" : v.gpu);
}

// The numbers of this process's libraries and of device `device` (cuda_common.cu).
CudaVersions QueryCudaVersions(int device);

}  // namespace ptk::cuda
