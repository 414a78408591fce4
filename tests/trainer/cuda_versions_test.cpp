// The CUDA start-up line (trainer/cuda/cuda_versions.h): every library's run-time version beside
// the build's headers, and a warning for each one older than its headers. Runs without a GPU.
#include "trainer/cuda/cuda_versions.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ptk::cuda {
namespace {

CudaVersions Current() {
  CudaVersions v;
  v.driver = 13000;
  v.runtime = v.runtime_headers = 13000;
  v.cublaslt = v.cublaslt_headers = 130100;
  v.cudnn = v.cudnn_headers = 91900;
  v.nccl = v.nccl_headers = 22809;
  v.gpu = "cuda:0 NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB";
  return v;
}

TEST(CudaVersions, OneLineWithEveryLibraryAndTheGpu) {
  std::vector<std::string> warnings;
  EXPECT_EQ(DescribeCudaVersions(Current(), &warnings),
            "CUDA: driver 13.0, runtime 13.0 (built with 13.0), cuBLASLt 13.1.0 (built with 13.1.0), cuDNN 9.19.0 "
            "(built with 9.19.0), NCCL 2.28.9 (built with 2.28.9), GPU cuda:0 NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB");
  EXPECT_TRUE(warnings.empty());
  // Newer libraries than the headers: no warning.
  CudaVersions newer = Current();
  newer.driver = 13020;
  newer.cudnn = 92000;
  newer.nccl = 22901;
  DescribeCudaVersions(newer, &warnings);
  EXPECT_TRUE(warnings.empty());
}

TEST(CudaVersions, WarnsForEachLibraryOlderThanItsHeaders) {
  CudaVersions v = Current();
  v.driver = 12080;
  v.cudnn = 91000;
  v.nccl = 22704;
  v.cublaslt = 130003;
  std::vector<std::string> warnings;
  const std::string line = DescribeCudaVersions(v, &warnings);
  EXPECT_NE(line.find("cuDNN 9.10.0 (built with 9.19.0)"), std::string::npos) << line;
  ASSERT_EQ(warnings.size(), 4u);
  EXPECT_EQ(warnings[0],
            "the NVIDIA driver supports CUDA 12.8, older than the CUDA 13.0 this ptk-train was built with: update the "
            "driver");
  EXPECT_EQ(warnings[1],
            "cuBLASLt 13.0.3 was loaded, older than the 13.1.0 headers this ptk-train was built with: update it, or "
            "build ptk against it");
  EXPECT_NE(warnings[2].find("cuDNN 9.10.0 was loaded, older than the 9.19.0 headers"), std::string::npos);
  EXPECT_NE(warnings[3].find("NCCL 2.27.4 was loaded, older than the 2.28.9 headers"), std::string::npos);
  // Unknown versions (0) are shown as ? and never warned about.
  CudaVersions unknown;
  unknown.runtime_headers = 13000;
  warnings.clear();
  EXPECT_NE(DescribeCudaVersions(unknown, &warnings).find("driver ?, runtime ? (built with 13.0)"), std::string::npos);
  EXPECT_TRUE(warnings.empty());
}

}  // namespace
}  // namespace ptk::cuda
