// ptk-download against a fake Hub + CDN (tests/support/fake_hub.py): listing and pagination, auth
// kept off the CDN, every injected fault survived with byte-identical files, rate limits honoured,
// kill -9 and resume, sharding, disk full, clear errors.
#include <signal.h>

#include <sys/wait.h>
#include <unistd.h>
#include <fstream>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "common/hash.h"
#include "common/human_format.h"
#include "dataprep/download/download.h"
#include "dataprep/download/download_internal.h"
#include "dataprep/download/http.h"
#include "tests/dataprep/fake_hub.h"
#include "tests/test_util.h"

namespace ptk {
namespace {

using testing::FakeHub;
using testing::RunCmd;
using testing::TempDir;

constexpr const char* kToken = "hf_secret_test_token";

// A small repo: train/chunk{1,2}/example_train_{0..2}.jsonl.zst of random bytes, a README and a
// validation file.
std::vector<std::string> MakeRepo(const std::string& dir, size_t file_size = 150000) {
  std::mt19937 rng(5);
  std::vector<std::string> paths;
  for (int c = 1; c <= 2; ++c)
    for (int i = 0; i < 3; ++i) paths.push_back(fmt::format("train/chunk{}/example_train_{}.jsonl.zst", c, i));
  paths.push_back("validation/chunk1/example_holdout_0.jsonl.zst");
  for (const auto& p : paths) {
    std::filesystem::create_directories(std::filesystem::path(dir + "/" + p).parent_path());
    std::string data(file_size + rng() % 5000, '\0');
    for (auto& ch : data) ch = static_cast<char>(rng());
    testing::WriteFile(dir + "/" + p, data);
  }
  testing::WriteFile(dir + "/README.md", "# a fake SlimPajama\n");
  return paths;
}

// Polls `reached` every 10 ms while the SpawnShell process `pid` runs: true once it holds, false when the
// process ended first (left unreaped for WaitExit) or 120 s passed. The kill tests wait for a state this
// way, never for a count of polls: a loaded machine's start-up (python's fake hub, the first answers)
// took longer than the 6 s and 10 s those counts gave, and the run was killed before the state it needs.
bool WaitWhileRunning(pid_t pid, const std::function<bool()>& reached) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < until) {
    if (reached()) return true;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid)
      return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

std::string Download(const FakeHub& hub, const std::string& local, const std::string& extra) {
  return fmt::format(
      "HF_TOKEN={} {} --quiet --repo cerebras/SlimPajama-627B --endpoint {} --local-dir {} "
      "--retry-base 0.05 --retry-max 0.5 --stall-timeout 1 {}",
      kToken, testing::Tool("ptk-download"), hub.hub(), local, extra);
}

void ExpectSameTree(const std::string& repo, const std::string& local, const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    ASSERT_TRUE(testing::Exists(local + "/" + p)) << p;
    ASSERT_TRUE(testing::ReadFile(repo + "/" + p) == testing::ReadFile(local + "/" + p)) << p << " differs";
    EXPECT_FALSE(testing::Exists(local + "/" + p + ".part")) << p;
  }
}

TEST(Download, WholeRepoPaginatedVerifiedAndTokenOnlyOnHub) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo");
  FakeHub hub(dir / "repo", {"--page-size", "1"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", "--jobs 3"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  EXPECT_EQ(testing::ReadFile(dir / "out/README.md"), "# a fake SlimPajama\n");
  EXPECT_EQ(hub.Stat("auth_on_cdn"), 0);
  EXPECT_GT(hub.Stat("auth_on_hub"), 0);
  EXPECT_EQ(hub.Stat("accept_encoding"), 0);
  EXPECT_EQ(r.output.find(kToken), std::string::npos) << "the token was printed";
  // A rerun downloads nothing: no resolve, no CDN request.
  int64_t api_before = hub.Stat("api_calls");
  auto again = RunCmd(Download(hub, dir / "out", "--jobs 3"));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  for (const auto& p : paths) EXPECT_EQ(hub.Resolves(p), 1) << p;
  EXPECT_LE(hub.Stat("api_calls") - api_before, 1);  // only pinning main; the listing is reused
}

// --repo as a browser shows it (a URL, the datasets/ path) went to the API as
// .../api/datasets/https://huggingface.co/datasets/... and failed there after retries; now a usage error before
// any request, with the id (and --repo-type) meant. Ids as the Hub names them still pass (against the hub).
TEST(Download, ARepoGivenAsAUrlOrAPathSaysTheIdMeant) {
  TempDir dir;
  const std::pair<std::string, std::string> cases[] = {
      {"https://huggingface.co/datasets/cerebras/SlimPajama-627B", "did you mean --repo cerebras/SlimPajama-627B?"},
      {"https://huggingface.co/datasets/cerebras/SlimPajama-627B/tree/main/train",
       "did you mean --repo cerebras/SlimPajama-627B?"},
      {"datasets/cerebras/SlimPajama-627B", "did you mean --repo cerebras/SlimPajama-627B?"},
      {"https://huggingface.co/openai-community/gpt2", "did you mean --repo openai-community/gpt2 --repo-type model?"},
      {"a/b/c", "--repo a/b/c: a repo id is NAME or ORG/NAME (cerebras/SlimPajama-627B), not a URL or a path\n"},
  };
  for (const auto& [repo, says] : cases) {
    auto r = RunCmd(fmt::format("{} --repo '{}' --local-dir {} --endpoint http://127.0.0.1:9 --max-retries 0",
                                testing::Tool("ptk-download"), repo, dir / "out"));
    EXPECT_EQ(r.exit_code, 2) << repo << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << repo << "\n" << r.output;
  }
  EXPECT_FALSE(testing::Exists(dir / "out"));
  MakeRepo(dir / "repo");
  FakeHub hub(dir / "repo", {}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto ok = RunCmd(Download(hub, dir / "out", "--list-only"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

// huggingface-cli download's flags a newcomer brings: each refused saying what ptk-download does instead
// (they were "unknown flag --resume-download", no more).
TEST(Download, HuggingfaceClisOtherFlagsAreRefusedWithTheReason) {
  TempDir dir;
  const std::pair<std::string, std::string> cases[] = {
      {"--resume-download", "--resume-download is not supported: ptk-download always resumes"},
      {"--force-download", "--force-download is not supported: a file present and verified is kept; --verify"},
      {"--cache-dir c", "--cache-dir is not supported: ptk-download writes the files themselves into --local-dir"},
      {"--local-dir-use-symlinks False", "--local-dir-use-symlinks is not supported: the files are written into"},
  };
  for (const auto& [flag, says] : cases) {
    auto r = RunCmd(fmt::format("{} --repo cerebras/SlimPajama-627B --local-dir {} --endpoint http://127.0.0.1:9 {}",
                                testing::Tool("ptk-download"), dir / "out", flag));
    EXPECT_EQ(r.exit_code, 2) << flag << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << flag << "\n" << r.output;
  }
  EXPECT_FALSE(testing::Exists(dir / "out"));
}

TEST(Download, IncludeExcludeAndFlatNames) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo");
  FakeHub hub(dir / "repo", {}, dir.path());
  auto r = RunCmd(Download(hub, dir / "out", "--include 'train/**' --exclude '*chunk2/example_train_1*' --flat"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testing::Exists(dir / "out/example_train_chunk1_shard0.jsonl.zst"));
  EXPECT_TRUE(testing::Exists(dir / "out/example_train_chunk2_shard2.jsonl.zst"));
  EXPECT_FALSE(testing::Exists(dir / "out/example_train_chunk2_shard1.jsonl.zst"));
  EXPECT_FALSE(testing::Exists(dir / "out/README.md"));
  EXPECT_TRUE(testing::ReadFile(dir / "repo/train/chunk2/example_train_2.jsonl.zst") ==
              testing::ReadFile(dir / "out/example_train_chunk2_shard2.jsonl.zst"));
}

TEST(Download, EveryFaultIsSurvivedWithIdenticalBytes) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo");
  // One fault plan per file; a fault is consumed by one request for that file.
  std::string faults = R"({
    "train/chunk1/example_train_0.jsonl.zst": ["drop:1000", "drop:40000", "ok"],
    "train/chunk1/example_train_1.jsonl.zst": ["stall:4", "ok"],
    "train/chunk1/example_train_2.jsonl.zst": ["drop:5000", "ignore_range", "ok"],
    "train/chunk2/example_train_0.jsonl.zst": ["drop:5000", "bad_range_start", "bad_range_total", "ok"],
    "train/chunk2/example_train_1.jsonl.zst": ["flip:777", "ok", "hub:429_ratelimit", "hub:429_retry_after:1", "hub:429_plain"],
    "train/chunk2/example_train_2.jsonl.zst": ["replace", "ok", "hub:503", "hub:500"],
    "validation/chunk1/example_holdout_0.jsonl.zst": ["cdn_403", "500", "503", "502", "drop:10", "slice200", "ok"]
  })";
  testing::WriteFile(dir / "faults.json", faults);
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", "--jobs 4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  EXPECT_EQ(hub.Stat("auth_on_cdn"), 0);
  // Resumes used Range; the replaced object was restarted, not appended to.
  auto gets0 = hub.CdnGets("train/chunk1/example_train_0.jsonl.zst");
  ASSERT_GE(gets0.size(), 3u);
  EXPECT_EQ(gets0[0], "");
  EXPECT_EQ(gets0[1], "bytes=1000-");
  auto gets_replace = hub.CdnGets("train/chunk2/example_train_2.jsonl.zst");
  ASSERT_GE(gets_replace.size(), 2u);
  // The flipped byte was caught by sha256 and the file fetched again from 0.
  auto gets_flip = hub.CdnGets("train/chunk2/example_train_1.jsonl.zst");
  ASSERT_GE(gets_flip.size(), 2u);
  EXPECT_EQ(gets_flip[1], "");
  EXPECT_NE(r.output.find("sha256 mismatch"), std::string::npos) << r.output;
}

// Large files as concurrent byte ranges (here: above 100,000 bytes, pieces of 64 KiB, 3 connections
// a file): each MakeRepo file is 3 pieces.
constexpr const char* kRanged = "--split-above 100000 --piece-size 65536 --connections-per-file 3";

// The fake CDN's Range headers "bytes=A-B" as (A, B); an empty pair for a request without Range.
std::vector<std::pair<uint64_t, uint64_t>> Ranges(const std::vector<std::string>& gets) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& g : gets) {
    uint64_t a = 0, b = 0;
    if (std::sscanf(g.c_str(), "bytes=%lu-%lu", &a, &b) == 2)
      out.emplace_back(a, b);
    else
      out.emplace_back(0, 0);
  }
  return out;
}

// Every way a piece's server can fail, one file each after its first (good) piece: a 200 with the
// whole body or a slice to a range request, a wrong Content-Range (start, total, absurd, missing), a
// piece cut short (resumed inside the piece), a piece that stalls (cut by --stall-timeout, retried), a
// flipped byte (the whole file's sha256 fails: fetched again), an old version of the object (another
// ETag: started over), and a server that ignores Range from the first request (fetched over one
// connection). Every file ends byte-identical.
TEST(DownloadRanged, EveryPieceFaultIsSurvivedWithIdenticalBytes) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo");
  std::string faults = R"({
    "train/chunk1/example_train_0.jsonl.zst": ["ok", "ignore_range", "range200", "range200_full", "slice200", "ok"],
    "train/chunk1/example_train_1.jsonl.zst": ["ok", "bad_range_start", "bad_range_total", "206_no_range",
                                               "bad_content_range", "ok"],
    "train/chunk1/example_train_2.jsonl.zst": ["ok", "drop:1000", "short", "ok"],
    "train/chunk2/example_train_0.jsonl.zst": ["ok", "stall:3", "ok"],
    "train/chunk2/example_train_1.jsonl.zst": ["ok", "flip:70000", "flip:70000", "ok"],
    "train/chunk2/example_train_2.jsonl.zst": ["ok", "replace", "ok"],
    "validation/chunk1/example_holdout_0.jsonl.zst": ["ignore_range", "ok"]
  })";
  testing::WriteFile(dir / "faults.json", faults);
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", std::string("--jobs 4 ") + kRanged));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
  EXPECT_EQ(hub.Stat("auth_on_cdn"), 0);
  for (const char* said : {"bad range response", "a 200 (the whole file) to a request for bytes", "sha256 mismatch",
                           "changed on the server", "over one connection", "transfer error"})
    EXPECT_NE(r.output.find(said), std::string::npos) << said << ": " << r.output;
  // The train files went as ranges only, within their pieces.
  for (size_t i = 0; i + 1 < paths.size(); ++i)
    for (const auto& [a, b] : Ranges(hub.CdnGets(paths[i]))) {
      EXPECT_LE(a, b) << paths[i];
      EXPECT_EQ(a / 65536, b / 65536) << paths[i] << ": a range across pieces";
    }
  // The piece cut short was resumed where it was cut, not from its start.
  bool mid_piece = false;
  for (const auto& [a, b] : Ranges(hub.CdnGets(paths[2]))) mid_piece = mid_piece || a % 65536 != 0;
  EXPECT_TRUE(mid_piece) << "no piece was resumed inside itself";
  // The server that ignored Range from the start: the file then came over one connection, whole.
  auto holdout = hub.CdnGets(paths.back());
  ASSERT_GE(holdout.size(), 2u);
  EXPECT_EQ(holdout.back(), "");
}

// A piece whose answer is the wrong size though its Content-Range is right (a body longer or shorter
// than the range, its Content-Length counting it or none): the attempt's bytes are
// discarded, never kept, and the piece fetched again from its start; every file ends byte-identical.
TEST(DownloadRanged, AWrongSizePieceIsDiscardedAndFetchedAgain) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo");
  testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["ok", "long_body", "short_body", "ok"],
                                                          "{}": ["ok", "long_body_unsized", "short_body_unsized", "ok"]}})",
                                                      paths[0], paths[1]));
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  const std::string include = fmt::format(" --include '{}' --include '{}'", paths[0], paths[1]);
  auto r = RunCmd(Download(hub, dir / "out", std::string(kRanged) + include));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", {paths[0], paths[1]});
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
  EXPECT_EQ(r.output.find("sha256 mismatch"), std::string::npos) << "a wrong-size piece was kept: " << r.output;
  for (const char* said :
       {R"(bytes \d+-\d+: \d+ bytes for the \d+ asked \(its Content-Length\))",
        R"(bytes \d+-\d+: at least \d+ bytes for the \d+ asked\))", R"(bytes \d+-\d+: \d+ bytes for the \d+ asked\))"})
    EXPECT_TRUE(std::regex_search(r.output, std::regex(said))) << said << ": " << r.output;
  for (const auto& p : {paths[0], paths[1]})
    for (const auto& [a, b] : Ranges(hub.CdnGets(p)))
      EXPECT_EQ(a % 65536, 0u) << p << ": a piece resumed inside itself after a wrong-size answer";
}

// A server whose every answer for a piece is the wrong size: after the retries, one line naming the
// file, the range and both sizes, exit 1, and nothing published or left behind as a complete file.
TEST(DownloadRanged, APieceAlwaysTheWrongSizeFailsNamingTheRangeAndSizes) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo");
  testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["ok", "long_body", "long_body", "long_body",
                                                          "long_body", "long_body", "long_body"]}})",
                                                      paths[0]));
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", fmt::format("--max-retries 2 {} --include '{}'", kRanged, paths[0])));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_FALSE(testing::Exists(dir / "out/" + paths[0])) << r.output;
  EXPECT_NE(r.output.find(paths[0]), std::string::npos) << r.output;
  // Which piece fails first depends on the connections' order; each is named with its sizes.
  EXPECT_TRUE(
      std::regex_search(r.output, std::regex(R"(bytes (65536-131071|131072-\d+): \d+ bytes for the \d+ asked)")))
      << r.output;
  EXPECT_NE(r.output.find("gave up after 3 attempts"), std::string::npos) << r.output;
}

// kill -9 in the middle of a ranged download, then a rerun: each piece resumes where the record says
// it was (the rerun asks for exactly the bytes the record lacks, some from inside a piece), and the
// file is byte-identical (its sha256 covers the bytes from before the kill, read back).
TEST(DownloadRanged, KillNineMidDownloadResumesEachPiece) {
  TempDir dir;
  std::filesystem::create_directories(dir / "repo/train");
  std::mt19937 rng(11);
  std::string data(2000000, '\0');
  for (auto& ch : data) ch = static_cast<char>(rng());
  testing::WriteFile(dir / "repo/train/big.bin", data);
  const std::string flags = "--split-above 1000000 --piece-size 262144 --connections-per-file 4";
  const std::string record = dir / "out/train/big.bin.part.json";
  auto recorded = [&]() -> std::optional<uint64_t> {  // bytes the record says are in place
    std::string text = testing::Exists(record) ? testing::ReadFile(record) : "";
    size_t l2 = text.find('\n', text.find('\n') + 1);
    if (l2 == std::string::npos || text.find('\n', l2 + 1) == std::string::npos) return std::nullopt;
    std::istringstream in(text.substr(l2 + 1));
    uint64_t sum = 0, v;
    while (in >> v) sum += v;
    return sum;
  };
  uint64_t at_kill = 0;
  {
    FakeHub slow(dir / "repo", {"--bytes-per-second", "300000"}, dir.path());
    ASSERT_TRUE(slow.ok());
    pid_t pid = testing::SpawnShell("env " + Download(slow, dir / "out", flags), dir / "a.log");
    WaitWhileRunning(pid, [&] {
      auto got = recorded();
      return got && *got >= 400000;
    });
    ::kill(pid, SIGKILL);
    testing::WaitExit(pid);
    auto got = recorded();
    ASSERT_TRUE(got.has_value()) << testing::ReadFile(dir / "a.log");
    at_kill = *got;
  }
  ASSERT_GE(at_kill, 400000u);
  ASSERT_LT(at_kill, data.size()) << "the download ended before the kill";
  ASSERT_FALSE(testing::Exists(dir / "out/train/big.bin"));
  FakeHub hub(dir / "repo", {}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", flags));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(testing::ReadFile(dir / "out/train/big.bin") == data);
  EXPECT_FALSE(testing::Exists(record));
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
  uint64_t asked = 0;
  bool mid_piece = false;
  for (const auto& [a, b] : Ranges(hub.CdnGets("train/big.bin"))) {
    asked += b - a + 1;
    mid_piece = mid_piece || a % 262144 != 0;
  }
  EXPECT_EQ(asked, data.size() - at_kill) << "the rerun fetched bytes the record had";
  EXPECT_TRUE(mid_piece) << "no piece resumed inside itself";
  EXPECT_EQ(hub.Resolves("train/big.bin"), 1);
}

// --max-connections bounds the connections of all files together: 3 files of 4 connections each
// over at most 3 (the fake CDN counts the requests it answers at once); without the bound they go
// above 3. One resolve per ranged file however many pieces.
TEST(DownloadRanged, ConnectionsAreBoundedByMaxConnections) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 600000);
  paths.resize(3);
  const std::string include = fmt::format("--include '{}' --include '{}' --include '{}'", paths[0], paths[1], paths[2]);
  const std::string flags = "--jobs 3 --split-above 100000 --piece-size 65536 --connections-per-file 4 " + include;
  for (int max : {3, 64}) {
    TempDir d;
    FakeHub hub(dir / "repo", {"--bytes-per-second", "2000000"}, d.path());
    ASSERT_TRUE(hub.ok());
    auto r = RunCmd(Download(hub, d / "out", flags + fmt::format(" --max-connections {}", max)));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ExpectSameTree(dir / "repo", d / "out", paths);
    if (max == 3) {
      EXPECT_LE(hub.Stat("cdn_max_in_flight"), 3) << hub.StatsJson();
    } else {
      EXPECT_GT(hub.Stat("cdn_max_in_flight"), 3) << hub.StatsJson();
    }
    for (const auto& p : paths) {
      EXPECT_EQ(hub.Resolves(p), 1) << p;
      EXPECT_GE(hub.CdnGets(p).size(), 9u) << p << ": not fetched as pieces";
    }
  }
}

// A 429 from the download host to a piece, with Retry-After (one file) or RateLimit r=0 (the
// other): that file sends nothing more to the server before the wait the header asks for (2 s both:
// Retry-After 2; t=1 plus a second), on any of its connections; then it goes on over one
// connection fewer (3 before, at most 2 after) and ends byte-identical and verified. Read from the
// fake CDN's own log (when each request came, on which connection, how many of the file's were in
// flight), not timed here. A request another connection sent before the 429 reached the client may
// arrive after it (the fake CDN reads a connection's next request only once it has paced out the
// previous answer): one per other connection is allowed, never a second, a new connection, or one on
// the connection that got the 429.
TEST(DownloadRanged, A429PausesTheFileAsItsHeadersSayAndDropsAConnection) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 1500000);  // 23 pieces a file
  paths.resize(2);
  testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["ok", "ok", "ok", "ok", "ok", "429_retry_after:2"],
                                     "{}": ["ok", "ok", "ok", "ok", "ok", "429_ratelimit"]}})",
                                                      paths[0], paths[1]));
  // Paced (a piece takes ~0.15 s), so that the file's 3 connections are busy when the 429 comes.
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json", "--bytes-per-second", "500000"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out",
                           fmt::format("--jobs 2 --split-above 100000 --piece-size 65536 --connections-per-file 3 "
                                       "--include '{}' --include '{}'",
                                       paths[0], paths[1])));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
  EXPECT_EQ(r.output.find("mismatch"), std::string::npos) << r.output;
  constexpr double kWait = 2.0, kSlack = 0.05;  // the server's clock at both ends: load only makes gaps longer
  for (const auto& p : paths) {
    const auto log = hub.CdnLog(p);
    size_t k = 0;
    while (k < log.size() && log[k].fault.rfind("429", 0) != 0) ++k;
    ASSERT_LT(k, log.size()) << p << ": no 429 served";
    const double t429 = log[k].t;
    std::set<int64_t> ports_before;
    std::map<int64_t, int> in_window;  // port -> requests within the wait
    int64_t before = 0, after = 0;
    std::optional<double> retried;  // when the refused piece was asked again
    for (size_t i = 0; i < log.size(); ++i) {
      if (i <= k) {
        before = std::max(before, log[i].in_flight);
        ports_before.insert(log[i].port);
        continue;
      }
      const double gap = log[i].t - t429;
      if (gap < kWait - kSlack) {
        ++in_window[log[i].port];
        EXPECT_NE(log[i].port, log[k].port)
            << p << ": " << log[i].range << " asked " << gap << " s after the 429, on its connection";
        EXPECT_EQ(ports_before.count(log[i].port), 1u) << p << ": a new connection " << gap << " s after the 429";
        EXPECT_EQ(in_window[log[i].port], 1)
            << p << ": " << log[i].range << " asked " << gap << " s after the 429, the second on its connection";
      } else {
        after = std::max(after, log[i].in_flight);
      }
      if (!retried && log[i].range == log[k].range) retried = gap;
    }
    ASSERT_TRUE(retried.has_value()) << p << ": the refused piece " << log[k].range << " was not asked again";
    EXPECT_GE(*retried, kWait - kSlack) << p;
    EXPECT_EQ(before, 3) << p << ": not 3 connections before the 429";
    EXPECT_GE(after, 1) << p;
    EXPECT_LE(after, 2) << p << ": no connection fewer after the 429";
    for (const auto& [a, b] : Ranges(hub.CdnGets(p))) EXPECT_EQ(a / 65536, b / 65536) << p;
  }
}

// The same over one connection (a file below --split-above): a 429 from the download host with
// --max-retries N: the first attempt and N retries, and the message counts them (it said N attempts).
TEST(Download, MaxRetriesCountsRetriesAndTheMessageTheAttempts) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 5000);
  testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["500", "500", "500", "500", "500"]}})", paths[0]));
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", fmt::format("--max-retries 2 --include '{}'", paths[0])));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("HTTP 500 (gave up after 3 attempts without progress, --max-retries 2)"), std::string::npos)
      << r.output;
  EXPECT_EQ(hub.CdnGets(paths[0]).size(), 3u) << r.output;
}

// Retry-After 2 or RateLimit r=0;t=1 is retried no sooner than 2 s after (the fake CDN's clock).
TEST(Download, A429FromTheDownloadHostIsRetriedAfterTheWaitItNames) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 5000);
  paths.resize(2);
  testing::WriteFile(dir / "faults.json",
                     fmt::format(R"({{"{}": ["429_retry_after:2"], "{}": ["429_ratelimit"]}})", paths[0], paths[1]));
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r =
      RunCmd(Download(hub, dir / "out", fmt::format("--jobs 2 --include '{}' --include '{}'", paths[0], paths[1])));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  for (const auto& p : paths) {
    const auto log = hub.CdnLog(p);
    ASSERT_EQ(log.size(), 2u) << p;
    EXPECT_EQ(log[0].fault.rfind("429", 0), 0u) << p;
    EXPECT_GE(log[1].t - log[0].t, 2.0 - 0.05) << p;
  }
}

// A 503 with Retry-After (RFC 9110 10.2.3: a server says how long it will be unavailable) is retried
// after that wait, not after the backoff (at most 0.1 s here: the server was asked again at once).
TEST(Download, A503WithRetryAfterIsRetriedAfterTheWaitItNames) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 5000);
  testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["503_retry_after:2"]}})", paths[0]));
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(
      Download(hub, dir / "out", fmt::format("--jobs 1 --retry-base 0.05 --retry-max 0.1 --include '{}'", paths[0])));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", {paths[0]});
  const auto log = hub.CdnLog(paths[0]);
  ASSERT_EQ(log.size(), 2u) << r.output;
  EXPECT_GE(log[1].t - log[0].t, 2.0 - 0.05) << r.output;
}

TEST(Download, ResolverQuotaIsHonouredAcrossWorkers) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 20000);
  std::filesystem::create_directories(dir / "repo/train/chunk3");
  for (int i = 3; i < 12; ++i) {  // 16 LFS files in all
    testing::WriteFile(dir / fmt::format("repo/train/chunk3/example_train_{}.jsonl.zst", i),
                       std::string(10000 + i, 'x'));
    paths.push_back(fmt::format("train/chunk3/example_train_{}.jsonl.zst", i));
  }
  FakeHub hub(dir / "repo", {"--quota", "5", "--window", "1"}, dir.path());
  auto r = RunCmd(Download(hub, dir / "out", "--jobs 4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  // The client paused on the RateLimit headers instead of hammering: the resolves in flight are
  // taken off what an answer says is left, and a late answer cannot raise it, so at most a stray
  // resolve at a window boundary is refused. (It was 3 a window when four workers woken at once each
  // read "4 left" from the first answer; a client that ignored the headers is refused on most.)
  EXPECT_LE(hub.Stat("rate_limited"), 2) << hub.StatsJson() << r.output;
}

TEST(Download, RateLimitWithRetryAfterOrNoHints) {
  for (const char* mode : {"retry-after", "none"}) {
    TempDir dir;
    auto paths = MakeRepo(dir / "repo", 5000);
    FakeHub hub(dir / "repo", {"--quota", "3", "--window", "1", "--ratelimit-mode", mode}, dir.path());
    auto r = RunCmd(Download(hub, dir / "out", "--jobs 2 --max-retries 20"));
    ASSERT_EQ(r.exit_code, 0) << mode << r.output;
    ExpectSameTree(dir / "repo", dir / "out", paths);
  }
}

TEST(Download, KillNineThenResumeFetchesNothingTwice) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 300000);
  std::set<std::string> complete_after_kill;
  {
    FakeHub slow(dir / "repo", {"--bytes-per-second", "400000"}, dir.path());
    ASSERT_TRUE(slow.ok());
    const pid_t pid = testing::SpawnShell("env " + Download(slow, dir / "out", "--jobs 2"), dir / "a.log");
    // Wait until something is complete and something is partial, then kill -9, and reap the run before
    // looking (a kill is not a death: 100 ms of sleep stood for it, and a file renamed into place after
    // the look was counted as not complete, then found not fetched again).
    WaitWhileRunning(pid, [&] {
      int done = 0, partial = 0;
      for (const auto& p : paths) {
        done += testing::Exists(dir / ("out/" + p));
        partial += testing::Exists(dir / ("out/" + p + ".part"));
      }
      return done >= 1 && partial >= 1;
    });
    ::kill(pid, SIGKILL);
    testing::WaitExit(pid);
    for (const auto& p : paths)
      if (testing::Exists(dir / ("out/" + p))) complete_after_kill.insert(p);
  }
  ASSERT_FALSE(complete_after_kill.empty());
  ASSERT_LT(complete_after_kill.size(), paths.size());
  FakeHub hub(dir / "repo", {}, dir.path());
  auto r = RunCmd(Download(hub, dir / "out", "--jobs 2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  int resumed = 0;
  for (const auto& p : paths) {
    auto gets = hub.CdnGets(p);
    if (complete_after_kill.count(p)) {
      EXPECT_TRUE(gets.empty()) << p << " was fetched again";
    } else {
      ASSERT_FALSE(gets.empty()) << p;
      if (gets[0].rfind("bytes=", 0) == 0) ++resumed;
    }
  }
  EXPECT_GE(resumed, 1) << "no partial download was resumed with Range";
}

TEST(Download, ShardsSplitTheWorkDeterministically) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 3000);
  FakeHub hub(dir / "repo", {}, dir.path());
  std::set<std::string> seen;
  for (int s = 0; s < 3; ++s) {
    std::string local = dir / "out";
    auto r = RunCmd(fmt::format("SLURM_ARRAY_TASK_ID={} SLURM_ARRAY_TASK_COUNT=3 ", s) +
                    Download(hub, local, "--include 'train/**'"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  for (const auto& p : paths) {
    if (p.rfind("train/", 0) != 0) continue;
    EXPECT_EQ(hub.Resolves(p), 1) << p << " was resolved by more than one shard";
    EXPECT_TRUE(testing::Exists(dir / ("out/" + p)));
  }
}

TEST(Download, DiskFullStopsCleanlyAndResumes) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 200000);
  FakeHub hub(dir / "repo", {}, dir.path());
  // ulimit -f (KiB): writes past it fail with EFBIG, the same path as ENOSPC.
  auto r = RunCmd("ulimit -f 100; " + Download(hub, dir / "out", "--jobs 1"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("disk full"), std::string::npos) << r.output;
  bool any_part = false;
  for (const auto& p : paths) any_part = any_part || testing::Exists(dir / ("out/" + p + ".part"));
  EXPECT_TRUE(any_part);
  auto again = RunCmd(Download(hub, dir / "out", "--jobs 2"));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
}

TEST(Download, ClearErrors) {
  TempDir dir;
  MakeRepo(dir / "repo", 1000);
  FakeHub hub(dir / "repo", {}, dir.path());
  auto bad_repo = RunCmd(fmt::format("{} --quiet --repo nobody/nothing --endpoint {} --local-dir {}",
                                     testing::Tool("ptk-download"), hub.hub(), dir / "o1"));
  EXPECT_EQ(bad_repo.exit_code, 1);
  EXPECT_NE(bad_repo.output.find("RepoNotFound"), std::string::npos) << bad_repo.output;
  // A model repo asked for without --repo-type (huggingface-cli's default type is model, ptk's dataset).
  EXPECT_NE(bad_repo.output.find("a model or space repo? --repo-type is dataset unless given: add --repo-type model"),
            std::string::npos)
      << bad_repo.output;
  auto bad_rev = RunCmd(Download(hub, dir / "o2", "--revision no-such-branch"));
  EXPECT_EQ(bad_rev.exit_code, 1);
  EXPECT_NE(bad_rev.output.find("RevisionNotFound"), std::string::npos) << bad_rev.output;
  auto usage = RunCmd(fmt::format("{} --local-dir {}", testing::Tool("ptk-download"), dir / "o3"));
  EXPECT_EQ(usage.exit_code, 2);

  TempDir gdir;
  MakeRepo(gdir / "repo", 1000);
  FakeHub gated(gdir / "repo", {"--gated"}, gdir.path());
  auto anon = RunCmd(
      fmt::format("env -u HF_TOKEN HOME={} {} --quiet --repo cerebras/SlimPajama-627B --endpoint {} --local-dir {}",
                  gdir.path(), testing::Tool("ptk-download"), gated.hub(), gdir / "o"));
  EXPECT_EQ(anon.exit_code, 1);
  EXPECT_NE(anon.output.find("GatedRepo"), std::string::npos) << anon.output;
  EXPECT_NE(anon.output.find("HF_TOKEN"), std::string::npos) << anon.output;
  auto ok = RunCmd(Download(gated, gdir / "o", "--include 'README.md'"));
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  // huggingface-cli's flags: --token TOKEN was taken as --token-file (its prefix) and the token printed as a
  // file name; --max-workers is --jobs.
  auto token = RunCmd(Download(gated, gdir / "o2", "--token hf_cli_secret"));
  EXPECT_EQ(token.exit_code, 2) << token.output;
  EXPECT_NE(token.output.find("--token is not supported: a token on the command line is seen by every user"),
            std::string::npos)
      << token.output;
  EXPECT_EQ(token.output.find("hf_cli_secret"), std::string::npos) << token.output;
  auto workers = RunCmd(Download(gated, gdir / "o3", "--include 'README.md' --max-workers 2"));
  EXPECT_EQ(workers.exit_code, 0) << workers.output;
}

TEST(Download, UrlListVerifiesSha256) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 4000);
  FakeHub hub(dir / "repo", {"--small-mode", "307"}, dir.path());
  std::string good = testing::ReadFile(dir / "repo/README.md");
  std::string list = fmt::format(
      "# the seeds' style list\n{}/datasets/cerebras/SlimPajama-627B/resolve/main/README.md "
      "sha256=b0c1a46e5e1ffc4f28a5ee12b9d00ba3e3a0f57aa1d1f4a6e42c0b9cb5ac27c7 path=wrong.md\n",
      hub.hub());
  testing::WriteFile(dir / "list.txt", list);
  auto bad = RunCmd(fmt::format("HF_TOKEN={} {} --quiet --url-list {} --endpoint {} --local-dir {} --retry-base 0.01",
                                kToken, testing::Tool("ptk-download"), dir / "list.txt", hub.hub(), dir / "o"));
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("sha256"), std::string::npos) << bad.output;
  // Regression: a list without size= said "1 of 1 files (0 B)", as if the file were empty.
  EXPECT_NE(bad.output.find("shard 0/1: 1 of 1 files (sizes not listed), "), std::string::npos) << bad.output;
  EXPECT_FALSE(testing::Exists(dir / "o/wrong.md"));
  std::string sha = Sha256Hex(good);
  testing::WriteFile(dir / "list2.txt",
                     fmt::format("{}/datasets/cerebras/SlimPajama-627B/resolve/main/README.md sha256={} size={}\n",
                                 hub.hub(), sha, good.size()));
  auto ok = RunCmd(fmt::format("HF_TOKEN={} {} --quiet --url-list {} --endpoint {} --local-dir {}", kToken,
                               testing::Tool("ptk-download"), dir / "list2.txt", hub.hub(), dir / "o"));
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find(fmt::format("shard 0/1: 1 of 1 files ({}), ", HumanBytes(static_cast<double>(good.size())))),
            std::string::npos)
      << ok.output;
  EXPECT_EQ(testing::ReadFile(dir / "o/README.md"), good);
  // Regression: a digest in upper case (PowerShell's Get-FileHash, certutil) was taken as 64 hex digits,
  // then compared with the lower-case one computed: 'sha256 still mismatches after 3 downloads', exit 1.
  std::string upper = sha;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  testing::WriteFile(dir / "list3.txt", fmt::format("{}/datasets/cerebras/SlimPajama-627B/resolve/main/README.md "
                                                    "sha256={} path=upper.md\n",
                                                    hub.hub(), upper));
  auto up = RunCmd(fmt::format("HF_TOKEN={} {} --quiet --url-list {} --endpoint {} --local-dir {} --retry-base 0.01",
                               kToken, testing::Tool("ptk-download"), dir / "list3.txt", hub.hub(), dir / "o"));
  ASSERT_EQ(up.exit_code, 0) << up.output;
  EXPECT_EQ(testing::ReadFile(dir / "o/upper.md"), good);
}

// A --url-list size= that the server's answer contradicts is one clear line naming the URL, the listed
// size and the server's, with no retries (it was 'bad partial response (a 200 of N bytes for a file of
// M bytes ...)' and 9 more requests); a 404 leaves no empty `.part` behind.
TEST(Download, UrlListSizeMismatchIsOneClearLineAndA404LeavesNothing) {
  TempDir dir;
  MakeRepo(dir / "repo", 1000);
  FakeHub hub(dir / "repo", {}, dir.path());
  const std::string good = testing::ReadFile(dir / "repo/README.md");
  const std::string url = hub.hub() + "/datasets/cerebras/SlimPajama-627B/resolve/main/README.md";
  testing::WriteFile(dir / "list.txt", fmt::format("{} size={}\n", url, good.size() + 7));
  auto run = [&](const std::string& list) {
    return RunCmd(fmt::format("HF_TOKEN={} {} --quiet --url-list {} --endpoint {} --local-dir {} --retry-base 0.01",
                              kToken, testing::Tool("ptk-download"), list, hub.hub(), dir / "o"));
  };
  auto bad = run(dir / "list.txt");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(fmt::format("{}: the server's file is {} bytes, the --url-list gives size={}", url,
                                        good.size(), good.size() + 7)),
            std::string::npos)
      << bad.output;
  EXPECT_EQ(bad.output.find("bad partial response"), std::string::npos) << bad.output;
  EXPECT_EQ(hub.Resolves("README.md"), 1) << bad.output;
  EXPECT_FALSE(testing::Exists(dir / "o/README.md"));
  EXPECT_FALSE(testing::Exists(dir / "o/README.md.part")) << bad.output;
  EXPECT_FALSE(testing::Exists(dir / "o/README.md.part.json")) << bad.output;
  testing::WriteFile(dir / "list404.txt",
                     fmt::format("{}/datasets/cerebras/SlimPajama-627B/resolve/main/no-such-file.txt\n", hub.hub()));
  auto missing = run(dir / "list404.txt");
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("404"), std::string::npos) << missing.output;
  EXPECT_FALSE(testing::Exists(dir / "o/no-such-file.txt.part")) << missing.output;
  EXPECT_FALSE(testing::Exists(dir / "o/no-such-file.txt.part.json")) << missing.output;
}

// Downloads the repo into dir/out, lets `spoil` change what is there (it is given the first file's
// local path), then runs again with `flags`: the second run's result. The tree must end as the repo.
testing::CommandResult RerunAfter(TempDir& dir, const std::function<void(const std::string&)>& spoil,
                                  const std::string& flags) {
  auto paths = MakeRepo(dir / "repo");
  FakeHub hub(dir / "repo", {}, dir.path());
  EXPECT_TRUE(hub.ok());
  auto first = RunCmd(Download(hub, dir / "out", "--jobs 2"));
  EXPECT_EQ(first.exit_code, 0) << first.output;
  spoil(dir / ("out/" + paths[0]));
  auto again = RunCmd(Download(hub, dir / "out", "--jobs 2 " + flags));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  ExpectSameTree(dir / "repo", dir / "out", paths);
  return again;
}

// A file damaged in place (same size) is found by --verify and downloaded again, though the done
// logs still list it: the check a run makes once it holds a file's lock (was it finished meanwhile?)
// goes by the digest, not by those logs.
TEST(Download, VerifyDownloadsADamagedFileAgain) {
  TempDir dir;
  auto again = RerunAfter(
      dir,
      [](const std::string& victim) {
        std::string bytes = testing::ReadFile(victim);
        ASSERT_FALSE(bytes.empty());
        bytes[bytes.size() / 2] ^= 0x20;
        testing::WriteFile(victim, bytes);
      },
      "--verify");
  EXPECT_NE(again.output.find("digest does not match"), std::string::npos) << again.output;
}

// Regression (CI, TwoRunsOnOneLocalDir): a run that started a file another run had just finished,
// then was killed, left its `.part` beside the complete file, and no later run removed it. A rerun
// now removes such a leftover (and a run that takes a file's lock after another finished it does
// not start one).
TEST(Download, StalePartBesideACompleteFileIsRemoved) {
  TempDir dir;
  std::string done;
  RerunAfter(
      dir,
      [&](const std::string& complete) {
        done = complete;
        testing::WriteFile(done + ".part", "a killed run's first bytes");
        testing::WriteFile(done + ".part.json", "{}");
      },
      "");
  EXPECT_FALSE(testing::Exists(done + ".part.json"));
  EXPECT_EQ(testing::Leftovers(dir / "out"), "");
}

// Regression: two runs on one --local-dir (a requeued job while the first still runs)
// failed with "rename ... .part: No such file or directory". 20 trials, one run killed at a random
// moment in each, then a rerun: every file byte-identical, nothing left behind.
TEST(Download, TwoRunsOnOneLocalDir) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 30000);
  FakeHub hub(dir / "repo", {"--bytes-per-second", "600000"}, dir.path());
  ASSERT_TRUE(hub.ok());
  std::mt19937 rng(7);
  int refused = 0, killed = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::filesystem::remove_all(dir / "out");
    const std::string cmd = "env " + Download(hub, dir / "out", "--jobs 2");
    pid_t a = testing::SpawnShell(cmd, dir / "a.log");
    ::usleep(static_cast<useconds_t>(rng() % 100000));
    pid_t b = testing::SpawnShell(cmd, dir / "b.log");
    ::usleep(static_cast<useconds_t>(rng() % 300000));
    ::kill(trial % 2 ? a : b, SIGKILL);
    const int rc_a = testing::WaitExit(a), rc_b = testing::WaitExit(b);
    const int survivor = trial % 2 ? rc_b : rc_a;
    const std::string log = testing::ReadFile(trial % 2 ? dir / "b.log" : dir / "a.log");
    if ((trial % 2 ? rc_a : rc_b) == 128 + SIGKILL) ++killed;
    if (survivor != 0) {
      EXPECT_NE(log.find("is being written by another run"), std::string::npos) << "trial " << trial << ": " << log;
      EXPECT_EQ(log.find("No such file"), std::string::npos) << log;
      ++refused;
    }
    auto rerun = RunCmd(Download(hub, dir / "out", "--jobs 2"));
    ASSERT_EQ(rerun.exit_code, 0) << "trial " << trial << ": " << rerun.output;
    ExpectSameTree(dir / "repo", dir / "out", paths);
    EXPECT_EQ(testing::Leftovers(dir / "out"), "") << "trial " << trial;
  }
  std::printf("20 trials: the surviving run was refused some files %d times; %d runs killed mid-download\n", refused,
              killed);
  EXPECT_GT(killed, 0);
}

// A hostile or broken server. Each case failed on the old main: file:// and gopher://
// redirects were followed, API redirect loops and endless listings never ended, malformed numbers
// in headers aborted the process, control characters in listing paths reached the disk and the log.
TEST(Download, HostileServer) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 20000);
  std::string faults = R"({
    "train/chunk1/example_train_0.jsonl.zst": ["hub:redirect_file", "hub:redirect_file", "hub:redirect_file"],
    "train/chunk1/example_train_1.jsonl.zst": ["hub:redirect_gopher", "hub:redirect_gopher", "hub:redirect_gopher"],
    "train/chunk1/example_train_2.jsonl.zst": ["hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop",
      "hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop",
      "hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop", "hub:redirect_loop"],
    "train/chunk2/example_train_0.jsonl.zst": ["hub:bad_linked_size", "hub:bad_linked_size", "hub:bad_linked_size"],
    "train/chunk2/example_train_1.jsonl.zst": ["bad_content_range", "ok"],
    "train/chunk2/example_train_2.jsonl.zst": ["bad_ratelimit", "ok"]
  })";
  testing::WriteFile(dir / "faults.json", faults);
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", "--jobs 2 --max-retries 2"));
  EXPECT_EQ(r.exit_code, 1) << r.output;  // four files cannot be had; nothing crashed
  EXPECT_NE(r.output.find("only http:// and https:// are followed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"file:///etc/hostname\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("gopher://"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("redirect loop"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("malformed X-Linked-Size"), std::string::npos) << r.output;
  std::string hostname = testing::ReadFile("/etc/hostname");
  while (!hostname.empty() && hostname.back() == '\n') hostname.pop_back();
  if (!hostname.empty()) {
    EXPECT_EQ(r.output.find("\n" + hostname + "\n"), std::string::npos) << r.output;
  }
  // The bad Content-Range and the absurd RateLimit were retried, and those files arrived intact.
  for (const char* ok : {"train/chunk2/example_train_1.jsonl.zst", "train/chunk2/example_train_2.jsonl.zst"})
    EXPECT_EQ(testing::ReadFile(dir / ("out/" + std::string(ok))), testing::ReadFile(dir / ("repo/" + std::string(ok))))
        << ok;
  EXPECT_FALSE(testing::Exists(dir / "out/train/chunk1/example_train_0.jsonl.zst"));

  // Whole-server modes: bounded, named, non-zero.
  for (const std::vector<std::string>& mode :
       std::vector<std::vector<std::string>>{{"--api-redirect-loop"}, {"--endless-listing"}, {"--control-paths"}}) {
    TempDir d2;
    FakeHub h2(dir / "repo", mode, d2.path());
    ASSERT_TRUE(h2.ok());
    const auto t0 = std::chrono::steady_clock::now();
    auto m = RunCmd("timeout 60 env " + Download(h2, d2 / "out", "--max-retries 1"));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(m.exit_code, 1) << mode[0] << ": " << m.output;
    EXPECT_LT(secs, 30) << mode[0];
    if (mode[0] == "--api-redirect-loop") {
      EXPECT_NE(m.output.find("redirect loop"), std::string::npos) << m.output;
    }
    if (mode[0] == "--endless-listing") {
      EXPECT_NE(m.output.find("passed the limit"), std::string::npos) << m.output;
    }
    if (mode[0] == "--control-paths") {
      EXPECT_NE(m.output.find("control character"), std::string::npos) << m.output;
      EXPECT_EQ(m.output.find('\x1b'), std::string::npos) << "raw ESC in the log";
      EXPECT_EQ(m.output.find('\x07'), std::string::npos) << "raw BEL in the log";
    }
  }
}

// A resume that cannot show that it continues the same bytes starts the file over; it is
// never spliced. The file comes from a URL list without a sha256 (nothing checks the result), and
// each case drops the first transfer at 50,000 bytes, then answers the resume wrongly: a 206 of a
// replaced object (another ETag) though If-Range named the old one, a 200 carrying the Content-Range
// asked for but a body from byte 0 (as long as the range, or the whole file), a 206 without
// Content-Range. Each failed on the old main with a spliced file and exit 0 (but range200_full).
TEST(Download, AResumeThatCannotProveItContinuesStartsOver) {
  struct Case {
    std::string fault;
    bool size_given;
    bool changed;  // the object was replaced: the result must be the new version, whole
  };
  for (const Case& c :
       {Case{"changed_206", true, true}, Case{"changed_206", false, true}, Case{"range200", true, false},
        Case{"range200", false, false}, Case{"range200_full", true, false}, Case{"206_no_range", true, false}}) {
    const std::string what = c.fault + (c.size_given ? " (size= given)" : " (no size)");
    TempDir dir;
    auto paths = MakeRepo(dir / "repo", 200000);
    const std::string path = paths[0];
    const std::string original = testing::ReadFile(dir / ("repo/" + path));
    std::string v2 = original;
    for (auto& ch : v2) ch = static_cast<char>(ch ^ 0x5A);
    const std::string after = c.changed ? "changed" : "ok";
    testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["drop:50000", "{}", "{}", "{}", "{}"]}})", path,
                                                        c.fault, after, after, after));
    FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
    ASSERT_TRUE(hub.ok());
    testing::WriteFile(dir / "list.txt",
                       fmt::format("{}/datasets/cerebras/SlimPajama-627B/resolve/main/{} {}path=f.bin\n", hub.hub(),
                                   path, c.size_given ? fmt::format("size={} ", original.size()) : ""));
    auto r =
        RunCmd(fmt::format("{} --quiet --url-list {} --endpoint {} --local-dir {} --retry-base 0.01 "
                           "--stall-timeout 1",
                           testing::Tool("ptk-download"), dir / "list.txt", hub.hub(), dir / "out"));
    ASSERT_EQ(r.exit_code, 0) << what << ": " << r.output;
    const std::string got = testing::ReadFile(dir / "out/f.bin");
    EXPECT_EQ(got.size(), original.size()) << what;
    EXPECT_TRUE(got == (c.changed ? v2 : original)) << what << ": the file is a splice of two transfers";
    auto gets = hub.CdnGets(path);
    ASSERT_GE(gets.size(), 3u) << what;
    EXPECT_EQ(gets[1], "bytes=50000-") << what;
    EXPECT_EQ(gets[2], "") << what << ": the third transfer did not start over";
    EXPECT_EQ(testing::Leftovers(dir / "out"), "") << what;
  }
}

// The progress line (its bytes, rate and ETA) counts each byte of a file once: a transfer that starts
// over from byte 0 takes back the bytes it had counted. One file through the downloader itself (the
// progress reporter is the run's), against the fake CDN: a dropped connection whose Range retry the
// server answers with the whole file; a digest mismatch; a `.part` a previous run left that the
// server will not continue; the same three fetched as concurrent ranges. Before, the count ended at
// the file's size plus every byte received before the restart.
std::optional<uint64_t> CountedBytes(const FakeHub& hub, const std::string& path, const std::string& data,
                                     const std::string& out, bool ranged, int max_retries) {
  DownloadOptions o;
  o.endpoint = hub.hub();
  o.local_dir = out;
  o.retry_base_s = 0.01;
  o.retry_max_s = 0.05;
  o.stall_timeout_s = 1;
  o.max_retries = max_retries;
  o.connections_per_file = ranged ? 2 : 1;
  o.split_above = 1;
  o.piece_size = 100000;
  download_detail::Session s(o);
  HttpClient http;
  download_detail::StreamHasher hasher;
  download_detail::DoneLog done;
  std::filesystem::create_directories(out);
  EXPECT_TRUE(done.Open(out + "/done.tsv").ok());
  ProgressReporter::Options po;
  po.enabled = false;
  ProgressReporter progress(po);
  download_detail::FileDownloader d(s, http, hasher, done, progress);
  RemoteFile f;
  f.path = path;
  f.url = fmt::format("{}/datasets/cerebras/SlimPajama-627B/resolve/main/{}", hub.hub(), path);
  f.size = data.size();
  f.size_known = true;
  Sha256 h;
  h.Update(data.data(), data.size());
  f.sha256 = h.HexDigest();
  f.local_path = out + "/f.bin";
  const download_detail::FileResult r = d.Run(f);
  if (!r.ok) return std::nullopt;
  EXPECT_TRUE(testing::ReadFile(f.local_path) == data);
  return progress.bytes();
}

TEST(Download, TheProgressLineCountsAFileThatStartsOverOnce) {
  for (bool ranged : {false, true}) {
    struct Case {
      std::string what;
      std::vector<std::string> first_run, faults;  // first_run: a run that gives up, leaving a `.part`
    };
    for (const Case& c :
         {Case{"a dropped connection, then the whole file to a Range", {}, {"drop:50000", "ignore_range"}},
          Case{"a digest mismatch", {}, {"flip:777"}},
          Case{"a .part the server does not continue", {"drop:50000"}, {"ignore_range"}}}) {
      const std::string what = c.what + (ranged ? " (ranges)" : " (one stream)");
      TempDir dir;
      auto paths = MakeRepo(dir / "repo", 300000);
      const std::string data = testing::ReadFile(dir / ("repo/" + paths[0]));
      auto faults_json = [&](const std::vector<std::string>& faults) {
        std::string list;
        for (const auto& x : faults) list += (list.empty() ? "\"" : ", \"") + x + "\"";
        return fmt::format(R"({{"{}": [{}]}})", paths[0], list);
      };
      if (!c.first_run.empty()) {
        testing::WriteFile(dir / "faults1.json", faults_json(c.first_run));
        FakeHub hub(dir / "repo", {"--faults", dir / "faults1.json"}, dir.path());
        ASSERT_TRUE(hub.ok());
        ASSERT_FALSE(CountedBytes(hub, paths[0], data, dir / "out", ranged, 0).has_value()) << what;
        ASSERT_TRUE(testing::Exists(dir / "out/f.bin.part")) << what;
      }
      testing::WriteFile(dir / "faults.json", faults_json(c.faults));
      FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
      ASSERT_TRUE(hub.ok());
      const auto counted = CountedBytes(hub, paths[0], data, dir / "out", ranged, 8);
      ASSERT_TRUE(counted.has_value()) << what;
      EXPECT_EQ(*counted, data.size()) << what;
    }
  }
}

// A repo's own files never meet ptk-download's bookkeeping. On the old main x.bin got
// x.bin.part's bytes and x.bin.part was missing, a file under .ptk-download/ overwrote the done log,
// y.jsonl.ptk-lock and y.jsonl.part.json vanished, all with exit 0 ("3 downloaded, 0 failed").
// Now the files whose names are ptk's are refused by name (exit 1, on every run) and the others
// arrive intact.
TEST(Download, RepoFilesNamedLikePtksBookkeepingAreRefusedByName) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> repo = {
      {"x.bin", std::string(70000, 'x')},
      {"x.bin.part", std::string(30000, 'p')},
      {".ptk-download/done-0-of-1.tsv", "a repo file\n"},
      {"y.jsonl", "{\"text\": \"y\"}\n"},
      {"y.jsonl.ptk-lock", "a repo file named like a lock\n"},
      {"y.jsonl.part.json", "{\"a repo file\": 1}\n"},
      {"z.jsonl.part", "a .part of nothing listed: an ordinary name\n"}};
  for (const auto& [path, data] : repo) {
    std::filesystem::create_directories(std::filesystem::path(dir / ("repo/" + path)).parent_path());
    testing::WriteFile(dir / ("repo/" + path), data);
  }
  FakeHub hub(dir / "repo", {}, dir.path());
  ASSERT_TRUE(hub.ok());
  for (int run = 0; run < 2; ++run) {
    auto r = RunCmd(Download(hub, dir / "out", "--jobs 3"));
    EXPECT_EQ(r.exit_code, 1) << "run " << run << ": " << r.output;
    for (const char* refused : {"x.bin.part", ".ptk-download/done-0-of-1.tsv", "y.jsonl.ptk-lock", "y.jsonl.part.json"})
      EXPECT_NE(r.output.find(fmt::format("failed: {}: not downloaded", refused)), std::string::npos)
          << "run " << run << ": " << refused << " not refused by name: " << r.output;
    EXPECT_NE(r.output.find("4 of 7 files failed"), std::string::npos) << r.output;
    for (const char* ok : {"x.bin", "y.jsonl", "z.jsonl.part"})
      EXPECT_TRUE(testing::ReadFile(dir / ("out/" + std::string(ok))) ==
                  testing::ReadFile(dir / ("repo/" + std::string(ok))))
          << "run " << run << ": " << ok;
    EXPECT_FALSE(testing::Exists(dir / "out/x.bin.part")) << "run " << run;
    EXPECT_FALSE(testing::Exists(dir / "out/y.jsonl.ptk-lock")) << "run " << run;
    EXPECT_NE(testing::ReadFile(dir / "out/.ptk-download/done-0-of-1.tsv"), "a repo file\n");
    EXPECT_EQ(testing::Leftovers(dir / "out"), "") << "run " << run;
  }
}

// Only the names ptk writes are refused (as the directory walks of ptk-extract, ptk-concat and
// ptk-tokenize skip only those): every listed name with ".ptk-" was, so a repo's x.ptk-v2.jsonl
// or notes.ptk-draft.md never arrived (a failed file, exit 1). The names that would meet ptk's own
// (a temporary, a lock, a sidecar, a resume record, the state directory) still are.
TEST(Download, OnlyNamesThatMeetPtksOwnAreRefused) {
  TempDir dir;
  const std::vector<std::string> ours = {"a.jsonl.ptk-tmp-1-x",        "b.jsonl.ptk-lock",   "c.jsonl.ptk-done",
                                         "d_text_document.ptk-resume", "e.jsonl.ptk-verify", "f/.ptk-download/g"};
  const std::vector<std::string> theirs = {"x.ptk-v2.jsonl", "notes.ptk-draft.md", "y.ptk-downloads.txt",
                                           "w.ptk-lockstep.txt"};
  for (const auto& path : ours) {
    std::filesystem::create_directories(std::filesystem::path(dir / ("repo/" + path)).parent_path());
    testing::WriteFile(dir / ("repo/" + path), "named like ptk's own\n");
  }
  for (const auto& path : theirs) testing::WriteFile(dir / ("repo/" + path), "a repo file: " + path + "\n");
  FakeHub hub(dir / "repo", {}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto r = RunCmd(Download(hub, dir / "out", "--jobs 2"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  for (const auto& path : ours) {
    EXPECT_NE(r.output.find(fmt::format("failed: {}: not downloaded: \"{}\" is a name of ptk's own", path, path)),
              std::string::npos)
        << path << " not refused by name: " << r.output;
    EXPECT_FALSE(testing::Exists(dir / ("out/" + path))) << path;
  }
  for (const auto& path : theirs)
    EXPECT_EQ(testing::ReadFile(dir / ("out/" + path)), "a repo file: " + path + "\n") << path << ": " << r.output;
  EXPECT_NE(r.output.find("6 of 10 files failed"), std::string::npos) << r.output;
}

// --include that selects nothing (a typo) is an error, not "0 downloaded" and exit 0; one
// pattern of several that matches nothing is said.
TEST(Download, IncludeThatSelectsNothingIsAnError) {
  TempDir dir;
  MakeRepo(dir / "repo", 2000);
  FakeHub hub(dir / "repo", {}, dir.path());
  ASSERT_TRUE(hub.ok());
  auto none = RunCmd(Download(hub, dir / "out", "--include 'trian/**'"));
  EXPECT_EQ(none.exit_code, 1) << none.output;
  EXPECT_NE(none.output.find("is selected by --include \"trian/**\""), std::string::npos) << none.output;
  auto excluded = RunCmd(Download(hub, dir / "out", "--include 'README.md' --exclude '*.md'"));
  EXPECT_EQ(excluded.exit_code, 1) << excluded.output;
  EXPECT_NE(excluded.output.find("with --exclude \"*.md\""), std::string::npos) << excluded.output;
  auto one = RunCmd(Download(hub, dir / "out", "--include 'README.md' --include 'validaton/**'"));
  EXPECT_EQ(one.exit_code, 0) << one.output;
  EXPECT_NE(one.output.find("--include \"validaton/**\" matches no file"), std::string::npos) << one.output;
  EXPECT_TRUE(testing::Exists(dir / "out/README.md"));
}

// Every loop of requests ends. A listing whose Link rel=next comes back to a page
// already read (the same URL, or new URLs with the same entries) was followed forever (682 requests
// in 30 s): now an error naming the loop.
TEST(Download, ALoopingListingIsAnError) {
  TempDir dir;
  MakeRepo(dir / "repo", 1000);
  for (const char* mode : {"same", "fresh"}) {
    TempDir d;
    FakeHub hub(dir / "repo", {"--looping-listing", mode, "--page-size", "2"}, d.path());
    ASSERT_TRUE(hub.ok());
    const auto t0 = std::chrono::steady_clock::now();
    auto r = RunCmd("timeout 60 env " + Download(hub, d / "out", ""));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.exit_code, 1) << mode << ": " << r.output;
    EXPECT_LT(secs, 30) << mode;
    EXPECT_NE(r.output.find("pagination loop"), std::string::npos) << mode << ": " << r.output;
    EXPECT_LE(hub.Stat("listing_pages"), 3) << mode;
  }
}

// A Hub that drips a redirect's body a byte every 0.1 s (above the low-speed limit) hung
// the run past --stall-timeout and --max-retry-time. Now such a body is cut after --stall-timeout:
// a file whose first resolve drips arrives; one whose every resolve drips fails within
// --max-retry-time.
TEST(Download, ADrippingRedirectIsCut) {
  TempDir dir;
  auto paths = MakeRepo(dir / "repo", 20000);
  testing::WriteFile(dir / "faults.json",
                     fmt::format(R"({{"{}": ["hub:drip_redirect"], "{}": [{}]}})", paths[0], paths[1], [] {
                       std::string l;
                       for (int i = 0; i < 40; ++i) l += std::string(i ? ", " : "") + "\"hub:drip_redirect\"";
                       return l;
                     }()));
  FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
  ASSERT_TRUE(hub.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto r = RunCmd("timeout 120 env " + Download(hub, dir / "out", "--jobs 2 --max-retry-time 5 --max-retries 100"));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(secs, 40) << r.output;
  EXPECT_NE(r.output.find("still coming after"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failed: " + paths[1]), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--max-retry-time"), std::string::npos) << r.output;
  for (size_t i = 0; i < paths.size(); ++i) {
    if (i == 1) continue;
    EXPECT_TRUE(testing::ReadFile(dir / ("out/" + paths[i])) == testing::ReadFile(dir / ("repo/" + paths[i])))
        << paths[i];
  }
}

// A rate-limit pause longer than --max-retry-time leaves (Retry-After: 3600) was slept
// through for an hour; now the run fails at once saying so.
// Retry-After as delay-seconds or as an HTTP-date an hour ahead (the date was read as no hint: a
// backoff under a second, then the Hub asked again).
TEST(Download, ARateLimitPauseLongerThanTheRetryTimeFails) {
  for (const std::string fault : {"429_retry_after:3600", "429_retry_date:3600"}) {
    TempDir dir;
    auto paths = MakeRepo(dir / "repo", 2000);
    testing::WriteFile(dir / "faults.json", fmt::format(R"({{"{}": ["hub:{}"]}})", paths[0], fault));
    FakeHub hub(dir / "repo", {"--faults", dir / "faults.json"}, dir.path());
    ASSERT_TRUE(hub.ok());
    const auto t0 = std::chrono::steady_clock::now();
    auto r = RunCmd("timeout 60 env " + Download(hub, dir / "out", "--jobs 1 --max-retry-time 5"));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(r.exit_code, 1) << fault << r.output;
    EXPECT_LT(secs, 30) << r.output;
    EXPECT_NE(r.output.find(fault.find("date") == std::string::npos ? "Retry-After 3600" : " GMT: in 3"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("longer than --max-retry-time"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("failed: " + paths[0]), std::string::npos) << r.output;
    EXPECT_EQ(hub.Resolves(paths[0]), 1) << r.output;  // not asked again before the hour
  }
}

// A .part planted as a symlink must not make the download write through it.
TEST(Download, PartSymlinkIsNotFollowed) {
  TempDir dir;
  MakeRepo(dir / "repo", 3000);
  FakeHub hub(dir / "repo", {}, dir.path());
  ASSERT_TRUE(hub.ok());
  const std::string path = "train/chunk1/example_train_0.jsonl.zst";
  const std::string data = testing::ReadFile(dir / ("repo/" + path));
  std::filesystem::create_directories(dir / "out/train/chunk1");
  testing::WriteFile(dir / "victim.txt", "precious");
  std::filesystem::create_symlink(dir / "victim.txt", dir / ("out/" + path + ".part"));
  // ... with a record that says it is this file's partial download, so it would be resumed.
  testing::WriteFile(dir / ("out/" + path + ".part.json"), fmt::format("{}\t{}\n\n", data.size(), Sha256Hex(data)));
  auto r = RunCmd(Download(hub, dir / "out", "--include '" + path + "' --max-retries 1"));
  EXPECT_EQ(testing::ReadFile(dir / "victim.txt"), "precious") << r.output;
}

// A hub that never answers: every failed attempt is reported with the time of the next, and the
// run gives up after --max-retry-time naming the cause.
TEST(Download, UnreachableHubIsNeverSilentAndGivesUp) {
  TempDir dir;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = RunCmd(fmt::format(
      "timeout 60 {} --repo a/b --endpoint http://127.0.0.1:9 --local-dir {} --retry-base 0.2 --retry-max 1 "
      "--max-retries 100 --max-retry-time 3",
      testing::Tool("ptk-download"), dir / "out"));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(secs, 20);
  EXPECT_NE(r.output.find("attempt 2 of"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--max-retry-time"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:9"), std::string::npos) << r.output;
}

TEST(DownloadHelpers, UrlListNumbersAreChecked) {
  TempDir dir;
  for (const char* bad : {"size=abc", "size=-1", "size=99999999999999999999999"}) {
    testing::WriteFile(dir / "list.txt", fmt::format("http://127.0.0.1:9/x.jsonl {}\n", bad));
    auto r = RunCmd(fmt::format("{} --quiet --url-list {} --local-dir {}", testing::Tool("ptk-download"),
                                dir / "list.txt", dir / "o"));
    EXPECT_EQ(r.exit_code, 1) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("size= must be a byte count"), std::string::npos) << bad << ": " << r.output;
    EXPECT_EQ(r.output.find("exception"), std::string::npos) << r.output;
  }
  // A file where another's directory goes is refused before anything is fetched (one of the two
  // failed after the other was downloaded, leaving its .part), as two files in one place are.
  testing::WriteFile(dir / "list.txt", "http://127.0.0.1:9/a path=x\nhttp://127.0.0.1:9/b path=x/y/f.txt\n");
  auto clash = RunCmd(fmt::format("{} --quiet --url-list {} --local-dir {}", testing::Tool("ptk-download"),
                                  dir / "list.txt", dir / "o"));
  EXPECT_EQ(clash.exit_code, 1) << clash.output;
  EXPECT_NE(clash.output.find(dir / "o/x would be a file and the directory of " + dir / "o/x/y/f.txt"),
            std::string::npos)
      << clash.output;
  // A list without a URL is no download with nothing to do (it was exit 0, "0 of 0 files").
  for (const char* empty : {"", "\n# only a comment\n  \n"}) {
    testing::WriteFile(dir / "list.txt", empty);
    auto r = RunCmd(fmt::format("{} --quiet --url-list {} --local-dir {}", testing::Tool("ptk-download"),
                                dir / "list.txt", dir / "o"));
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(dir / "list.txt: no URL in it"), std::string::npos) << r.output;
  }
}

TEST(DownloadHelpers, PathsAreSanitizedAndFlattened) {
  EXPECT_TRUE(SanitizeRepoPath("train/chunk1/a.zst").ok());
  for (const char* bad : {"../etc/passwd", "/abs", "a/../../b", "a//b", "a\\b", "./a", "", "a\nb", "a\x1b[31m", "a\rb",
                          "a\tb", "a\x07", "a\x7f"})
    EXPECT_FALSE(SanitizeRepoPath(bad).ok()) << bad;
  EXPECT_EQ(FlatName("train/chunk1/example_train_0.jsonl.zst"), "example_train_chunk1_shard0.jsonl.zst");
  EXPECT_EQ(FlatName("train/chunk10/example_train_5911.jsonl.zst"), "example_train_chunk10_shard5911.jsonl.zst");
  EXPECT_EQ(FlatName("README.md"), "README.md");
  EXPECT_TRUE(GlobMatch("train/**", "train/chunk1/a.zst"));
  EXPECT_TRUE(GlobMatch("train/*", "train/chunk1/a.zst"));  // huggingface_hub's fnmatch: '*' crosses '/'
  EXPECT_FALSE(GlobMatch("train/**", "validation/chunk1/a.zst"));
  // huggingface_hub adds '*' to a pattern ending in '/' (a directory's files): --exclude 'validation/'
  // excluded nothing, downloading the split it named, exit 0. Python's fnmatch escapes nothing.
  EXPECT_TRUE(GlobMatch("train/", "train/chunk1/a.zst"));
  EXPECT_FALSE(GlobMatch("train/", "validation/train/a.zst"));
  EXPECT_FALSE(GlobMatch("train\\/a.zst", "train/a.zst"));
  EXPECT_TRUE(GlobMatch("train\\*", "train\\x"));
}

// A portable tree built on Debian finds the CA certificates where other distributions keep them.
TEST(Http, CaBundleFromTheEnvironmentOrTheUsualPlaces) {
  ::unsetenv("CURL_CA_BUNDLE");
  ::unsetenv("SSL_CERT_FILE");
  const std::string found = FindCaBundle();
  if (!found.empty()) {
    EXPECT_EQ(::access(found.c_str(), R_OK), 0) << found;
  }
  if (::access("/etc/ssl/certs/ca-certificates.crt", R_OK) == 0) {
    EXPECT_EQ(found, "/etc/ssl/certs/ca-certificates.crt");
  }
  ::setenv("SSL_CERT_FILE", "/opt/site/certs.pem", 1);
  EXPECT_EQ(FindCaBundle(), "/opt/site/certs.pem");
  ::setenv("CURL_CA_BUNDLE", "/opt/site/curl.pem", 1);
  EXPECT_EQ(FindCaBundle(), "/opt/site/curl.pem");
  ::unsetenv("CURL_CA_BUNDLE");
  ::unsetenv("SSL_CERT_FILE");
}

}  // namespace
}  // namespace ptk
