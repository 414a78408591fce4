// ptk-download's engine: RunDownload orchestrates listing, state, rate limits and file fetches.
#include "dataprep/download/download.h"

#include <fnmatch.h>

#include <algorithm>

#include <fmt/core.h>

#include "absl/strings/ascii.h"
#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/human_format.h"
#include "common/logging.h"
#include "common/parallel.h"
#include "common/progress.h"
#include "common/status.h"

#include "dataprep/download/download_internal.h"
#include "dataprep/input/input_list.h"

#include "common/output_lock.h"

namespace ptk {

using namespace download_detail;

// ---------------------------------------------------------------- public helpers

// What a killed run left while writing a file's partial-download record (`X.part.json.ptk-tmp-*`)
// or the file itself, and its lock files: removed when the file's lock can be had (nobody is
// writing it then). The
// state directory is left alone (its files are not locked; their temporaries are unique).
void RemoveTemporariesOfKilledRuns(const std::string& local_dir, std::chrono::milliseconds lock_wait) {
  auto files = ListFilesRecursive(local_dir);
  if (!files.ok()) return;
  for (const auto& rel : *files) {
    if (rel.rfind(std::string(kStateDir) + "/", 0) == 0) continue;
    const std::string_view lock_suffix = OutputLock::kSuffix;
    if (rel.size() > lock_suffix.size() &&
        rel.compare(rel.size() - lock_suffix.size(), lock_suffix.size(), lock_suffix) == 0) {
      // A killed run's lock file: taking and releasing the lock removes it (unless a run holds it).
      (void)OutputLock::Acquire(JoinPath(local_dir, rel.substr(0, rel.size() - lock_suffix.size())), lock_wait);
      continue;
    }
    const size_t at = rel.find(".ptk-tmp-");
    if (at == std::string::npos) continue;
    std::string target = rel.substr(0, at);
    for (std::string_view suf : {".part.json", ".part"})
      if (target.size() > suf.size() && target.compare(target.size() - suf.size(), suf.size(), suf) == 0)
        target.resize(target.size() - suf.size());
    auto lock = OutputLock::Acquire(JoinPath(local_dir, target), lock_wait);
    if (lock.ok()) (void)RemoveFileIfExists(JoinPath(local_dir, rel));
  }
}

absl::StatusOr<bool> download_detail::PresentAndVerified(const RemoteFile& f, const std::set<std::string>& done,
                                                         bool verify, DoneLog& log, bool warn) {
  auto sz = FileSize(f.local_path);
  bool present = sz.ok() && (!f.size_known || *sz == f.size);
  const std::string key = DoneLogKey(f);
  if (present && (verify || !done.count(key))) {
    const bool git = f.sha256.empty() && !f.git_sha1.empty();
    const std::string want = git ? f.git_sha1 : f.sha256;
    if (!want.empty()) {
      auto h = HashFile(f.local_path, git, *sz);
      present = h.ok() && *h == want;
      if (!present && warn)
        log::Warning("{}: present but its digest does not match; downloading it again", f.local_path);
    } else if (!f.size_known) {
      present = done.count(key) > 0;  // nothing to check it against
    }
    if (present && !done.count(key)) PTK_RETURN_IF_ERROR(log.Append(key));
  }
  return present;
}

void download_detail::RemovePartOf(const RemoteFile& f) {
  (void)RemoveFileIfExists(f.local_path + ".part");
  (void)RemoveFileIfExists(f.local_path + ".part.json");
}

void download_detail::RemoveStalePart(const RemoteFile& f, std::chrono::milliseconds lock_wait) {
  if (!PathExists(f.local_path + ".part") && !PathExists(f.local_path + ".part.json")) return;
  auto lock = OutputLock::Acquire(f.local_path, lock_wait);
  if (lock.ok()) RemovePartOf(f);  // (else a run is writing it: its own business)
}

std::string BookkeepingClash(const std::string& rel, const std::set<std::string>& listed) {
  if (IsPtkOwnName(rel))
    return fmt::format(
        "{:?} is a name of ptk's own (its state directory {}/, X.ptk-tmp-*, X.ptk-lock, X.ptk-done, X.ptk-resume, "
        "...), which ptk's tools never take for data",
        log::Printable(rel), kStateDir);
  for (std::string_view suffix : {".part", ".part.json"}) {
    if (rel.size() <= suffix.size() || rel.compare(rel.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const std::string base = rel.substr(0, rel.size() - suffix.size());
    if (listed.count(base))
      return fmt::format("{:?} is where ptk-download keeps {} of {:?}, also in the listing", log::Printable(rel),
                         suffix == ".part" ? "the partial download" : "the record of the partial download",
                         log::Printable(base));
  }
  return "";
}

absl::StatusOr<std::string> SanitizeRepoPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty path in the listing");
  if (path[0] == '/' || path.find('\\') != std::string::npos || path.find('\0') != std::string::npos)
    return absl::InvalidArgumentError(fmt::format("unsafe path in the listing: {:?}", path));
  for (unsigned char c : path)
    if (c < 0x20 || c == 0x7f)
      return absl::InvalidArgumentError(
          fmt::format("unsafe path in the listing (control character): {:?}", log::Printable(path)));
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t e = path.find('/', pos);
    if (e == std::string::npos) e = path.size();
    std::string comp = path.substr(pos, e - pos);
    if (comp.empty() || comp == "." || comp == "..")
      return absl::InvalidArgumentError(fmt::format("unsafe path in the listing: {:?}", path));
    pos = e + 1;
  }
  return path;
}

std::string FlatName(const std::string& repo_path) {
  static const std::regex re(R"(^(?:.*/)?chunk(\d+)/(.+)_(\d+)(\.[^/]+)$)");
  std::smatch m;
  if (std::regex_match(repo_path, m, re))
    return fmt::format("{}_chunk{}_shard{}{}", m[2].str(), m[1].str(), m[3].str(), m[4].str());
  std::string s = repo_path;
  std::replace(s.begin(), s.end(), '/', '_');
  return s;
}

bool GlobMatch(const std::string& pattern, const std::string& path) {
  // As huggingface_hub's filter_repo_objects: a pattern ending in '/' is that directory's files
  // ("train/" is "train/*"; it matched nothing, so --exclude 'validation/' excluded nothing), and
  // Python's fnmatch, in which a backslash escapes nothing.
  const std::string p = !pattern.empty() && pattern.back() == '/' ? pattern + "*" : pattern;
  return ::fnmatch(p.c_str(), path.c_str(), FNM_NOESCAPE) == 0;
}

namespace {
std::string FormatPatterns(const std::vector<std::string>& patterns) {
  std::string out;
  for (const auto& p : patterns) out += fmt::format("{}{:?}", out.empty() ? "" : " ", p);
  return out;
}
}  // namespace

namespace {

// The repo's files this run selects: the revision pinned to a commit (sum->commit), the listing
// (saved per commit below --local-dir, reused by later runs), --include / --exclude. `all_rels`
// gets the names below --local-dir of the whole listing.
absl::StatusOr<std::vector<RemoteFile>> ListRepo(const DownloadOptions& opt, Session& s, HttpClient& http,
                                                 DownloadSummary* sum, std::set<std::string>* all_rels) {
  std::vector<RemoteFile> files;
  // Said before the first request, so that a hub that does not answer is never met with silence.
  log::Info("asking {} for {} {}@{}", opt.endpoint, opt.repo_type, opt.repo, opt.revision);
  PTK_ASSIGN_OR_RETURN(sum->commit, PinRevision(s, http));
  const std::string manifest =
      JoinPath(JoinPath(opt.local_dir, kStateDir), fmt::format("manifest-{}.jsonl", sum->commit));
  {
    // What a run killed while writing the listing left (its temporary, its lock): removed when no
    // run is writing it now.
    auto lock = OutputLock::Acquire(manifest, opt.lock_wait);
    if (lock.ok()) RemoveStaleTemporaries(manifest);
  }
  if (PathExists(manifest)) {
    PTK_ASSIGN_OR_RETURN(files, ReadManifest(manifest));
    log::Info("using the listing of {}@{} saved in {}", opt.repo, sum->commit.substr(0, 12), manifest);
  } else {
    PTK_ASSIGN_OR_RETURN(files, ListTree(s, http, sum->commit));
    std::string text;
    for (const auto& f : files) text += ManifestLine(f);
    // Another run writing it meanwhile writes the same listing: this one need not.
    auto lock = OutputLock::Acquire(manifest, opt.lock_wait);
    if (lock.ok()) PTK_RETURN_IF_ERROR(WriteFileAtomic(manifest, text));
  }
  // Names below --local-dir of the whole listing (not only the selection): a file this run does
  // not select may be on disk from another run, where this run's bookkeeping must not meet it.
  for (const auto& f : files) {
    auto clean = SanitizeRepoPath(f.path);
    if (clean.ok()) all_rels->insert(opt.flat ? FlatName(*clean) : *clean);
  }
  std::vector<RemoteFile> kept;
  std::vector<bool> include_used(opt.include.size(), false);
  for (auto& f : files) {
    bool inc = opt.include.empty();
    for (size_t i = 0; i < opt.include.size(); ++i)
      if (GlobMatch(opt.include[i], f.path)) include_used[i] = inc = true;
    for (const auto& p : opt.exclude) inc = inc && !GlobMatch(p, f.path);
    if (inc) kept.push_back(std::move(f));
  }
  // A selection that is empty is a mistake (a typo in a pattern), never a silent success. One
  // pattern among several that matches nothing is said (the Slurm scripts add a validation
  // folder's pattern that some repos lack).
  if (kept.empty() && (!opt.include.empty() || !opt.exclude.empty()))
    return absl::NotFoundError(fmt::format("no file of {} {}@{} ({} files listed) is selected by {}{}{}", opt.repo_type,
                                           opt.repo, sum->commit.substr(0, 12), files.size(),
                                           opt.include.empty() ? "" : "--include " + FormatPatterns(opt.include),
                                           opt.include.empty() || opt.exclude.empty() ? "" : " with ",
                                           opt.exclude.empty() ? "" : "--exclude " + FormatPatterns(opt.exclude)));
  for (size_t i = 0; i < opt.include.size(); ++i)
    if (!include_used[i])
      log::Warning("--include {:?} matches no file of {}@{}", opt.include[i], opt.repo, sum->commit.substr(0, 12));
  return kept;
}

// Each file's place below --local-dir (two files in one place is an error), in path order.
absl::Status PlaceFiles(const DownloadOptions& opt, std::vector<RemoteFile>& files, std::set<std::string>* all_rels) {
  std::set<std::string> locals;
  for (auto& f : files) {
    PTK_ASSIGN_OR_RETURN(std::string clean, SanitizeRepoPath(f.path));
    f.local_path = JoinPath(opt.local_dir, opt.flat ? FlatName(clean) : clean);
    all_rels->insert(opt.flat ? FlatName(clean) : clean);
    if (!locals.insert(f.local_path).second)
      return absl::InvalidArgumentError(fmt::format("two files would be written to {}{}", f.local_path,
                                                    opt.flat ? " (--flat: narrow the selection with --include)" : ""));
  }
  // A file where another one's directory goes (a URL list's path=x and path=x/y): one of the two
  // failed after the other was downloaded, leaving its .part.
  for (const std::string& local : locals)
    for (size_t slash = local.find('/'); slash != std::string::npos; slash = local.find('/', slash + 1))
      if (locals.count(local.substr(0, slash)))
        return absl::InvalidArgumentError(
            fmt::format("{} would be a file and the directory of {}", local.substr(0, slash), local));
  std::sort(files.begin(), files.end(), [](const RemoteFile& a, const RemoteFile& b) { return a.path < b.path; });
  return absl::OkStatus();
}

struct Todo {
  std::vector<RemoteFile> files;
  uint64_t bytes = 0, total_bytes = 0;
};

// What of this shard's files is still to download: those already there and verified are counted
// (sum->already_present), those whose name meets the bookkeeping are failures.
absl::StatusOr<Todo> FilesToFetch(const DownloadOptions& opt, const std::vector<RemoteFile>& mine,
                                  const std::set<std::string>& all_rels, const std::set<std::string>& done,
                                  DoneLog& log_file, DownloadSummary* sum) {
  Todo todo;
  for (const auto& f : mine) {
    const std::string rel = f.local_path.substr(opt.local_dir.size() + (opt.local_dir.back() == '/' ? 0 : 1));
    if (std::string clash = BookkeepingClash(rel, all_rels); !clash.empty()) {
      sum->failures.push_back(
          {f.path, absl::FailedPreconditionError(fmt::format(
                       "not downloaded: {}; exclude it (--exclude {:?}) or download it elsewhere", clash, f.path))});
      log::Error("{}: {}", log::Printable(f.path), StatusMessage(sum->failures.back().error));
      continue;
    }
    todo.total_bytes += f.size;
    PTK_ASSIGN_OR_RETURN(const bool present, PresentAndVerified(f, done, opt.verify, log_file));
    if (present) {
      ++sum->already_present;
      RemoveStalePart(f, opt.lock_wait);
    } else {
      todo.files.push_back(f);
      todo.bytes += f.size;
    }
  }
  return todo;
}

// The files fetched on opt.jobs threads, published (fsync, rename, done log) in batches, then made
// durable; the counts and failures go to `sum`.
void FetchFiles(const DownloadOptions& opt, Session& s, const Todo& todo, DoneLog& log_file, DownloadSummary* sum) {
  const std::vector<RemoteFile>& files = todo.files;
  ProgressReporter progress({.label = "download",
                             .item_unit = "files",
                             .items_total = files.size(),
                             .bytes_total = todo.bytes,
                             .enabled = opt.progress});
  std::mutex mu;
  std::atomic<bool> stop_scheduling{false};
  // Verified files are made durable and renamed by the publisher, a batch per fsync, while the
  // workers go on with the next files.
  Publisher publisher(log_file);
  s.publisher = &publisher;
  ParallelForEach(
      files.size(), opt.jobs,
      [&](size_t i) {
        thread_local std::unique_ptr<HttpClient> client;
        thread_local std::unique_ptr<StreamHasher> hasher;
        if (!client) client = std::make_unique<HttpClient>();
        if (!hasher) hasher = std::make_unique<StreamHasher>();
        FileDownloader dl(s, *client, *hasher, log_file, progress);
        dl.commit_ = sum->commit;
        FileResult r = dl.Run(files[i]);
        std::lock_guard<std::mutex> lock(mu);
        if (r.ok && r.already_present) {
          ++sum->already_present;
        } else if (r.ok) {
          ++sum->downloaded;
          sum->bytes_downloaded += r.bytes;
        } else {
          sum->failures.push_back({files[i].path, r.error});
          if (!s.disk_full) log::Error("{}: {}", files[i].path, StatusMessage(r.error));
        }
        if (s.disk_full) stop_scheduling = true;
        progress.AddItems(1);
      },
      &stop_scheduling);
  publisher.Drain();
  for (auto& [item, error] : publisher.TakeFailures()) {
    --sum->downloaded;
    sum->bytes_downloaded -= item.bytes;
    if (error.code() == absl::StatusCode::kResourceExhausted) s.disk_full = true;
    if (!s.disk_full) log::Error("{}: {}", item.path, StatusMessage(error));
    sum->failures.push_back({item.path, error});
  }
  s.publisher = nullptr;
  progress.Finish();
  // Make this run's renames and done-log lines durable.
  std::set<std::string> dirs;
  for (const auto& f : files) dirs.insert(Dirname(f.local_path));
  for (const auto& d : dirs) {
    absl::Status st = FsyncDir(d);
    if (!st.ok() && PathExists(d)) log::Warning("{}", StatusMessage(st));
  }
  absl::Status synced = log_file.Sync();
  if (!synced.ok()) log::Warning("{}", StatusMessage(synced));
}

uint64_t FreeBytes(const std::string& dir) {
  struct statvfs vfs;
  return ::statvfs(dir.c_str(), &vfs) == 0 ? static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize : 0;
}

}  // namespace

absl::StatusOr<DownloadSummary> RunDownload(const DownloadOptions& opt) {
  const auto t0 = Clock::now();
  if (opt.local_dir.empty()) return UsageError("--local-dir is required");
  if (opt.repo.empty() == opt.url_list.empty()) return absl::InvalidArgumentError("give either --repo or --url-list");
  PTK_RETURN_IF_ERROR(MakeDirs(JoinPath(opt.local_dir, kStateDir)));
  RemoveTemporariesOfKilledRuns(opt.local_dir, opt.lock_wait);
  Session s(opt);
  HttpClient http;
  DownloadSummary sum;

  std::vector<RemoteFile> files;
  std::set<std::string> all_rels;  // every file's name below --local-dir
  if (!opt.repo.empty()) {
    PTK_ASSIGN_OR_RETURN(files, ListRepo(opt, s, http, &sum, &all_rels));
  } else {
    PTK_ASSIGN_OR_RETURN(files, ReadUrlList(opt.url_list));
  }
  PTK_RETURN_IF_ERROR(PlaceFiles(opt, files, &all_rels));
  sum.files_total = static_cast<int64_t>(files.size());
  if (opt.list_only) {
    log::Info("{} files selected (listing saved in {}/{})", files.size(), opt.local_dir, kStateDir);
    return sum;
  }
  std::vector<RemoteFile> mine;
  for (size_t i = 0; i < files.size(); ++i)
    if (InShard(static_cast<int64_t>(i), opt.shard)) mine.push_back(files[i]);
  sum.files_in_shard = static_cast<int64_t>(mine.size());

  // What is already there and verified.
  const std::string state = JoinPath(opt.local_dir, kStateDir);
  std::set<std::string> done = ReadDoneLogs(state);
  DoneLog log_file;
  PTK_RETURN_IF_ERROR(
      log_file.Open(JoinPath(state, fmt::format("done-{}-of-{}.tsv", opt.shard.index, opt.shard.count))));
  PTK_ASSIGN_OR_RETURN(const Todo todo, FilesToFetch(opt, mine, all_rels, done, log_file, &sum));
  struct statvfs vfs;
  if (::statvfs(opt.local_dir.c_str(), &vfs) == 0) {
    uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (free_bytes < todo.bytes)
      log::Warning("{} has {} free but {} are still to download", opt.local_dir, HumanBytes(free_bytes),
                   HumanBytes(todo.bytes));
  }
  // A --url-list without size= gives no size: "(0 B)" said the files were empty.
  const size_t unknown =
      static_cast<size_t>(std::count_if(mine.begin(), mine.end(), [](const RemoteFile& f) { return !f.size_known; }));
  const std::string bytes =
      unknown == 0 ? HumanBytes(static_cast<double>(todo.total_bytes))
      : unknown == mine.size()
          ? std::string("sizes not listed")
          : fmt::format("{}, and {} of a size not listed", HumanBytes(static_cast<double>(todo.total_bytes)), unknown);
  log::Info("shard {}/{}: {} of {} files ({}), {} already present and verified, {} to download", opt.shard.index,
            opt.shard.count, mine.size(), files.size(), bytes, sum.already_present, todo.files.size());

  FetchFiles(opt, s, todo, log_file, &sum);
  sum.resolves = s.resolves;
  sum.retries = s.retries;
  sum.rate_limited = s.rate_limited;
  sum.ranged_files = s.ranged_files;
  sum.range_requests = s.range_requests;
  sum.disk_full = s.disk_full;
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (sum.disk_full)
    return absl::ResourceExhaustedError(fmt::format(
        "disk full under {}: stopped with {} file(s) left; partial downloads are kept as .part files and resume "
        "on the next run ({} free, about {} still needed)",
        opt.local_dir, todo.files.size() - static_cast<size_t>(sum.downloaded),
        HumanBytes(static_cast<double>(FreeBytes(opt.local_dir))),
        HumanBytes(static_cast<double>(todo.bytes - sum.bytes_downloaded))));
  return sum;
}

absl::StatusOr<std::string> FindHfToken(const std::string& token_file) {
  auto read = [](const std::string& p) -> absl::StatusOr<std::string> {
    PTK_ASSIGN_OR_RETURN(std::string s, ReadFileToString(p));
    return std::string(absl::StripTrailingAsciiWhitespace(s));
  };
  auto read_if_exists = [&](const std::string& p) -> std::string {
    auto t = read(p);
    return t.ok() ? *t : "";
  };
  if (!token_file.empty()) {
    auto t = read(token_file);
    if (!t.ok()) return Annotate(t.status(), "--token-file");
    return *t;
  }
  if (const char* t = std::getenv("HF_TOKEN"); t && *t) return std::string(t);
  if (const char* p = std::getenv("HF_TOKEN_PATH"); p && *p) return read_if_exists(p);
  if (const char* h = std::getenv("HF_HOME"); h && *h) return read_if_exists(JoinPath(h, "token"));
  if (const char* home = std::getenv("HOME"); home && *home)
    return read_if_exists(JoinPath(home, ".cache/huggingface/token"));
  return std::string();
}

}  // namespace ptk
