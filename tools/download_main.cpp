// ptk-download: Hugging Face repos or URL lists -> verified local files; parallel, resumable,
// rate-limit aware, shardable across Slurm array tasks.
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <fmt/core.h>

#include "common/cli.h"
#include "common/human_format.h"
#include "common/logging.h"
#include "common/status.h"
#include "dataprep/download/download.h"

namespace {

// How files are fetched: parallelism, ranges, retries and timeouts.
void AddTransferFlags(CLI::App& app, ptk::DownloadOptions& opt) {
  const CLI::Validator kSeconds = ptk::cli::RealIn(0, true, ptk::cli::kMaxSeconds, false);
  app.add_option("--jobs,--max-workers", opt.jobs, "Files downloaded at once (huggingface-cli's --max-workers)")
      ->check(ptk::cli::IntIn(1, 256));
  app.add_option("--connections-per-file", opt.connections_per_file,
                 "Connections a large file is fetched over at once, as byte ranges written in place (1: one "
                 "connection a file)")
      ->check(ptk::cli::IntIn(1, 64));
  app.add_option("--split-above", opt.split_above,
                 "Files of at least this many bytes (size and digest listed) are fetched as ranges")
      ->check(ptk::cli::IntIn(1, INT64_MAX));
  app.add_option("--piece-size", opt.piece_size,
                 "Bytes per range request (default: the file's size / 8 per connection, 1-32 MiB)")
      ->check(ptk::cli::IntIn(65536, INT64_MAX));
  app.add_option("--max-connections", opt.max_connections, "Connections open at once, all files together")
      ->check(ptk::cli::IntIn(1, 1024));
  app.add_option("--max-retries", opt.max_retries,
                 "Retries without progress per file (or Hub API call) before giving up")
      ->check(ptk::cli::IntIn(0, ptk::cli::kMaxInt));
  app.add_option("--max-retry-time", opt.max_retry_time_s,
                 "Seconds a file (or a Hub API call) may keep failing without progress before giving up")
      ->check(kSeconds);
  app.add_option("--retry-base", opt.retry_base_s, "Base of the exponential backoff, seconds")->check(kSeconds);
  app.add_option("--retry-max", opt.retry_max_s, "Longest backoff, seconds")->check(kSeconds);
  app.add_option("--stall-timeout", opt.stall_timeout_s,
                 "Abort and resume a transfer that receives nothing for this long, seconds")
      ->check(kSeconds);
}

// --repo is the Hub's repo id, NAME or ORG/NAME: a URL or a path of the Hub's web pages (what a browser's
// address bar shows) went to the API as .../api/datasets/https://huggingface.co/datasets/... and failed only
// there, after retries ("Could not resolve host", a 404). The id meant, when it can be told.
absl::Status CheckRepoId(const std::string& repo, const std::string& repo_type) {
  std::string id = repo;
  if (const size_t scheme = id.find("://"); scheme != std::string::npos) {
    const size_t path = id.find('/', scheme + 3);
    id = path == std::string::npos ? "" : id.substr(path + 1);
  }
  // A web page's path: a model at the root (huggingface.co/gpt2), datasets and spaces below their folders.
  std::string type = id == repo ? repo_type : "model";
  for (const char* kind : {"datasets/", "spaces/", "models/"})
    if (id.starts_with(kind)) {
      type = std::string(kind, std::strlen(kind) - 2);
      id = id.substr(std::strlen(kind));
    }
  // The repo's own pages: .../tree/main/train, .../resolve/main/x, .../blob/main/x.
  for (const char* page : {"/tree/", "/resolve/", "/blob/"})
    if (const size_t at = id.find(page); at != std::string::npos) id.resize(at);
  while (!id.empty() && id.back() == '/') id.pop_back();
  if (id == repo && std::count(id.begin(), id.end(), '/') <= 1 && id.find_first_of(" :?#") == std::string::npos)
    return absl::OkStatus();
  const bool told =
      !id.empty() && std::count(id.begin(), id.end(), '/') <= 1 && id.find_first_of(" :?#") == std::string::npos;
  return ptk::UsageError(fmt::format(
      "--repo {}: a repo id is NAME or ORG/NAME (cerebras/SlimPajama-627B), not a URL or a path{}", repo,
      told ? fmt::format("; did you mean --repo {}{}?", id, type == repo_type ? "" : " --repo-type " + type) : ""));
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  auto app = ptk::cli::MakeApp(
      "ptk-download",
      "Download a Hugging Face repo (listed through the Hub API, revision pinned to its commit) or a URL list into "
      "--local-dir. Files are fetched in parallel, resumed across runs (NAME.part + Range), verified (size and "
      "sha256) before an atomic rename, and split across array tasks. Exit 0 ok, 1 some file failed, 2 usage, 3 disk "
      "full.");
  ptk::DownloadOptions opt;
  std::optional<int64_t> shard_index, num_shards;
  std::string token_file;
  bool quiet = false;
  if (const char* ep = std::getenv("HF_ENDPOINT"); ep && *ep) opt.endpoint = ep;
  app->add_option("--repo", opt.repo, "Hub repo id, e.g. cerebras/SlimPajama-627B");
  app->add_option("--repo-type", opt.repo_type, "dataset, model or space")
      ->check(CLI::IsMember({"dataset", "model", "space"}));
  app->add_option("--revision", opt.revision, "Branch, tag or commit; pinned to its commit sha before listing");
  ptk::cli::Repeatable(app->add_option(
      "--include", opt.include,
      "Only repo paths matching these patterns (fnmatch; '*' crosses '/'), e.g. 'train/**'; repeatable"));
  ptk::cli::Repeatable(
      app->add_option("--exclude", opt.exclude, "Skip repo paths matching these patterns; repeatable"));
  app->add_option("--url-list", opt.url_list,
                  "File of 'URL [sha256=HEX] [size=N] [path=NAME]' lines instead of a repo");
  app->add_option("--local-dir", opt.local_dir, "Destination directory (mirrors the repo layout)")->required();
  app->add_option("--endpoint", opt.endpoint, "Hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)");
  app->add_option("--token-file", token_file,
                  "File holding the Hub token (default: $HF_TOKEN, $HF_TOKEN_PATH, $HF_HOME/token)");
  AddTransferFlags(*app, opt);
  app->add_option("--shard-index", shard_index,
                  "This task's shard (default: from SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX)")
      ->check(ptk::cli::IntIn(0, ptk::cli::kMaxInt));
  app->add_option("--num-shards", num_shards, "Number of shards (default: SLURM_ARRAY_TASK_COUNT or JOB_COMPLETIONS)")
      ->check(ptk::cli::IntIn(1, ptk::cli::kMaxInt));
  app->add_flag("--flat", opt.flat, "Flat names like the seed scripts: example_train_chunk1_shard0.jsonl.zst");
  app->add_flag("--verify", opt.verify, "Re-hash files already present instead of trusting the done log");
  app->add_flag("--list-only", opt.list_only, "List the repo, save the manifest, download nothing");
  app->add_flag("--quiet", quiet, "No progress output");
  ptk::cli::AddLockWait(*app, &opt.lock_wait);
  // huggingface-cli's --token TOKEN was read as a prefix of --token-file: the token taken for a file name
  // (and printed in the error).
  ptk::cli::Refusals refused(*app);
  refused.Option("--token",
                 "a token on the command line is seen by every user (ps) and kept in shell history; give it in "
                 "HF_TOKEN, or in a file with --token-file");
  // huggingface-cli download's other flags that have no place here, each with what ptk-download does instead.
  refused.Flag(
      "--resume-download",
      "ptk-download always resumes: a NAME.part goes on where the server proves it continues it; drop the flag");
  refused.Flag("--force-download",
               "a file present and verified is kept; --verify re-hashes the files present (one that fails is fetched "
               "again), and a file deleted is fetched again");
  refused.Option("--cache-dir", "ptk-download writes the files themselves into --local-dir (no Hugging Face cache)");
  refused.Option("--local-dir-use-symlinks",
                 "the files are written into --local-dir itself (no cache to link to); drop the flag");
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;

  return ptk::cli::RunMain([&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(refused.Check());
    if (opt.repo.empty() == opt.url_list.empty()) return ptk::UsageError("give either --repo or --url-list");
    if (!opt.repo.empty()) PTK_RETURN_IF_ERROR(CheckRepoId(opt.repo, opt.repo_type));
    PTK_RETURN_IF_ERROR(ptk::cli::CheckInputFile("--url-list", opt.url_list));
    while (!opt.endpoint.empty() && opt.endpoint.back() == '/') opt.endpoint.pop_back();
    PTK_ASSIGN_OR_RETURN(opt.token, ptk::FindHfToken(token_file));
    opt.progress = !quiet;
    PTK_ASSIGN_OR_RETURN(opt.shard, ptk::ResolveShard(shard_index, num_shards));
    PTK_ASSIGN_OR_RETURN(ptk::DownloadSummary s, ptk::RunDownload(opt));
    if (opt.list_only) return absl::OkStatus();
    ptk::log::Info(
        "shard {}/{}: {} downloaded ({}; {} as ranges, {} range requests), {} already present, {} failed; {} "
        "resolves, {} retries, {} rate-limited, {:.1f} s ({:.1f} MB/s)",
        opt.shard.index, opt.shard.count, s.downloaded, ptk::HumanBytes(static_cast<double>(s.bytes_downloaded)),
        s.ranged_files, s.range_requests, s.already_present, s.failures.size(), s.resolves, s.retries, s.rate_limited,
        s.seconds, s.bytes_downloaded / 1e6 / std::max(s.seconds, 1e-9));
    if (!s.failures.empty()) {
      for (const auto& f : s.failures) {
        // Most messages name the file first already: not twice.
        const std::string_view m = ptk::StatusMessage(f.error);
        if (m.starts_with(f.path + ":"))
          ptk::log::Error("failed: {}", m);
        else
          ptk::log::Error("failed: {}: {}", f.path, m);
      }
      return absl::UnavailableError(
          fmt::format("{} of {} files failed; rerun to retry them", s.failures.size(), s.files_in_shard));
    }
    return absl::OkStatus();
  });
}
