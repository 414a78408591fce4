// The CUDA backend is a module that ptk-train loads only when --device cuda asks for it: ptk-train
// needs no CUDA library (readelf), a CPU run maps none (the loader's own log, LD_DEBUG=files), and
// where the module or a library it needs is missing, --device cuda is one line naming it and a
// non-zero exit while --device cpu still trains. Where the build has the module and this machine
// has the CUDA libraries (CI: the toolkit is installed, there is no GPU), the module loads in
// ptk-train and its own code answers (no device visible): every symbol it takes from ptk-train
// resolves.
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tests/trainer/train_cli_support.h"
#include "trainer/backend.h"

namespace ptk {
namespace {

using testing::RunCmd;
using testing::ShellQuote;
using testing::TempDir;
namespace fs = std::filesystem;

// The module of this build ("" in a build without CUDA).
const std::string kModule = PTK_TEST_CUDA_MODULE;
// A CUDA library's name in the loader's words ("file=libcudart.so.13 [0]; needed by ...").
const std::regex kCudaFile(R"(file=(libcuda|libcudart|libcublas|libcudnn|libnccl|libptk_backend_cuda)[^ ]*)");

int NonEmptyLines(const std::string& s) {
  int n = 0;
  size_t start = 0;
  while (start < s.size()) {
    size_t end = s.find('\n', start);
    if (end == std::string::npos) end = s.size();
    if (end > start) ++n;
    start = end + 1;
  }
  return n;
}

class CudaBackendModule : public ::testing::Test {
 protected:
  void SetUp() override {
    prefix_ = dir_ / "data_text_document";
    ASSERT_NO_FATAL_FAILURE(testing::WriteLearnableDataset(prefix_, 200));
  }
  // ptk-train (the build's, or `program`) on the tiny model, with the loader's search path left to
  // the program's own RUNPATH and the system's (no LD_LIBRARY_PATH).
  std::string Train(const std::string& device, const std::string& program = testing::Tool("ptk-train"),
                    const std::string& env = "") {
    return "env -u LD_LIBRARY_PATH " + env + " " + ShellQuote(program) + " " + device +
           " --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2"
           " --global-batch-size 4 --lr 5e-3 --train-iters 3 --eval-iters 0 --log-interval 1 --threads 2"
           " --split 100,0,0 --data-path " +
           ShellQuote(prefix_) + " --data-cache-path " + ShellQuote(dir_ / "cache");
  }
  // A copy of ptk-train in TREE/bin/ (its RUNPATH then looks in TREE/lib/ptk/ for the module).
  std::string CopyProgram(const std::string& tree) {
    fs::create_directories(tree + "/bin");
    fs::create_directories(tree + "/lib/ptk");
    const std::string copy = tree + "/bin/ptk-train";
    fs::copy_file(testing::Tool("ptk-train"), copy, fs::copy_options::overwrite_existing);
    return copy;
  }
  TempDir dir_;
  std::string prefix_;
};

TEST_F(CudaBackendModule, PtkTrainNeedsNoCudaLibrary) {
  auto r = RunCmd("readelf -d " + ShellQuote(testing::Tool("ptk-train")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_NE(r.output.find("(NEEDED)"), std::string::npos) << r.output;
  EXPECT_FALSE(std::regex_search(r.output, std::regex(R"(\[lib(cuda|cudart|cublas|cublasLt|cudnn|nccl)\b)")))
      << r.output;
  // ptk-train finds its module in lib/ptk/ beside its bin/.
  EXPECT_NE(r.output.find("$ORIGIN/../lib/ptk"), std::string::npos) << r.output;
  if (kModule.empty()) GTEST_SKIP() << "this build has no CUDA backend";
  // The module is where that RUNPATH points, and it is what needs the CUDA libraries.
  EXPECT_TRUE(fs::exists(testing::BinDir() + "/../lib/ptk/libptk_backend_cuda.so"));
  auto m = RunCmd("readelf -d " + ShellQuote(kModule));
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_NE(m.output.find("[libcudart.so"), std::string::npos) << m.output;
  EXPECT_NE(m.output.find("[libnccl.so"), std::string::npos) << m.output;
}

TEST_F(CudaBackendModule, CpuRunLoadsNoCudaLibrary) {
  auto r = RunCmd(Train("--device cpu", testing::Tool("ptk-train"), "LD_DEBUG=files"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("iteration        3/"), std::string::npos) << r.output;
  std::smatch m;
  EXPECT_FALSE(std::regex_search(r.output, m, kCudaFile)) << "a CPU run loaded " << m.str();
  // Without --device, on a machine without an NVIDIA driver (CI): the CPU, and nothing of CUDA loaded.
  if (!NvidiaDriverPresent()) {
    auto d = RunCmd(Train("", testing::Tool("ptk-train"), "LD_DEBUG=files"));
    ASSERT_EQ(d.exit_code, 0) << d.output;
    EXPECT_FALSE(std::regex_search(d.output, m, kCudaFile)) << "a run without --device loaded " << m.str();
  }
  if (kModule.empty()) return;
  // The same check sees the module and its libraries when --device cuda loads them: the module's
  // own code then answers (here: no device; on a GPU machine the run trains).
  auto c = RunCmd(Train("--device cuda", testing::Tool("ptk-train"), "LD_DEBUG=files"));
  EXPECT_TRUE(std::regex_search(c.output, std::regex(R"(file=libptk_backend_cuda\.so )"))) << c.output;
  EXPECT_TRUE(std::regex_search(c.output, std::regex(R"(file=libcudart\.so)"))) << c.output;
}

TEST_F(CudaBackendModule, ModuleLoadsAndAnswers) {
  if (kModule.empty()) {
    auto r = RunCmd(Train("--device cuda"));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("built without CUDA"), std::string::npos) << r.output;
    return;
  }
  auto r = RunCmd(Train("--device cuda"));
  if (r.exit_code == 0) {  // a GPU machine
    EXPECT_NE(r.output.find("iteration        3/"), std::string::npos) << r.output;
    return;
  }
  EXPECT_EQ(r.exit_code, 1) << r.output;
  // An answer from inside the module (CudaGPTModel), not a loader error.
  EXPECT_NE(r.output.find("--device cuda: no CUDA device is visible"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("cannot be loaded"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("undefined symbol"), std::string::npos) << r.output;
}

TEST_F(CudaBackendModule, MissingModuleIsOneLineAndCpuStillTrains) {
  const std::string program = CopyProgram(dir_ / "tree");
  auto cpu = RunCmd(Train("--device cpu", program));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  EXPECT_NE(cpu.output.find("iteration        3/"), std::string::npos) << cpu.output;
  auto r = RunCmd(Train("--device cuda", program));
  EXPECT_EQ(NonEmptyLines(r.output), kModule.empty() ? 2 : 1) << r.output;  // a usage error adds "Run with --help"
  if (kModule.empty()) {
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("built without CUDA"), std::string::npos) << r.output;
    return;
  }
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("ptk-train: error: --device cuda: the CUDA backend cannot be loaded: "
                          "libptk_backend_cuda.so: cannot open shared object file"),
            std::string::npos)
      << r.output;
}

// The module present but a library it needs missing (a CPU node with a copy of a GPU install): its
// copy here names a runtime library that exists nowhere. The loader's line names it.
TEST_F(CudaBackendModule, MissingCudaLibraryIsOneLineAndCpuStillTrains) {
  if (kModule.empty()) GTEST_SKIP() << "this build has no CUDA backend";
  const std::string tree = dir_ / "tree";
  const std::string program = CopyProgram(tree);
  std::string bytes = testing::ReadFile(kModule);
  // Same length, so the ELF file stays whole: its NEEDED entry (and the symbol versions that name
  // the library) now ask for libcudarX.so.NN.
  size_t renamed = 0;
  for (size_t at = bytes.find("libcudart.so."); at != std::string::npos; at = bytes.find("libcudart.so.", at)) {
    bytes[at + 8] = 'X';
    ++renamed;
  }
  ASSERT_GT(renamed, 0u);
  testing::WriteFile(tree + "/lib/ptk/libptk_backend_cuda.so", bytes);
  auto r = RunCmd(Train("--device cuda", program));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(NonEmptyLines(r.output), 1) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output,
      std::regex(
          R"(^ptk-train: error: --device cuda: the CUDA backend cannot be loaded: libcudarX\.so\.[0-9]+: cannot open shared object file: No such file or directory\. .*--device cpu\n$)")))
      << r.output;
  auto cpu = RunCmd(Train("--device cpu", program, "LD_DEBUG=files"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  EXPECT_NE(cpu.output.find("iteration        3/"), std::string::npos) << cpu.output;
  std::smatch m;
  EXPECT_FALSE(std::regex_search(cpu.output, m, kCudaFile)) << "a CPU run loaded " << m.str();
}

}  // namespace
}  // namespace ptk
