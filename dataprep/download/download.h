// ptk-download's engine: whole Hugging Face repos (tree API, revision pinned to a commit) or URL
// lists; parallel, resumable across runs (NAME.part + Range), verified (size and sha256/git-sha1)
// before the atomic rename, aware of the Hub's rate limits, shardable across array tasks.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/slurm_env.h"

namespace ptk {

struct DownloadOptions {
  // Source: a Hub repo ...
  std::string endpoint = "https://huggingface.co";
  std::string repo;                   // "cerebras/SlimPajama-627B"
  std::string repo_type = "dataset";  // dataset | model | space
  std::string revision = "main";
  std::vector<std::string> include, exclude;  // fnmatch patterns on repo paths ('*' crosses '/')
  // ... or a URL list: one "URL [sha256=HEX] [size=N] [path=NAME]" per line.
  std::string url_list;

  std::string local_dir;
  std::string token;  // sent as a Bearer token to the Hub host only; never logged
  bool flat = false;  // train/chunk1/example_train_0.jsonl.zst -> example_train_chunk1_shard0.jsonl.zst
  int jobs = 8;       // files downloaded at once
  // A file of at least split_above bytes (its size and digest known) is fetched as byte ranges over
  // up to connections_per_file connections at once, written in place; 1 turns splitting off.
  int connections_per_file = 8;
  uint64_t split_above = 64ull << 20;
  uint64_t piece_size = 0;    // bytes per range request; 0: size / (8 * connections_per_file), 1-32 MiB
  int max_connections = 64;   // connections open at once, all files together
  int max_retries = 8;        // attempts without progress per file
  double retry_base_s = 1.0;  // exponential backoff with full jitter
  double retry_max_s = 60.0;
  double max_retry_time_s = 1800.0;  // a file (or an API call) failing this long without progress gives up
  double stall_timeout_s = 60.0;
  double connect_timeout_s = 10.0;  // as huggingface_hub's default
  double api_timeout_s = 300.0;     // whole-request limit for Hub API calls (listing pages, revision)
  int page_size_hint = 0;           // not sent; the server paginates
  ShardSpec shard;
  bool verify = false;     // re-hash files already present
  bool list_only = false;  // write the manifest and stop
  bool progress = true;
  // How long to keep trying for a file (or the listing) another run is writing (--lock-wait; OutputLock::Acquire).
  std::chrono::milliseconds lock_wait{0};
};

struct RemoteFile {
  std::string path;  // repo path (or name from the URL list)
  std::string url;   // URL-list mode only
  uint64_t size = 0;
  bool size_known = false;
  std::string sha256;      // LFS sha256 (or from the URL list)
  std::string git_sha1;    // git blob id for non-LFS Hub files
  std::string local_path;  // where it goes
};

struct DownloadFailure {
  std::string path;
  absl::Status error;
};

struct DownloadSummary {
  std::string commit;       // pinned revision (Hub mode)
  int64_t files_total = 0;  // in the listing after include/exclude
  int64_t files_in_shard = 0;
  int64_t downloaded = 0, already_present = 0;
  uint64_t bytes_downloaded = 0;
  int64_t resolves = 0, retries = 0, rate_limited = 0;
  int64_t ranged_files = 0, range_requests = 0;  // files fetched as concurrent ranges, and their requests
  std::vector<DownloadFailure> failures;
  bool disk_full = false;
  double seconds = 0;
};

// Errors that stop the run (bad repo, listing failure, disk full) are returned as a Status
// (disk full: kResourceExhausted); per-file failures are in the summary.
absl::StatusOr<DownloadSummary> RunDownload(const DownloadOptions& options);

// The Hub token as huggingface_hub finds it: `token_file` when given (unreadable: an error), else
// $HF_TOKEN, $HF_TOKEN_PATH, $HF_HOME/token, ~/.cache/huggingface/token; "" when none is set.
absl::StatusOr<std::string> FindHfToken(const std::string& token_file);

// Helpers exposed for tests.
absl::StatusOr<std::string> SanitizeRepoPath(const std::string& path);
// Why a file may not be written at `rel` below --local-dir: the name is one of ptk's own
// (IsPtkOwnName: the state directory .ptk-download/, X.ptk-tmp-*, X.ptk-lock, X.ptk-done, ...; not
// any name with ".ptk-": a repo's x.ptk-v2.jsonl downloads), or the partial
// download (NAME.part) or its record (NAME.part.json) of a file NAME in `listed`. "" when it may.
// Such a file is refused by name (a failed file, exit 1), never downloaded over ptk's bookkeeping.
std::string BookkeepingClash(const std::string& rel, const std::set<std::string>& listed);
std::string FlatName(const std::string& repo_path);
bool GlobMatch(const std::string& pattern, const std::string& path);

}  // namespace ptk
