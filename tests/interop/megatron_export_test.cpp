// ptk-convert --saver megatron: what a killed export left beside the iteration directories; the args
// Namespace it writes.
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "interop/hf_gpt2.h"
#include "interop/megatron.h"
#include "interop/megatron_common.h"
#include "interop/torch_format.h"
#include "tests/interop/convert_opts.h"
#include "tests/test_util.h"
#include "tests/trainer/small_gpt.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

// A process id that was a process of ours and is gone: a child that exited and was reaped.
pid_t DeadPid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

void WriteWithDirs(const std::string& path, const std::string& data) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  testing::WriteFile(path, data);
}

bool Mentions(const std::vector<std::string>& notes, const std::string& what) {
  for (const std::string& n : notes)
    if (n.find(what) != std::string::npos) return true;
  return false;
}

// Regression: a SIGKILL mid-write left iter_N.ptk-tmp-PID (a partial model_optim_rng.pt, possibly GBs)
// beside the target and no later export removed it. The next export removes a dead process's copies
// (and puts back an iteration a kill between the two renames left aside), and leaves a live process's
// and ptk-train's (a ptk checkpoint inside) alone.
TEST(MegatronExport, RemovesWhatKilledExportsLeftAndNothingLive) {
  testing::TempDir dir;
  const GPTConfig c = testing::SmallGpt(2, 16, 4, 16, 100, 128);
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params)), m(params.size()), v(params.size());
  layout->InitWeights(5, params);
  TrainState st;
  st.iteration = 7;
  st.settings = {{"--vocab-size", "100"}};
  ASSERT_TRUE(SaveCheckpoint(dir / "ck", *layout, params, m, v, st, "[]").ok());

  const std::string meg = dir / "meg";
  const pid_t dead = DeadPid(), live = ::getppid();
  const std::string killed = meg + "/iter_0000007.ptk-tmp-" + std::to_string(dead);
  const std::string aside = meg + "/iter_0000003.ptk-old-" + std::to_string(dead);
  const std::string stale_old = meg + "/iter_0000005.ptk-old-" + std::to_string(dead);
  const std::string running = meg + "/iter_0000007.ptk-tmp-" + std::to_string(live);
  const std::string trainer = meg + "/iter_0000009.ptk-tmp-" + std::to_string(dead);
  WriteWithDirs(killed + "/mp_rank_00/model_optim_rng.pt", "a partial torch.save zip");
  WriteWithDirs(aside + "/mp_rank_00/model_optim_rng.pt", "iteration 3, renamed aside");
  WriteWithDirs(meg + "/iter_0000005/mp_rank_00/model_optim_rng.pt", "iteration 5");
  WriteWithDirs(stale_old + "/mp_rank_00/model_optim_rng.pt", "an older iteration 5");
  WriteWithDirs(running + "/mp_rank_00/model_optim_rng.pt", "a live run's, being written");
  WriteWithDirs(trainer + "/mp_rank_00/model_optim_rng.ptk", "ptk-train's save");

  auto s = ExportToMegatron(testing::ConvertOpts("ptk", "megatron", dir / "ck", meg));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(testing::Exists(meg + "/iter_0000007/mp_rank_00/model_optim_rng.pt"));
  EXPECT_FALSE(testing::Exists(killed));
  EXPECT_FALSE(testing::Exists(aside));
  EXPECT_EQ(testing::ReadFile(meg + "/iter_0000003/mp_rank_00/model_optim_rng.pt"), "iteration 3, renamed aside");
  EXPECT_FALSE(testing::Exists(stale_old));
  EXPECT_EQ(testing::ReadFile(meg + "/iter_0000005/mp_rank_00/model_optim_rng.pt"), "iteration 5");
  EXPECT_TRUE(testing::Exists(running + "/mp_rank_00/model_optim_rng.pt"));
  EXPECT_TRUE(testing::Exists(trainer + "/mp_rank_00/model_optim_rng.ptk"));
  EXPECT_TRUE(Mentions(s->notes, "removed " + killed)) << s->notes.front();
  EXPECT_TRUE(Mentions(s->notes, "left " + running + ": process " + std::to_string(live) + " is alive"));
  EXPECT_TRUE(Mentions(s->notes, "put back from " + aside));
}

// Megatron-LM 0.16's args always hold microbatch_group_size_per_vp_stage (TransformerConfig's field: None
// unless --microbatch-group-size-per-virtual-pipeline-stage is given; its load neither takes nor checks it);
// the export left it out. An interleaved export holds the run's group size where it is not the pipeline
// size (Megatron's default); else None.
TEST(MegatronExport, ArgsHoldTheMicrobatchGroupSizeAsMegatronsDo) {
  testing::TempDir dir;
  const GPTConfig c = testing::SmallGpt(4, 16, 4, 16, 100, 128);
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params)), m(params.size()), v(params.size());
  layout->InitWeights(5, params);
  struct Case {
    std::string group;  // the run's recorded setting ("": a run without model chunks)
    int64_t pp, layers_per_chunk;
    std::optional<int64_t> want;  // nullopt: None
  };
  const Case cases[] = {{"4", 2, 1, 4},
                        {"2", 2, 1, std::nullopt},
                        {"4", 1, 0, std::nullopt},
                        {"", 2, 1, std::nullopt},
                        {"4", 4, 0, std::nullopt}};
  int n = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(n);
    const std::string ck = dir / ("ck" + std::to_string(n)), meg = dir / ("meg" + std::to_string(n));
    ++n;
    TrainState st;
    st.iteration = 7;
    st.settings = {{"--vocab-size", "100"}, {"--microbatch-group-size-per-virtual-pipeline-stage", k.group}};
    ASSERT_TRUE(SaveCheckpoint(ck, *layout, params, m, v, st, "[]").ok());
    ConvertOptions o = testing::ConvertOpts("ptk", "megatron", ck, meg);
    o.target_pipeline_parallel_size = k.pp;
    o.target_num_layers_per_virtual_pipeline_stage = k.layers_per_chunk;
    ASSERT_TRUE(ExportToMegatron(o).ok());
    auto f = torchfmt::TorchArchiveReader::Open(meg + "/iter_0000007/" + megatron::RankDir(0, 0, k.pp) +
                                                "/model_optim_rng.pt");
    ASSERT_TRUE(f.ok()) << f.status();
    const torchfmt::PyValue* group = (*f)->root().Get("args")->Get("microbatch_group_size_per_vp_stage");
    ASSERT_NE(group, nullptr);
    if (k.want) {
      ASSERT_TRUE(group->IsInt());
      EXPECT_EQ(group->i, *k.want);
    } else {
      EXPECT_EQ(group->kind, torchfmt::PyValue::Kind::kNone);
    }
  }
}

// Megatron's args record calculate_per_token_loss (how the run weighed its losses: every token alike
// or each micro-batch's mean); the export left it out, so a Megatron run on the export and a ptk-convert
// back both lost it. It is written from the run's setting and read back on import, into the settings
// and the flags ptk-train is told to give.
TEST(MegatronExport, ArgsRecordCalculatePerTokenLossAndImportReadsItBack) {
  testing::TempDir dir;
  const GPTConfig c = testing::SmallGpt(2, 16, 4, 16, 100, 128);
  auto layout = ParamLayout::Create(c);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<float> params(static_cast<size_t>(layout->num_params)), m(params.size()), v(params.size());
  layout->InitWeights(5, params);
  for (const char* setting : {"on", "off"}) {
    SCOPED_TRACE(setting);
    const std::string ck = dir / (std::string("ck_") + setting), meg = dir / (std::string("meg_") + setting),
                      back = dir / (std::string("back_") + setting);
    TrainState st;
    st.iteration = 7;
    st.settings = {{"--vocab-size", "100"}, {"--calculate-per-token-loss", setting}};
    ASSERT_TRUE(SaveCheckpoint(ck, *layout, params, m, v, st, "[]").ok());
    ASSERT_TRUE(ExportToMegatron(testing::ConvertOpts("ptk", "megatron", ck, meg)).ok());
    auto f = torchfmt::TorchArchiveReader::Open(meg + "/iter_0000007/mp_rank_00/model_optim_rng.pt");
    ASSERT_TRUE(f.ok()) << f.status();
    const torchfmt::PyValue* arg = (*f)->root().Get("args")->Get("calculate_per_token_loss");
    ASSERT_NE(arg, nullptr);
    ASSERT_EQ(arg->kind, torchfmt::PyValue::Kind::kBool);
    EXPECT_EQ(arg->b, std::string(setting) == "on");

    auto imported = ImportFromMegatron(testing::ConvertOpts("megatron", "ptk", meg, back));
    ASSERT_TRUE(imported.ok()) << imported.status();
    EXPECT_EQ(imported->train_flags.find("--calculate-per-token-loss") != std::string::npos,
              std::string(setting) == "on")
        << imported->train_flags;
    auto settings = ReadCheckpointSettings(back, 7);
    ASSERT_TRUE(settings.ok()) << settings.status();
    std::string read = "(not recorded)";
    for (const auto& [k, val] : *settings)
      if (k == "--calculate-per-token-loss") read = val;
    EXPECT_EQ(read, setting);
  }
}

}  // namespace
}  // namespace ptk
