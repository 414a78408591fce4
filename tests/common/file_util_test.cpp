// common/: atomic writer, natural order, globbing, shard resolution.
#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <vector>

#include <gtest/gtest.h>

#include "common/hash.h"
#include "common/mmap_file.h"
#include "common/slurm_env.h"
#include "common/status.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using ::ptk::testing::TempDir;

TEST(AtomicFileWriter, CommitMakesFileAppear) {
  TempDir dir;
  std::string path = dir / "out.txt";
  auto w = AtomicFileWriter::Create(path);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("hello ").ok());
  std::string big(3 << 20, 'x');  // larger than the buffer
  ASSERT_TRUE((*w)->Write(big).ok());
  EXPECT_FALSE(testing::Exists(path));
  const std::string tmp = (*w)->tmp_path();
  EXPECT_EQ(tmp.rfind(path + ".ptk-tmp-", 0), 0u) << tmp;
  EXPECT_TRUE(testing::Exists(tmp));
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ(testing::ReadFile(path), "hello " + big);
  EXPECT_FALSE(testing::Exists(tmp));
  EXPECT_EQ((*w)->bytes_written(), 6 + big.size());
}

TEST(AtomicFileWriter, AbandonedWriterKeepsOldContents) {
  TempDir dir;
  std::string path = dir / "out.txt";
  ASSERT_TRUE(WriteFileAtomic(path, "old").ok());
  std::string tmp;
  {
    auto w = AtomicFileWriter::Create(path);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write("new but unfinished").ok());
    tmp = (*w)->tmp_path();
  }
  EXPECT_EQ(testing::ReadFile(path), "old");
  EXPECT_FALSE(testing::Exists(tmp));
}

// Regression: two writers of one path shared `PATH.ptk-tmp`, truncated at open, so the
// second zeroed what the first had written and the first published a file with holes.
TEST(AtomicFileWriter, TwoWritersOfOnePathNeverShareATemporary) {
  TempDir dir;
  std::string path = dir / "out.txt";
  auto a = AtomicFileWriter::Create(path);
  ASSERT_TRUE(a.ok());
  std::string big(3 << 20, 'a');
  ASSERT_TRUE((*a)->Write(big).ok());
  ASSERT_TRUE((*a)->Flush().ok());
  auto b = AtomicFileWriter::Create(path);
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*a)->tmp_path(), (*b)->tmp_path());
  ASSERT_TRUE((*b)->Write("b").ok());
  ASSERT_TRUE((*a)->Commit().ok());
  EXPECT_EQ(testing::ReadFile(path), big);  // untouched by the second writer
  ASSERT_TRUE((*b)->Commit().ok());
  EXPECT_EQ(testing::ReadFile(path), "b");
}

TEST(PublishTogether, RenamesEveryFileAndRemovesTheJournal) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomic(dir / "a", "old a").ok());
  ASSERT_TRUE(WriteFileAtomic(dir / "b", "old b").ok());
  testing::WriteFile(dir / "a.new", "new a");
  testing::WriteFile(dir / "b.new", "new b");
  ASSERT_TRUE(PublishTogether(dir / "j", {{dir / "a.new", dir / "a"}, {dir / "b.new", dir / "b"}}).ok());
  EXPECT_EQ(testing::ReadFile(dir / "a"), "new a");
  EXPECT_EQ(testing::ReadFile(dir / "b"), "new b");
  EXPECT_FALSE(testing::Exists(dir / "j"));
  EXPECT_FALSE(testing::Exists(dir / "a.new"));
}

// A kill after the first rename: the journal is rolled forward by whoever comes next.
TEST(PublishTogether, InterruptedPublishIsCompletedFromTheJournal) {
  TempDir dir;
  testing::WriteFile(dir / "a", "new a");  // already renamed before the kill
  testing::WriteFile(dir / "b", "old b");
  testing::WriteFile(dir / "b.new", "new b");
  testing::WriteFile(dir / "j", "ptk-publish v1\na.new\ta\nb.new\tb\n");
  ASSERT_TRUE(CompletePendingPublish(dir / "j").ok());
  EXPECT_EQ(testing::ReadFile(dir / "a"), "new a");
  EXPECT_EQ(testing::ReadFile(dir / "b"), "new b");
  EXPECT_FALSE(testing::Exists(dir / "j"));
  EXPECT_TRUE(CompletePendingPublish(dir / "j").ok());  // nothing pending: a no-op
  // A damaged journal is an error, not a guess.
  testing::WriteFile(dir / "j", "ptk-publish v1\na.new");
  EXPECT_EQ(CompletePendingPublish(dir / "j").code(), absl::StatusCode::kDataLoss);
}

// A publish onto a directory left its journal (and so the caller's temporaries) behind.
// Now nothing is published and no journal is written; the temporaries stay the caller's.
TEST(PublishTogether, ADirectoryInAFinalPlacePublishesNothing) {
  TempDir dir;
  testing::WriteFile(dir / "a.new", "new a");
  testing::WriteFile(dir / "b.new", "new b");
  std::filesystem::create_directories(dir / "b");
  auto st = PublishTogether(dir / "j", {{dir / "a.new", dir / "a"}, {dir / "b.new", dir / "b"}});
  EXPECT_FALSE(st.ok());
  EXPECT_NE(std::string(st.message()).find("a directory is in its place"), std::string::npos) << st;
  EXPECT_FALSE(testing::Exists(dir / "j"));
  EXPECT_FALSE(testing::Exists(dir / "a"));
  EXPECT_TRUE(testing::Exists(dir / "a.new"));
}

// A directory with a link back up was walked until the path was too long (41 copies of
// every file); a file reached twice was listed twice.
TEST(WalkDirectory, EachDirectoryAndFileOnceByDeviceAndInode) {
  TempDir dir;
  ASSERT_TRUE(MakeDirs(dir / "x/sub").ok());
  ASSERT_TRUE(MakeDirs(dir / "x/real").ok());
  testing::WriteFile(dir / "x/f", "1");
  testing::WriteFile(dir / "x/real/g", "2");
  std::filesystem::create_symlink("..", dir / "x/sub/up");
  std::filesystem::create_symlink("real", dir / "x/a_link");  // sorts before real/: the real name still wins
  std::filesystem::create_symlink("f", dir / "x/f_link");
  std::filesystem::create_symlink("nowhere", dir / "x/broken");
  std::filesystem::create_hard_link(dir / "x/f", dir / "x/hard");
  ASSERT_EQ(::mkfifo((dir / "x/pipe").c_str(), 0644), 0);
  auto files = WalkDirectory(dir / "x");
  ASSERT_TRUE(files.ok()) << files.status();
  std::vector<std::string> got;
  for (const auto& f : *files) got.push_back(f.rel + (f.id.regular ? "" : " (" + f.id.kind + ")"));
  EXPECT_EQ(got, (std::vector<std::string>{"broken (a broken symbolic link)", "f", "pipe (a FIFO)", "real/g"}));
  EXPECT_EQ(*ListFilesRecursive(dir / "x"), (std::vector<std::string>{"f", "real/g"}));
}

TEST(AtomicFileWriter, AppendFileRange) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomic(dir / "src", "0123456789").ok());
  auto w = AtomicFileWriter::Create(dir / "dst");
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("ab").ok());
  ASSERT_TRUE((*w)->AppendFileRange(dir / "src", 3, 4).ok());
  ASSERT_TRUE((*w)->Write("z").ok());
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_EQ(testing::ReadFile(dir / "dst"), "ab3456z");
  auto w2 = AtomicFileWriter::Create(dir / "dst2");
  EXPECT_EQ((*w2)->AppendFileRange(dir / "src", 8, 5).code(), absl::StatusCode::kDataLoss);
}

// A full disk met where copy_file_range is refused (tmpfs, NFS, another file system: the read/write
// fallback) names what was being copied, as the copy_file_range path does; it said "write output".
TEST(AtomicFileWriter, AFullDiskInTheCopyFallbackNamesTheFiles) {
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomic(dir / "src", std::string(10000, 'x')).ok());
  const int in = ::open((dir / "src").c_str(), O_RDONLY | O_CLOEXEC);
  const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);  // every write: ENOSPC
  ASSERT_GE(in, 0);
  ASSERT_GE(full, 0);
  absl::Status st = CopyFdRange(in, 0, full, 10000, "src into chunk_00.jsonl");
  ::close(in);
  ::close(full);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("src into chunk_00.jsonl"), absl::string_view::npos) << st;
}

TEST(AtomicFileWriter, UnwritableDirectoryIsAnError) {
  auto w = AtomicFileWriter::Create("/nonexistent-dir/x");
  EXPECT_FALSE(w.ok());
  EXPECT_NE(std::string(w.status().message()).find("/nonexistent-dir/x.ptk-tmp-"), std::string::npos);
}

TEST(NaturalLess, OrdersNumbersByValue) {
  std::vector<std::string> v = {"shard10", "shard2", "shard1", "a", "shard02", "chunk10_x", "chunk1_x", "chunk9_x"};
  std::sort(v.begin(), v.end(), [](const std::string& a, const std::string& b) { return NaturalLess(a, b); });
  EXPECT_EQ(v, (std::vector<std::string>{"a", "chunk1_x", "chunk9_x", "chunk10_x", "shard1", "shard02", "shard2",
                                         "shard10"}));
  EXPECT_FALSE(NaturalLess("x", "x"));
  EXPECT_TRUE(NaturalLess("x1", "x01") != NaturalLess("x01", "x1"));
}

TEST(ExpandGlobs, SortsMatchesNaturallyAndReportsMisses) {
  TempDir dir;
  for (const char* n : {"f10.jsonl", "f2.jsonl", "f1.jsonl", "g.txt"}) ASSERT_TRUE(WriteFileAtomic(dir / n, "x").ok());
  auto r = ExpandGlobs({dir / "f*.jsonl", dir / "g.txt", "-"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<std::string>{dir / "f1.jsonl", dir / "f2.jsonl", dir / "f10.jsonl", dir / "g.txt", "-"}));
  EXPECT_EQ(ExpandGlobs({dir / "*.nothing"}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ExpandGlobs({dir / "missing.jsonl"}).status().code(), absl::StatusCode::kNotFound);
}

// A named input that is a link loop or a broken link says so (both were "no such file").
TEST(ExpandGlobs, NamesALinkLoopAndABrokenLink) {
  TempDir dir;
  ASSERT_EQ(::symlink("loop2", (dir / "loop1").c_str()), 0);
  ASSERT_EQ(::symlink("loop1", (dir / "loop2").c_str()), 0);
  ASSERT_EQ(::symlink("nowhere.jsonl", (dir / "broken.jsonl").c_str()), 0);
  auto loop = ExpandGlobs({dir / "loop1"});
  EXPECT_EQ(loop.status().message(), dir / "loop1: a symbolic link that loops");
  auto broken = ExpandGlobs({dir / "broken.jsonl"});
  EXPECT_EQ(broken.status().message(), dir / "broken.jsonl: a broken symbolic link (to nowhere.jsonl)");
  EXPECT_EQ(ExpandGlobs({dir / "missing.jsonl"}).status().message(), dir / "missing.jsonl: no such file");
}

TEST(FileUtil, PathsAndDirs) {
  EXPECT_EQ(Dirname("/a/b/c"), "/a/b");
  EXPECT_EQ(Dirname("c"), ".");
  EXPECT_EQ(Basename("/a/b/c.x"), "c.x");
  EXPECT_EQ(JoinPath("a/", "b"), "a/b");
  TempDir dir;
  ASSERT_TRUE(MakeDirs(dir / "x/y/z").ok());
  EXPECT_TRUE(IsDirectory(dir / "x/y/z"));
  ASSERT_TRUE(WriteFileAtomic(dir / "x/y/z/f", "1").ok());
  ASSERT_TRUE(WriteFileAtomic(dir / "x/a", "1").ok());
  auto files = ListFilesRecursive(dir / "x");
  ASSERT_TRUE(files.ok());
  EXPECT_EQ(*files, (std::vector<std::string>{"a", "y/z/f"}));
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanDuration(125), "2m05s");
}

TEST(Hash, KnownDigests) {
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Md5Hex(""), "d41d8cd98f00b204e9800998ecf8427e");
  Sha256 h;
  h.Update("a");
  h.Update("bc");
  EXPECT_EQ(h.HexDigest(), Sha256Hex("abc"));
}

TEST(ResolveShard, FlagsEnvAndDefaults) {
  ::unsetenv("SLURM_ARRAY_TASK_ID");
  auto d = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->index, 0);
  EXPECT_EQ(d->count, 1);
  ::setenv("SLURM_ARRAY_TASK_ID", "5", 1);
  ::setenv("SLURM_ARRAY_TASK_COUNT", "4", 1);
  ::setenv("SLURM_ARRAY_TASK_MIN", "2", 1);
  ::setenv("SLURM_ARRAY_TASK_STEP", "1", 1);
  auto e = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->index, 3);
  EXPECT_EQ(e->count, 4);
  auto f = ResolveShard(1, 2);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->index, 1);
  EXPECT_FALSE(ResolveShard(2, 2).ok());
  EXPECT_FALSE(ResolveShard(1, std::nullopt).ok());
  ::unsetenv("SLURM_ARRAY_TASK_ID");
  ::unsetenv("SLURM_ARRAY_TASK_COUNT");
  ::unsetenv("SLURM_ARRAY_TASK_MIN");
  ::unsetenv("SLURM_ARRAY_TASK_STEP");
}

// A Kubernetes Indexed Job's pod: JOB_COMPLETION_INDEX, with the count the manifest passes as
// JOB_COMPLETIONS; flags and Slurm's variables still win; bad values are usage errors naming them.
TEST(ResolveShard, KubernetesIndexedJob) {
  ::unsetenv("SLURM_ARRAY_TASK_ID");
  ::setenv("JOB_COMPLETION_INDEX", "2", 1);
  ::setenv("JOB_COMPLETIONS", "3", 1);
  auto k = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_TRUE(k.ok()) << k.status();
  EXPECT_EQ(k->index, 2);
  EXPECT_EQ(k->count, 3);
  EXPECT_EQ(k->source, "JOB_COMPLETION_INDEX");
  auto f = ResolveShard(0, 2);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->index, 0);
  EXPECT_EQ(f->source, "flags");
  ::setenv("SLURM_ARRAY_TASK_ID", "1", 1);
  ::setenv("SLURM_ARRAY_TASK_COUNT", "4", 1);
  auto s = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->index, 1);
  EXPECT_EQ(s->source, "SLURM_ARRAY_TASK_ID");
  ::unsetenv("SLURM_ARRAY_TASK_ID");
  ::unsetenv("SLURM_ARRAY_TASK_COUNT");
  ::setenv("JOB_COMPLETION_INDEX", "3", 1);
  auto out = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("shard index 3 is outside [0, 3) (from JOB_COMPLETION_INDEX)"),
            std::string::npos)
      << out.status();
  ::setenv("JOB_COMPLETIONS", "x", 1);
  auto bad = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("JOB_COMPLETIONS=\"x\" is not an integer"), std::string::npos) << bad.status();
  ::unsetenv("JOB_COMPLETIONS");
  auto missing = ResolveShard(std::nullopt, std::nullopt);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("JOB_COMPLETIONS is not"), std::string::npos) << missing.status();
  ::unsetenv("JOB_COMPLETION_INDEX");
}

// Every read of a named file takes regular files only: a FIFO (open(2) would wait for a writer
// forever), a device or a directory is refused at once with one line naming it and what it is.
// Each read runs in a child with an alarm, so a read that waits fails the test instead of hanging it.
TEST(OpenRegularFile, FifosDevicesAndDirectoriesAreRefusedWithoutWaiting) {
  testing::TempDir dir;
  const std::string fifo = dir / "pipe", file = dir / "f";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  testing::WriteFile(file, "abc");
  // Runs `read` in a child; its message, or "hung" when it did not return within 20 s.
  auto in_child = [&](const std::function<absl::Status()>& read) -> std::string {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      ::alarm(20);
      const absl::Status st = read();
      const std::string msg = st.ok() ? "ok" : std::string(st.message());
      (void)!::write(fds[1], msg.data(), msg.size());
      ::_exit(0);
    }
    ::close(fds[1]);
    std::string out;
    char buf[512];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
    ::close(fds[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFSIGNALED(status) ? "hung" : out;
  };
  auto read_string = [](const std::string& p) { return [p] { return ReadFileToString(p).status(); }; };
  auto map = [](const std::string& p) { return [p] { return MappedFile::Open(p).status(); }; };
  auto append = [&](const std::string& p) {
    return [p, &dir] {
      auto w = AtomicFileWriter::Create(dir / "copy");
      if (!w.ok()) return w.status();
      return (*w)->AppendFileRange(p, 0, 1);
    };
  };
  EXPECT_EQ(in_child(read_string(file)), "ok");
  EXPECT_EQ(in_child(map(file)), "ok");
  EXPECT_EQ(in_child(read_string(fifo)), fifo + " is a FIFO, not a regular file: ptk reads regular files");
  EXPECT_EQ(in_child(map(fifo)), fifo + " is a FIFO, not a regular file: ptk reads regular files");
  EXPECT_EQ(in_child(append(fifo)), fifo + " is a FIFO, not a regular file: ptk reads regular files");
  EXPECT_EQ(in_child(read_string("/dev/null")),
            "/dev/null is a character device, not a regular file: ptk reads "
            "regular files");
  EXPECT_EQ(in_child(read_string(dir.path())),
            dir.path() + " is a directory, not a regular file: ptk reads regular files");
  auto fd = OpenRegularFile(file);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(::fcntl(*fd, F_GETFL) & O_NONBLOCK, 0);  // handed on as a plain blocking descriptor
  ::close(*fd);
}

// TrainingRanksFromEnv with exactly these launch variables set (every other one it reads unset,
// before and after).
absl::StatusOr<TrainingRanks> TrainingRanksWith(std::vector<std::pair<const char*, const char*>> env) {
  static const char* const kVars[] = {"WORLD_SIZE",
                                      "RANK",
                                      "LOCAL_RANK",
                                      "GROUP_RANK",
                                      "SLURM_PROCID",
                                      "SLURM_NTASKS",
                                      "SLURM_LOCALID",
                                      "SLURM_STEP_NUM_TASKS",
                                      "SLURM_NODEID",
                                      "SLURM_JOB_ID",
                                      "SLURM_RESTART_COUNT",
                                      "MASTER_ADDR",
                                      "MASTER_PORT",
                                      "SLURM_STEP_NODELIST",
                                      "SLURM_JOB_NODELIST",
                                      "LOCAL_WORLD_SIZE",
                                      "SLURM_TASKS_PER_NODE",
                                      "SLURM_NTASKS_PER_NODE",
                                      "TORCHELASTIC_USE_AGENT_STORE",
                                      "PTK_RUN_ID",
                                      "TORCHELASTIC_RUN_ID",
                                      "TORCHELASTIC_ERROR_FILE",
                                      "SLURM_STEP_ID"};
  for (const char* v : kVars) ::unsetenv(v);
  for (const auto& [k, v] : env) ::setenv(k, v, 1);
  auto r = TrainingRanksFromEnv();
  for (const char* v : kVars) ::unsetenv(v);
  return r;
}

// A launch's variables are read strictly: each number decimal and in range, a rank without a count
// or beyond it, a variable that is not a number: a usage error naming the variable. What srun and
// torchrun really set still works.
TEST(TrainingRanksFromEnv, EveryLaunchVariableIsCheckedNamingIt) {
  const auto with = TrainingRanksWith;
  // Valid launches.
  auto none = with({});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->world_size, 1);
  auto batch = with({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}});  // a batch script outside srun
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_EQ(batch->world_size, 1);
  auto srun = with({{"SLURM_PROCID", "3"},
                    {"SLURM_NTASKS", "4"},
                    {"SLURM_STEP_NUM_TASKS", "4"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_NODEID", "5"},  // the job's node numbering, not the step's
                    {"SLURM_JOB_ID", "1234"},
                    {"SLURM_STEP_NODELIST", "n[07-08]"}});
  ASSERT_TRUE(srun.ok()) << srun.status();
  EXPECT_EQ(srun->rank, 3);
  EXPECT_EQ(srun->world_size, 4);
  EXPECT_EQ(srun->local_rank, 1);
  EXPECT_EQ(srun->master_addr, "n07");
  EXPECT_EQ(srun->master_port, 20000 + 1234 * 7 % 12000);
  // Never among the ephemeral ports (from 32768): 7 * 2000 % 20000 put this job at 34000.
  auto late = with({{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_JOB_ID", "2000"}});
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->master_port, 22000);
  auto torchrun = with({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_PORT", "29400"}});
  ASSERT_TRUE(torchrun.ok()) << torchrun.status();
  EXPECT_EQ(torchrun->rank, 1);
  EXPECT_EQ(torchrun->master_port, 29400);
  // Each refused as a usage error naming the variable.
  const std::pair<std::vector<std::pair<const char*, const char*>>, std::string> bad[] = {
      {{{"WORLD_SIZE", "4294967297"}, {"RANK", "0"}}, "WORLD_SIZE=4294967297 is outside [1, 2147483647]"},
      {{{"WORLD_SIZE", "2"}, {"RANK", "4294967296"}}, "RANK=4294967296 is outside [0, 1] (WORLD_SIZE=2)"},
      {{{"WORLD_SIZE", "2"}, {"RANK", "2"}}, "RANK=2 is outside [0, 1] (WORLD_SIZE=2)"},
      {{{"WORLD_SIZE", "2"}, {"RANK", "-1"}}, "RANK=-1 is outside [0, 1]"},
      {{{"WORLD_SIZE", "0x2"}, {"RANK", "0"}}, "WORLD_SIZE=\"0x2\" is not an integer"},
      {{{"WORLD_SIZE", " 2"}, {"RANK", "0"}}, "WORLD_SIZE=\" 2\" is not an integer"},
      {{{"WORLD_SIZE", "2"}}, "WORLD_SIZE is set but RANK is not"},
      {{{"RANK", "1"}}, "RANK is set but WORLD_SIZE is not"},
      {{{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "x"}}, "LOCAL_RANK=\"x\" is not an integer"},
      {{{"SLURM_PROCID", "abc"}}, "SLURM_PROCID=\"abc\" is not an integer"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "abc"}}, "SLURM_STEP_NUM_TASKS=\"abc\" is not an integer"},
      {{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}}, "SLURM_PROCID=1 without SLURM_STEP_NUM_TASKS"},
      {{{"SLURM_PROCID", "2"}, {"SLURM_STEP_NUM_TASKS", "2"}},
       "SLURM_PROCID=2 is outside [0, 1] (SLURM_STEP_NUM_TASKS=2)"},
      {{{"SLURM_STEP_NUM_TASKS", "2"}}, "SLURM_STEP_NUM_TASKS is set but SLURM_PROCID is not"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_LOCALID", "7"}},
       "SLURM_LOCALID=7 is outside [0, 1] (SLURM_STEP_NUM_TASKS=2)"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}, "SLURM_NTASKS=0 is outside [1, 2147483647]"},
      {{{"MASTER_PORT", "70000"}}, "MASTER_PORT=70000 is outside [1, 65535]"},
      {{{"MASTER_PORT", "0x50"}}, "MASTER_PORT=\"0x50\" is not an integer"},
  };
  for (const auto& [env, expected] : bad) {
    SCOPED_TRACE(expected);
    auto r = with(env);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(IsUsageError(r.status())) << r.status();
    EXPECT_NE(r.status().message().find(expected), absl::string_view::npos) << r.status();
  }
}

// A launch's identity (run_id), which rank 0's rendezvous compares so that two jobs on one port never
// meet: the same on every rank of one launch, another for any other. PTK_RUN_ID wins; torchrun's
// --rdzv-id (not its default "none"), or on one node its agent's fresh log directory of the attempt;
// a Slurm job's id, with srun's step; nothing for ranks started by hand.
TEST(TrainingRanksFromEnv, EachLaunchCarriesItsRunId) {
  const auto with = TrainingRanksWith;
  using Env = std::vector<std::pair<const char*, const char*>>;
  const Env srun = {
      {"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "3"}};
  const Env torchrun = {{"RANK", "1"},
                        {"WORLD_SIZE", "2"},
                        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"},
                        {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                        {"MASTER_PORT", "29500"}};
  auto plus = [](Env env, const Env& more) {
    env.insert(env.end(), more.begin(), more.end());
    return env;
  };
  const std::pair<Env, std::string> cases[] = {
      {{}, ""},
      {{{"WORLD_SIZE", "2"}, {"RANK", "0"}}, ""},
      {{{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"PTK_RUN_ID", "job-uid-1"}}, "PTK_RUN_ID=job-uid-1"},
      {srun, "SLURM_JOB_ID=77 SLURM_STEP_ID=3"},
      {plus(srun, {{"SLURM_RESTART_COUNT", "2"}}), "SLURM_JOB_ID=77 SLURM_STEP_ID=3 SLURM_RESTART_COUNT=2"},
      {plus(srun, {{"PTK_RUN_ID", "x"}}), "PTK_RUN_ID=x"},
      // Ranks started in a Slurm job but not by one srun step: the job's id alone.
      {{{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"SLURM_JOB_ID", "77"}, {"SLURM_STEP_ID", "3"}}, "SLURM_JOB_ID=77"},
      {plus(torchrun, {{"TORCHELASTIC_RUN_ID", "5f0c"}}), "TORCHELASTIC_RUN_ID=5f0c"},
      {plus(torchrun, {{"TORCHELASTIC_RUN_ID", "none"},
                       {"TORCHELASTIC_ERROR_FILE", "/tmp/torchelastic_ab/none_cd/attempt_1/1/error.json"}}),
       "torchrun's log directory /tmp/torchelastic_ab/none_cd/attempt_1"},
      // That directory is one node's agent's: with ranks on other nodes, it is no identity.
      {{{"RANK", "1"},
        {"WORLD_SIZE", "4"},
        {"LOCAL_WORLD_SIZE", "2"},
        {"TORCHELASTIC_RUN_ID", "none"},
        {"TORCHELASTIC_ERROR_FILE", "/tmp/torchelastic_ab/none_cd/attempt_1/1/error.json"}},
       ""},
      {plus(torchrun, {{"TORCHELASTIC_ERROR_FILE", "/error.json"}}), ""},
      {plus(torchrun, {{"TORCHELASTIC_ERROR_FILE", ""}, {"SLURM_JOB_ID", "9"}}), "SLURM_JOB_ID=9"},
  };
  for (const auto& [env, run_id] : cases) {
    auto r = with(env);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->run_id, run_id);
  }
}

// torchrun's agent binds MASTER_PORT for its own store before the ranks start (its workers join it as
// clients): rank 0's rendezvous there failed 'Address already in use' under every torchrun launch. It meets
// on the next port, every rank alike; the same variables set by hand (no agent) keep MASTER_PORT.
TEST(TrainingRanksFromEnv, UnderTorchrunTheRendezvousIsBesideItsAgentsStore) {
  const auto with = TrainingRanksWith;
  std::vector<std::pair<const char*, const char*>> env = {
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto by_hand = with(env);
  ASSERT_TRUE(by_hand.ok()) << by_hand.status();
  EXPECT_EQ(by_hand->master_port, 29500);
  env.push_back({"TORCHELASTIC_USE_AGENT_STORE", "True"});
  auto torchrun = with(env);
  ASSERT_TRUE(torchrun.ok()) << torchrun.status();
  EXPECT_EQ(torchrun->master_port, 29501);
  EXPECT_EQ(torchrun->rank, 1);
  env.back().second = "False";
  EXPECT_EQ(with(env)->master_port, 29500);
  env.back().second = "True";
  env[4].second = "65535";
  EXPECT_EQ(with(env)->master_port, 65534);
  EXPECT_EQ(with(env)->torchrun_store_port, 65535);
  EXPECT_EQ(torchrun->torchrun_store_port, 29500);
  EXPECT_EQ(by_hand->torchrun_store_port, 0);
}

// Every rendezvous message names the port the ranks really meet at: under torchrun not MASTER_PORT (its
// agent's store holds it) but the port beside it, saying why, so that a user checks that port and gives the
// next job a MASTER_PORT that does not clash. Before, they said "MASTER_PORT 29501" with MASTER_PORT 29500.
TEST(RendezvousPortWords, UnderTorchrunTheyNameThePortBesideMasterPort) {
  EXPECT_EQ(RendezvousPortWords(29500, 0), "MASTER_PORT 29500");
  EXPECT_EQ(RendezvousAddressWords("node1", 29500, 0), "node1:29500");
  EXPECT_EQ(RendezvousPortWords(29501, 29500), "port 29501 (MASTER_PORT 29500 + 1: torchrun's store holds 29500)");
  EXPECT_EQ(RendezvousAddressWords("node1", 29501, 29500),
            "node1:29501 (MASTER_PORT 29500 + 1: torchrun's store holds 29500)");
  EXPECT_EQ(RendezvousPortWords(65534, 65535), "port 65534 (MASTER_PORT 65535 - 1: torchrun's store holds 65535)");
}

// The ranks sharing this machine, for the CPU memory check: torchrun's LOCAL_WORLD_SIZE; srun's
// SLURM_TASKS_PER_NODE at this node (SLURM_NODEID), else SLURM_NTASKS_PER_NODE, never above the
// step's ranks; 0 when the launcher does not say; a malformed value a usage error naming it.
TEST(TrainingRanksFromEnv, TheRanksOnThisNodeComeFromTheLauncher) {
  const auto with = TrainingRanksWith;
  auto on_node = [&](std::vector<std::pair<const char*, const char*>> env) {
    auto r = with(std::move(env));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? std::make_pair(r->ranks_on_node, r->ranks_on_node_source) : std::make_pair(-1, std::string());
  };
  using P = std::pair<int, std::string>;
  EXPECT_EQ(on_node({}), P(0, ""));
  EXPECT_EQ(on_node({{"RANK", "0"}, {"WORLD_SIZE", "8"}}), P(0, ""));
  EXPECT_EQ(on_node({{"RANK", "0"}, {"WORLD_SIZE", "8"}, {"LOCAL_WORLD_SIZE", "4"}}), P(4, "LOCAL_WORLD_SIZE"));
  const std::vector<std::pair<const char*, const char*>> step = {{"SLURM_PROCID", "5"}, {"SLURM_STEP_NUM_TASKS", "11"}};
  auto plus = [&](std::vector<std::pair<const char*, const char*>> more) {
    more.insert(more.begin(), step.begin(), step.end());
    return more;
  };
  EXPECT_EQ(on_node(plus({{"SLURM_NODEID", "1"}, {"SLURM_TASKS_PER_NODE", "4(x2),3"}})),
            P(4, "SLURM_TASKS_PER_NODE=4(x2),3 at SLURM_NODEID=1"));
  EXPECT_EQ(on_node(plus({{"SLURM_NODEID", "2"}, {"SLURM_TASKS_PER_NODE", "4(x2),3"}})),
            P(3, "SLURM_TASKS_PER_NODE=4(x2),3 at SLURM_NODEID=2"));
  // A node the list does not reach: SLURM_NTASKS_PER_NODE, capped at the step's 11 ranks.
  EXPECT_EQ(
      on_node(plus({{"SLURM_NODEID", "3"}, {"SLURM_TASKS_PER_NODE", "4(x2),3"}, {"SLURM_NTASKS_PER_NODE", "16"}})),
      P(11, "SLURM_NTASKS_PER_NODE"));
  EXPECT_EQ(on_node(plus({{"SLURM_NODEID", "3"}, {"SLURM_TASKS_PER_NODE", "4(x2),3"}})), P(0, ""));
  EXPECT_EQ(on_node({{"SLURM_PROCID", "0"}, {"SLURM_TASKS_PER_NODE", "4"}}), P(0, ""));  // a batch script: one process
  const std::pair<std::vector<std::pair<const char*, const char*>>, std::string> bad[] = {
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}},
       "LOCAL_WORLD_SIZE=3 is outside [1, 2] (WORLD_SIZE=2)"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "two"}}, "LOCAL_WORLD_SIZE=\"two\" is not an integer"},
      {plus({{"SLURM_TASKS_PER_NODE", "4(2)"}}),
       "SLURM_TASKS_PER_NODE=\"4(2)\" is not a Slurm tasks-per-node list (like \"4(x2),3\")"},
      {plus({{"SLURM_NTASKS_PER_NODE", "0"}}), "SLURM_NTASKS_PER_NODE=0 is outside [1, 2147483647]"},
  };
  for (const auto& [env, expected] : bad) {
    SCOPED_TRACE(expected);
    auto r = with(env);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(IsUsageError(r.status())) << r.status();
    EXPECT_NE(r.status().message().find(expected), absl::string_view::npos) << r.status();
  }
  for (const char* v : {"4(x2),3", "1", "2(x1)", "3,", "x", "4(x0)", "4(x2", "0", "4(x-1)", ""}) {
    SCOPED_TRACE(v);
    auto at0 = SlurmTasksOnNode("V", v, 0);
    const bool good = std::string_view(v) == "4(x2),3" || std::string_view(v) == "1" || std::string_view(v) == "2(x1)";
    EXPECT_EQ(at0.ok(), good) << at0.status();
  }
  EXPECT_EQ(*SlurmTasksOnNode("V", "2(x3),1", 3), std::optional<int64_t>(1));
  EXPECT_EQ(*SlurmTasksOnNode("V", "2(x3),1", 2), std::optional<int64_t>(2));
  EXPECT_EQ(*SlurmTasksOnNode("V", "2(x3),1", 4), std::optional<int64_t>());
}

// A process whose affinity mask holds `cpus` CPUs, in no cgroup with a CPU quota.
CpuBudget Mask(int cpus) {
  return {.cpus = cpus, .affinity_cpus = cpus, .cgroup_cpus = 0, .cgroup = "", .reason = "affinity"};
}

// The machine's cores are split among the ranks on this node, not the whole job's: 2 nodes x 8
// ranks on 64-core nodes give 8 threads per rank (not 64 / 16 = 4). Without a count for the node,
// the world size as before; --threads, a narrower affinity mask or launcher-given CPUs are not split.
TEST(ChooseTrainingThreads, SplitsTheMachineAmongTheRanksOnThisNode) {
  TrainingRanks two_nodes;
  two_nodes.world_size = 16;
  two_nodes.ranks_on_node = 8;
  two_nodes.ranks_on_node_source = "LOCAL_WORLD_SIZE";
  TrainingThreadsChoice c = ChooseTrainingThreads(0, Mask(64), 64, "", two_nodes);
  EXPECT_EQ(c.threads, 8);
  EXPECT_EQ(c.reason, "64 CPUs / 8 ranks on this node (LOCAL_WORLD_SIZE)");
  TrainingRanks unknown = two_nodes;
  unknown.ranks_on_node = 0;
  unknown.ranks_on_node_source.clear();
  c = ChooseTrainingThreads(0, Mask(64), 64, "", unknown);
  EXPECT_EQ(c.threads, 4);
  EXPECT_NE(c.reason.find("64 CPUs / 16 ranks (the launcher does not say"), std::string::npos) << c.reason;
  EXPECT_EQ(ChooseTrainingThreads(3, Mask(64), 64, "", two_nodes).threads, 3);  // --threads
  c = ChooseTrainingThreads(0, Mask(16), 64, "", two_nodes);                    // affinity mask
  EXPECT_EQ(c.threads, 16);
  EXPECT_EQ(c.reason,
            "this process's 16 of the machine's 64 CPUs (its affinity mask), not split among the ranks on this node "
            "(LOCAL_WORLD_SIZE: 8)");
  EXPECT_EQ(ChooseTrainingThreads(0, Mask(64), 64, "SLURM_CPUS_PER_TASK", two_nodes).threads,
            64);                                                                       // SLURM_CPUS_PER_TASK
  EXPECT_EQ(ChooseTrainingThreads(0, Mask(64), 64, "", TrainingRanks()).threads, 64);  // one rank
  EXPECT_EQ(ChooseTrainingThreads(0, Mask(4), 4, "", two_nodes).threads, 1);           // at least 1
  TrainingRanks alone_on_node = two_nodes;
  alone_on_node.ranks_on_node = 1;
  c = ChooseTrainingThreads(0, Mask(64), 64, "", alone_on_node);
  EXPECT_EQ(c.threads, 64);
  EXPECT_EQ(c.reason, "64 CPUs / 1 rank on this node (LOCAL_WORLD_SIZE)");
}

}  // namespace
}  // namespace ptk
