// The GPU a rank takes (trainer/cuda/local_rank_device.h): its local rank among the visible devices,
// as torchrun and Megatron; a local rank without one refused in one line naming CUDA_VISIBLE_DEVICES.
#include "trainer/cuda/local_rank_device.h"

#include <gtest/gtest.h>

#include "common/status.h"

namespace ptk::cuda {
namespace {

TEST(LocalRankDevice, TakesTheLocalRanksDeviceAmongTheVisibleOnes) {
  for (int r = 0; r < 8; ++r) EXPECT_EQ(LocalRankDevice("--device cuda", r, 8, nullptr).value(), r);
  // CUDA_VISIBLE_DEVICES=4,5: the runtime numbers them 0 and 1, local ranks 0 and 1 take them.
  EXPECT_EQ(LocalRankDevice("--distributed-backend nccl", 1, 2, "4,5").value(), 1);
}

TEST(LocalRankDevice, ALocalRankBeyondTheVisibleDevicesIsAUsageErrorNamingTheMask) {
  // srun --gpus-per-task=1: each task sees one GPU, SLURM_LOCALID goes to 7; no folding onto device 0.
  const absl::StatusOr<int> d = LocalRankDevice("--distributed-backend nccl", 3, 1, "3");
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(IsUsageError(d.status())) << d.status();
  const std::string m(d.status().message());
  EXPECT_NE(m.find("--distributed-backend nccl: local rank 3 has no GPU: 1 device(s) visible to this process "
                   "(CUDA_VISIBLE_DEVICES=3)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("--gpus-per-task"), std::string::npos) << m;
  const absl::StatusOr<int> unset = LocalRankDevice("--device cuda", 8, 8, nullptr);
  ASSERT_FALSE(unset.ok());
  EXPECT_NE(unset.status().message().find("local rank 8 has no GPU: 8 device(s) visible to this process "
                                          "(CUDA_VISIBLE_DEVICES unset)"),
            std::string::npos)
      << unset.status();
  EXPECT_TRUE(IsUsageError(LocalRankDevice("--device cuda", -1, 2, nullptr).status()));
}

TEST(LocalRankDevice, NoVisibleDeviceSaysWhatToDo) {
  const absl::Status s = LocalRankDevice("--device cuda", 0, 0, "").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("--device cuda: no CUDA device is visible"), std::string::npos) << s;
  EXPECT_NE(s.message().find("CUDA_VISIBLE_DEVICES=)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("train with --device cpu, or"), std::string::npos) << s;
  const absl::Status nccl = LocalRankDevice("--distributed-backend nccl", 0, 0, nullptr).status();
  EXPECT_NE(nccl.message().find("train with --device cpu (gloo)"), std::string::npos) << nccl;
}

}  // namespace
}  // namespace ptk::cuda
