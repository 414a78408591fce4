// ptk-download's state on disk: the listing manifest, URL lists, done logs.
#include "absl/strings/ascii.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "dataprep/download/download_internal.h"

namespace ptk::download_detail {

std::string ManifestLine(const RemoteFile& f) {
  return JsonWriter()
             .BeginObject()
             .Field("path", f.path)
             .Field("size", f.size)
             .Field("sha256", f.sha256)
             .Field("git_sha1", f.git_sha1)
             .EndObject()
             .str() +
         "\n";
}

absl::StatusOr<std::vector<RemoteFile>> ReadManifest(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<RemoteFile> out;
  simdjson::dom::parser p;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t e = text.find('\n', pos);
    if (e == std::string::npos) e = text.size();
    std::string_view line(text.data() + pos, e - pos);
    pos = e + 1;
    if (line.empty()) continue;
    simdjson::dom::element el;
    std::string_view fp, sha, git;
    uint64_t size;
    if (p.parse(line.data(), line.size()).get(el) || el["path"].get(fp) || el["size"].get(size) ||
        el["sha256"].get(sha) || el["git_sha1"].get(git))
      return absl::DataLossError(fmt::format("{}: corrupt manifest line", path));
    RemoteFile f;
    f.path = std::string(fp);
    f.size = size;
    f.size_known = true;
    f.sha256 = std::string(sha);
    f.git_sha1 = std::string(git);
    out.push_back(std::move(f));
  }
  return out;
}

absl::StatusOr<std::vector<RemoteFile>> ReadUrlList(const std::string& path) {
  PTK_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::vector<RemoteFile> out;
  size_t pos = 0;
  int line_no = 0;
  while (pos < text.size()) {
    size_t e = text.find('\n', pos);
    if (e == std::string::npos) e = text.size();
    std::string line = text.substr(pos, e - pos);
    pos = e + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t first = line.find_first_not_of(" \t");
    if (first == std::string::npos || line[first] == '#') continue;
    std::vector<std::string> fields;
    size_t i = first;
    while (i < line.size()) {
      size_t j = line.find_first_of(" \t", i);
      if (j == std::string::npos) j = line.size();
      if (j > i) fields.push_back(line.substr(i, j - i));
      i = line.find_first_not_of(" \t", j);
      if (i == std::string::npos) break;
    }
    RemoteFile f;
    f.url = fields[0];
    if (f.url.find("://") == std::string::npos)
      return absl::InvalidArgumentError(fmt::format("{}:{}: not a URL: {}", path, line_no, f.url));
    std::string p = f.url.substr(0, f.url.find_first_of("?#"));
    f.path = UrlUnquote(p.substr(p.rfind('/') + 1));
    for (size_t k = 1; k < fields.size(); ++k) {
      const std::string& kv = fields[k];
      if (kv.rfind("sha256=", 0) == 0) {
        // Compared with the lower-case digest computed: PowerShell's Get-FileHash and certutil print upper case.
        f.sha256 = absl::AsciiStrToLower(kv.substr(7));
      } else if (kv.rfind("size=", 0) == 0) {
        auto size = ParseUint64(kv.substr(5));
        if (!size)
          return absl::InvalidArgumentError(
              fmt::format("{}:{}: size= must be a byte count (decimal digits), not {:?}", path, line_no, kv.substr(5)));
        f.size = *size;
        f.size_known = true;
      } else if (kv.rfind("path=", 0) == 0) {
        f.path = kv.substr(5);
      } else {
        return absl::InvalidArgumentError(
            fmt::format("{}:{}: unknown field {:?} (sha256=, size=, path=)", path, line_no, kv));
      }
    }
    if (!f.sha256.empty() && !IsHex(f.sha256, 64))
      return absl::InvalidArgumentError(fmt::format("{}:{}: sha256 must be 64 hex digits", path, line_no));
    if (f.path.empty())
      return absl::InvalidArgumentError(fmt::format("{}:{}: cannot name the file; add path=NAME", path, line_no));
    out.push_back(std::move(f));
  }
  // As --include selecting no file of a repo: an empty list is a mistake (a list generated from
  // nothing), not a download with nothing to do (a shard with no file of the list still is one).
  if (out.empty())
    return absl::NotFoundError(fmt::format("{}: no URL in it ({} lines, blank or # comments)", path, line_no));
  return out;
}

// ---------------------------------------------------------------- done logs

std::string DoneLogKey(const RemoteFile& f) {
  return fmt::format("{}\t{}\t{}", f.local_path, f.size, f.sha256.empty() ? f.git_sha1 : f.sha256);
}

std::set<std::string> ReadDoneLogs(const std::string& dir) {
  std::set<std::string> done;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return done;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind("done-", 0) != 0 || name.size() < 9 || name.substr(name.size() - 4) != ".tsv") continue;
    auto text = ReadFileToString(JoinPath(dir, name));
    if (!text.ok()) continue;
    size_t pos = 0;
    while (pos < text->size()) {
      size_t nl = text->find('\n', pos);
      if (nl == std::string::npos) break;  // a torn last line is ignored
      done.insert(text->substr(pos, nl - pos));
      pos = nl + 1;
    }
  }
  ::closedir(d);
  return done;
}

}  // namespace ptk::download_detail
