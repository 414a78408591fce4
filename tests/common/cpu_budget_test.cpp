// ReadCpuBudget on fake /proc/self/cgroup files and cgroup trees (v1 and v2), and how
// ChooseTrainingThreads combines a cgroup quota with the ranks on a node.
#include "common/cpu_budget.h"

#include <sched.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "common/slurm_env.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using ::ptk::testing::TempDir;
using ::ptk::testing::WriteFile;

// A fake machine: DIR/cgroup (this process's /proc/self/cgroup) and DIR/fs (the cgroup mount).
class FakeCgroups {
 public:
  CgroupFiles files() const { return {dir_ / "cgroup", dir_ / "fs"}; }
  void Own(const std::string& proc_self_cgroup) { WriteFile(dir_ / "cgroup", proc_self_cgroup); }
  // Writes `content` to FILE in the cgroup `cgroup` ("/" the mount root; "cpu,cpuacct/a" a v1 one).
  void Set(const std::string& cgroup, const std::string& file, const std::string& content) {
    const std::string d = dir_ / "fs" + (cgroup == "/" ? "" : "/" + cgroup);
    std::filesystem::create_directories(d);
    WriteFile(d + "/" + file, content);
  }

 private:
  TempDir dir_;
};

TEST(ReadCpuBudget, V2QuotaCapsTheAffinityMask) {
  FakeCgroups fake;
  fake.Own("0::/kubepods/pod1/ctr\n");
  fake.Set("kubepods/pod1/ctr", "cpu.max", "400000 100000\n");
  const CpuBudget b = ReadCpuBudget(96, fake.files());
  EXPECT_EQ(b.cpus, 4);
  EXPECT_EQ(b.affinity_cpus, 96);
  EXPECT_EQ(b.cgroup_cpus, 4);
  EXPECT_EQ(b.reason, "cgroup cpu.max 4 at /kubepods/pod1/ctr");
}

TEST(ReadCpuBudget, V2MaxIsNoQuota) {
  FakeCgroups fake;
  fake.Own("0::/user.slice\n");
  fake.Set("user.slice", "cpu.max", "max 100000\n");
  const CpuBudget b = ReadCpuBudget(8, fake.files());
  EXPECT_EQ(b.cpus, 8);
  EXPECT_EQ(b.cgroup_cpus, 0);
  EXPECT_EQ(b.reason, "affinity");
}

// Every ancestor's quota limits the process: the smallest wins, wherever it is; levels without a
// cpu.max (the v2 root) have none.
TEST(ReadCpuBudget, NestedCgroupsTheSmallestQuotaWins) {
  FakeCgroups fake;
  fake.Own("0::/kubepods/pod1/ctr\n");
  fake.Set("kubepods/pod1/ctr", "cpu.max", "800000 100000\n");
  fake.Set("kubepods/pod1", "cpu.max", "300000 100000\n");
  fake.Set("kubepods", "cpu.max", "max 100000\n");
  CpuBudget b = ReadCpuBudget(64, fake.files());
  EXPECT_EQ(b.cpus, 3);
  EXPECT_EQ(b.reason, "cgroup cpu.max 3 at /kubepods/pod1");
  fake.Set("/", "cpu.max", "200000 100000\n");  // a container's own cgroup mounted as the root
  b = ReadCpuBudget(64, fake.files());
  EXPECT_EQ(b.cpus, 2);
  EXPECT_EQ(b.reason, "cgroup cpu.max 2 at /");
}

// Without a cgroup namespace a container sees its host path in /proc/self/cgroup but its own cgroup
// at the mount root: the levels that do not exist are passed over.
TEST(ReadCpuBudget, AbsentLevelsArePassedOver) {
  FakeCgroups fake;
  fake.Own("0::/system.slice/docker-abc.scope\n");
  fake.Set("/", "cpu.max", "150000 100000");
  const CpuBudget b = ReadCpuBudget(16, fake.files());
  EXPECT_EQ(b.cpus, 2);
  EXPECT_EQ(b.reason, "cgroup cpu.max 2 at /");
}

TEST(ReadCpuBudget, V1QuotaOverPeriod) {
  FakeCgroups fake;
  fake.Own("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n");
  fake.Set("cpu,cpuacct/docker/abc", "cpu.cfs_quota_us", "600000\n");
  fake.Set("cpu,cpuacct/docker/abc", "cpu.cfs_period_us", "100000\n");
  CpuBudget b = ReadCpuBudget(32, fake.files());
  EXPECT_EQ(b.cpus, 6);
  EXPECT_EQ(b.reason, "cgroup cpu.cfs_quota_us 6 at /docker/abc");
  // The controller folder under its single name, as systemd links it, when the joined one is absent.
  FakeCgroups linked;
  linked.Own("4:cpuacct,cpu:/job\n");
  linked.Set("cpu/job", "cpu.cfs_quota_us", "50000");
  linked.Set("cpu/job", "cpu.cfs_period_us", "100000");
  b = ReadCpuBudget(32, linked.files());
  EXPECT_EQ(b.cpus, 1);
  EXPECT_EQ(b.reason, "cgroup cpu.cfs_quota_us 1 at /job");
}

TEST(ReadCpuBudget, V1MinusOneIsNoQuota) {
  FakeCgroups fake;
  fake.Own("4:cpu,cpuacct:/\n");
  fake.Set("cpu,cpuacct", "cpu.cfs_quota_us", "-1\n");
  fake.Set("cpu,cpuacct", "cpu.cfs_period_us", "100000\n");
  const CpuBudget b = ReadCpuBudget(12, fake.files());
  EXPECT_EQ(b.cpus, 12);
  EXPECT_EQ(b.cgroup_cpus, 0);
  EXPECT_EQ(b.reason, "affinity");
}

// 1.5 CPUs let two threads run part of the time each: rounded up; a sliver is still 1.
TEST(ReadCpuBudget, FractionalQuotasRoundUp) {
  for (const auto& [cpu_max, cpus] : {std::pair<const char*, int>{"150000 100000", 2},
                                      {"100001 100000", 2},
                                      {"100000 100000", 1},
                                      {"1000 100000", 1},
                                      {"250000 50000", 5}}) {
    SCOPED_TRACE(cpu_max);
    FakeCgroups fake;
    fake.Own("0::/a\n");
    fake.Set("a", "cpu.max", cpu_max);
    EXPECT_EQ(ReadCpuBudget(64, fake.files()).cpus, cpus);
  }
}

// A file that cannot be parsed is left out, and named in the reason; the others still count.
TEST(ReadCpuBudget, MalformedFilesAreLeftOutAndNamed) {
  for (const char* bad : {"", "4", "four 100000", "400000 0", "400000 100000 7", "-5 100000", "0 100000", "max -1"}) {
    SCOPED_TRACE(bad);
    FakeCgroups fake;
    fake.Own("0::/a/b\n");
    fake.Set("a/b", "cpu.max", bad);
    CpuBudget b = ReadCpuBudget(8, fake.files());
    EXPECT_EQ(b.cpus, 8);
    EXPECT_EQ(b.cgroup_cpus, 0);
    EXPECT_TRUE(b.reason.starts_with("affinity; ")) << b.reason;
    EXPECT_NE(b.reason.find("/a/b/cpu.max: "), std::string::npos) << b.reason;
    EXPECT_NE(b.reason.find("left out"), std::string::npos) << b.reason;
    fake.Set("a", "cpu.max", "200000 100000");
    b = ReadCpuBudget(8, fake.files());
    EXPECT_EQ(b.cpus, 2);
    EXPECT_TRUE(b.reason.starts_with("cgroup cpu.max 2 at /a; ")) << b.reason;
  }
  for (const auto& [quota, period] : {std::pair<const char*, const char*>{"x", "100000"},
                                      {"0", "100000"},
                                      {"-2", "100000"},
                                      {"400000", "0"},
                                      {"400000", "soon"}}) {
    SCOPED_TRACE(std::string(quota) + " / " + period);
    FakeCgroups fake;
    fake.Own("3:cpu:/j\n");
    fake.Set("cpu/j", "cpu.cfs_quota_us", quota);
    fake.Set("cpu/j", "cpu.cfs_period_us", period);
    const CpuBudget b = ReadCpuBudget(8, fake.files());
    EXPECT_EQ(b.cpus, 8);
    EXPECT_TRUE(b.reason.starts_with("affinity; ")) << b.reason;
    EXPECT_NE(b.reason.find("/cpu/j/cpu.cfs_"), std::string::npos) << b.reason;
  }
  FakeCgroups lines;
  lines.Own("garbage\n0::/a\n");
  lines.Set("a", "cpu.max", "300000 100000");
  const CpuBudget b = ReadCpuBudget(8, lines.files());
  EXPECT_EQ(b.cpus, 3);  // the good line still read
  EXPECT_NE(b.reason.find("cgroup:1: \"garbage\" is not \"ID:CONTROLLERS:PATH\""), std::string::npos) << b.reason;
}

TEST(ReadCpuBudget, MissingFilesFallBackToAffinity) {
  FakeCgroups fake;  // no /proc/self/cgroup at all
  CpuBudget b = ReadCpuBudget(6, fake.files());
  EXPECT_EQ(b.cpus, 6);
  EXPECT_TRUE(b.reason.starts_with("affinity; no cgroup read: ")) << b.reason;
  fake.Own("0::/a\n");  // a cgroup, no files below the mount
  b = ReadCpuBudget(6, fake.files());
  EXPECT_EQ(b.cpus, 6);
  EXPECT_EQ(b.reason, "affinity");
  FakeCgroups v1;  // a quota without its period
  v1.Own("2:cpu,cpuacct:/a\n");
  v1.Set("cpu,cpuacct/a", "cpu.cfs_quota_us", "200000");
  b = ReadCpuBudget(6, v1.files());
  EXPECT_EQ(b.cpus, 6);
  EXPECT_NE(b.reason.find("cpu.cfs_period_us: missing beside its cpu.cfs_quota_us: left out"), std::string::npos)
      << b.reason;
}

// A file that exists but cannot be read (a directory where the file belongs) is left out, named.
TEST(ReadCpuBudget, UnreadableFilesAreLeftOutAndNamed) {
  FakeCgroups fake;
  fake.Own("0::/a\n");
  fake.Set("a/cpu.max", "x", "");  // cpu.max is a directory
  const CpuBudget b = ReadCpuBudget(6, fake.files());
  EXPECT_EQ(b.cpus, 6);
  EXPECT_TRUE(b.reason.starts_with("affinity; ")) << b.reason;
  EXPECT_NE(b.reason.find("/a/cpu.max"), std::string::npos) << b.reason;
}

TEST(ReadCpuBudget, AnAffinityMaskSmallerThanTheQuotaWins) {
  FakeCgroups fake;
  fake.Own("0::/a\n");
  fake.Set("a", "cpu.max", "400000 100000");
  const CpuBudget b = ReadCpuBudget(2, fake.files());
  EXPECT_EQ(b.cpus, 2);
  EXPECT_EQ(b.cgroup_cpus, 4);
  EXPECT_EQ(b.cgroup, "cgroup cpu.max 4 at /a");
  EXPECT_EQ(b.reason, "affinity");
}

TEST(ReadCpuBudget, TheQuotasOfV1AndV2LinesTogether) {
  FakeCgroups fake;  // a hybrid host: v2 for some controllers, v1's cpu
  fake.Own("0::/s\n5:cpu,cpuacct:/s\n");
  fake.Set("s", "cpu.max", "500000 100000");
  fake.Set("cpu,cpuacct/s", "cpu.cfs_quota_us", "300000");
  fake.Set("cpu,cpuacct/s", "cpu.cfs_period_us", "100000");
  EXPECT_EQ(ReadCpuBudget(8, fake.files()).reason, "cgroup cpu.cfs_quota_us 3 at /s");
}

TEST(AffinityCpus, CountsThisProcessMask) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  EXPECT_EQ(AffinityCpus(), CPU_COUNT(&set));
  EXPECT_GE(ThisProcessCpuBudget().cpus, 1);
  EXPECT_LE(ThisProcessCpuBudget().cpus, AffinityCpus());
}

TEST(OversubscriptionNote, OnlyAboveTheBudget) {
  const CpuBudget b{.cpus = 4,
                    .affinity_cpus = 96,
                    .cgroup_cpus = 4,
                    .cgroup = "cgroup cpu.max 4 at /p",
                    .reason = "cgroup cpu.max 4 at /p"};
  EXPECT_EQ(OversubscriptionNote("--workers", 4, b), "");
  EXPECT_EQ(OversubscriptionNote("--workers", 16, b),
            "--workers 16: more than the 4 CPUs this process may use (cgroup cpu.max 4 at /p): oversubscribing");
}

CpuBudget Quota(int affinity, int quota) {
  return {.cpus = std::min(affinity, quota),
          .affinity_cpus = affinity,
          .cgroup_cpus = quota,
          .cgroup = "cgroup cpu.max " + std::to_string(quota) + " at /pod",
          .reason = quota < affinity ? "cgroup cpu.max " + std::to_string(quota) + " at /pod" : "affinity"};
}

// One process in a 4-CPU pod on a 96-core node: 4 threads, and a note naming the cgroup.
TEST(ChooseTrainingThreads, OneProcessTakesTheCgroupQuota) {
  const TrainingThreadsChoice c = ChooseTrainingThreads(0, Quota(96, 4), 96, "", TrainingRanks());
  EXPECT_EQ(c.threads, 4);
  EXPECT_EQ(c.reason, "this process's 4 CPUs (cgroup cpu.max 4 at /pod), fewer than its affinity mask's 96");
  EXPECT_EQ(ChooseTrainingThreads(0, Quota(2, 4), 96, "", TrainingRanks()).threads, 2);
  EXPECT_EQ(ChooseTrainingThreads(0, Quota(2, 4), 96, "", TrainingRanks()).reason, "");
}

// The ranks on this node share a container's quota: torchrun's 4 ranks in a 16-CPU pod get 4 each.
TEST(ChooseTrainingThreads, RanksOnTheNodeSplitTheQuota) {
  TrainingRanks torchrun;
  torchrun.world_size = 8;
  torchrun.ranks_on_node = 4;
  torchrun.ranks_on_node_source = "LOCAL_WORLD_SIZE";
  TrainingThreadsChoice c = ChooseTrainingThreads(0, Quota(96, 16), 96, "", torchrun);
  EXPECT_EQ(c.threads, 4);
  EXPECT_EQ(c.reason, "16 CPUs (cgroup cpu.max 16 at /pod) / 4 ranks on this node (LOCAL_WORLD_SIZE)");
  // A quota above the machine's cores changes nothing.
  c = ChooseTrainingThreads(0, Quota(96, 200), 96, "", torchrun);
  EXPECT_EQ(c.threads, 24);
  EXPECT_EQ(c.reason, "96 CPUs / 4 ranks on this node (LOCAL_WORLD_SIZE)");
}

// One rank a pod (Kubernetes: RANK and WORLD_SIZE, no LOCAL_WORLD_SIZE): the quota is the rank's
// own, not split by the world size as the machine's cores were.
TEST(ChooseTrainingThreads, AQuotaWithoutRanksOnTheNodeIsThisRanks) {
  TrainingRanks pods;
  pods.world_size = 4;
  const TrainingThreadsChoice c = ChooseTrainingThreads(0, Quota(96, 4), 96, "", pods);
  EXPECT_EQ(c.threads, 4);
  EXPECT_NE(c.reason.find("this rank's 4 CPUs (cgroup cpu.max 4 at /pod), not split among the 4 ranks"),
            std::string::npos)
      << c.reason;
}

// Slurm's --cpus-per-task binds each rank to its own CPUs, yet a quota above the job's tasks (a
// Slurm node inside a container) is shared: 8 ranks x 8 CPUs under a 16-CPU quota get 2 each.
TEST(ChooseTrainingThreads, SlurmRanksOwnCpusAreCappedByTheirShareOfTheQuota) {
  TrainingRanks srun;
  srun.world_size = 16;
  srun.ranks_on_node = 8;
  srun.ranks_on_node_source = "SLURM_TASKS_PER_NODE=8(x2) at SLURM_NODEID=0";
  TrainingThreadsChoice c = ChooseTrainingThreads(0, Quota(8, 16), 64, "SLURM_CPUS_PER_TASK", srun);
  EXPECT_EQ(c.threads, 2);
  EXPECT_EQ(c.reason,
            "this process's 8 of the machine's 64 CPUs (SLURM_CPUS_PER_TASK is set), not split among the ranks on "
            "this node (SLURM_TASKS_PER_NODE=8(x2) at SLURM_NODEID=0: 8), capped at 2 by the cgroup cpu.max 16 at "
            "/pod shared by the 8 ranks on this node");
  // A quota that covers every rank's CPUs leaves them as they are.
  c = ChooseTrainingThreads(0, Quota(8, 64), 64, "SLURM_CPUS_PER_TASK", srun);
  EXPECT_EQ(c.threads, 8);
  EXPECT_EQ(c.reason.find("capped"), std::string::npos) << c.reason;
}

// What ReadCpuBudget could not read reaches the note, a single process's too.
TEST(ChooseTrainingThreads, TheNoteNamesCgroupFilesLeftOut) {
  CpuBudget b = Quota(8, 64);
  b.reason = "affinity; /fs/a/cpu.max: \"x\" is not \"QUOTA PERIOD\" or \"max PERIOD\": left out";
  EXPECT_EQ(ChooseTrainingThreads(0, b, 8, "", TrainingRanks()).reason,
            "this process's 8 CPUs (its affinity mask); /fs/a/cpu.max: \"x\" is not \"QUOTA PERIOD\" or \"max "
            "PERIOD\": left out");
  TrainingRanks two;
  two.world_size = 2;
  two.ranks_on_node = 2;
  two.ranks_on_node_source = "LOCAL_WORLD_SIZE";
  EXPECT_EQ(ChooseTrainingThreads(0, b, 8, "", two).reason,
            "8 CPUs / 2 ranks on this node (LOCAL_WORLD_SIZE); /fs/a/cpu.max: \"x\" is not \"QUOTA PERIOD\" or "
            "\"max PERIOD\": left out");
}

// --threads wins, above the default too, with one warning that says what the default would be.
TEST(ChooseTrainingThreads, AFlagAboveTheDefaultOversubscribes) {
  TrainingThreadsChoice c = ChooseTrainingThreads(16, Quota(96, 4), 96, "", TrainingRanks());
  EXPECT_EQ(c.threads, 16);
  EXPECT_EQ(c.reason, "");
  EXPECT_EQ(c.warning,
            "--threads 16: more than the 4 CPU threads of this rank's default (this process's 4 CPUs (cgroup cpu.max "
            "4 at /pod), fewer than its affinity mask's 96): oversubscribing");
  EXPECT_EQ(ChooseTrainingThreads(4, Quota(96, 4), 96, "", TrainingRanks()).warning, "");
  c = ChooseTrainingThreads(3, Quota(2, 64), 64, "", TrainingRanks());
  EXPECT_EQ(c.warning,
            "--threads 3: more than the 2 CPU threads of this rank's default (this process's affinity mask): "
            "oversubscribing");
}

}  // namespace
}  // namespace ptk
