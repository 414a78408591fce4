// Test helper: runs tests/support/fake_hub.py (a fake Hugging Face Hub + CDN on 127.0.0.1).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <simdjson.h>

#include "dataprep/download/http.h"
#include "tests/test_util.h"

namespace ptk::testing {

class FakeHub {
 public:
  // args: extra fake_hub.py flags, e.g. {"--page-size", "2"}.
  FakeHub(const std::string& repo_dir, const std::vector<std::string>& args, const std::string& work_dir) {
    port_file_ = work_dir + "/hub-ports";
    ::unlink(port_file_.c_str());
    std::vector<std::string> argv = {"/usr/bin/python3", SourceDir() + "/tests/support/fake_hub.py",
                                     "--repo-dir",       repo_dir,
                                     "--port-file",      port_file_};
    argv.insert(argv.end(), args.begin(), args.end());
    pid_ = ::fork();
    if (pid_ == 0) {
      std::vector<char*> c;
      for (auto& a : argv) c.push_back(a.data());
      c.push_back(nullptr);
      int devnull = ::open("/dev/null", O_WRONLY);
      ::dup2(devnull, 1);
      ::execv(c[0], c.data());
      ::_exit(127);
    }
    // Up to 60 s: python starts late on a loaded machine.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!Exists(port_file_) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    std::string ports = ReadFile(port_file_);
    size_t h = ports.find("HUB "), c = ports.find("CDN ");
    if (h != std::string::npos) hub_ = ports.substr(h + 4, ports.find('\n', h) - h - 4);
    if (c != std::string::npos) cdn_ = ports.substr(c + 4, ports.find('\n', c) - c - 4);
  }
  ~FakeHub() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  bool ok() const { return !hub_.empty(); }
  const std::string& hub() const { return hub_; }
  const std::string& cdn() const { return cdn_; }

  std::string StatsJson() const {
    ptk::HttpClient http;
    ptk::HttpRequest req;
    req.url = hub_ + "/_stats";
    ptk::HttpResponse resp;
    (void)http.Get(req, &resp);
    return resp.body;
  }
  int64_t Stat(const char* key) const {
    simdjson::dom::parser p;
    simdjson::dom::element e = p.parse(StatsJson());
    return int64_t(e[key]);
  }
  // Range headers of the CDN GETs for one repo path, in order ("" = no Range).
  std::vector<std::string> CdnGets(const std::string& path) const {
    simdjson::dom::parser p;
    simdjson::dom::element e = p.parse(StatsJson());
    std::vector<std::string> out;
    simdjson::dom::array arr;
    if (e["cdn_gets"][path].get(arr)) return out;
    for (auto x : arr) out.emplace_back(std::string_view(x));
    return out;
  }
  // The fake CDN's requests for one repo path, in the order they came: when (the server's clock,
  // seconds), their Range ("" = none), the fault they got ("ok" = none) and how many requests for
  // that path were being answered when it came, itself included, and the client's port (its
  // connection).
  struct CdnRequest {
    double t = 0;
    std::string range, fault;
    int64_t in_flight = 0, port = 0;
  };
  std::vector<CdnRequest> CdnLog(const std::string& path) const {
    simdjson::dom::parser p;
    simdjson::dom::element e = p.parse(StatsJson());
    std::vector<CdnRequest> out;
    simdjson::dom::array arr;
    if (e["cdn_log"][path].get(arr)) return out;
    for (auto x : arr)
      out.push_back(CdnRequest{double(x["t"]), std::string(std::string_view(x["range"])),
                               std::string(std::string_view(x["fault"])), int64_t(x["in_flight"]), int64_t(x["port"])});
    return out;
  }
  int64_t Resolves(const std::string& path) const {
    simdjson::dom::parser p;
    simdjson::dom::element e = p.parse(StatsJson());
    int64_t n = 0;
    if (e["resolves"][path].get(n)) return 0;
    return n;
  }

 private:
  pid_t pid_ = -1;
  std::string port_file_, hub_, cdn_;
};

}  // namespace ptk::testing
