// ptk checkpoint <-> Hugging Face GPT-2 directory: the tensor mapping, config.json, the checks.
#include "interop/hf_gpt2.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <utility>

#include <fcntl.h>
#include <fmt/core.h>
#include <simdjson.h>
#include <unistd.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/json_keys.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/py_format.h"
#include "common/status.h"
#include "interop/megatron.h"
#include "interop/safetensors.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "trainer/checkpoint.h"
#include "trainer/model_limits.h"

namespace ptk {
namespace {

// config.json's limits: a dimension as ptk-train's flags take it; the reals as GPTConfig::Validate.
constexpr int64_t kMaxDimension = (int64_t{1} << 31) - 1;
constexpr double kMaxLayerNormEpsilon = kGptConfigMaxLayerNormEpsilon;
constexpr double kMaxInitMethodStd = kGptConfigMaxInitMethodStd;

// HF's names, as GPT2LMHeadModel.save_pretrained writes them.
constexpr char kPrefix[] = "transformer.";
constexpr char kLmHead[] = "lm_head.weight";

std::string Shape(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// ---- the ptk checkpoint's header: magic "PTKCKPT1", u64 length, JSON (trainer/README.md). Only the
// model description and the run's settings are read here; LoadCheckpoint then checks the file whole.
struct CheckpointHeader {
  GPTConfig config;
  std::map<std::string, std::string> settings;
};

absl::StatusOr<CheckpointHeader> ReadPtkCheckpointHeader(const std::string& file) {
  {
    PTK_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(file));  // a FIFO refused, not waited on
    ::close(fd);
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(file + ": cannot open");
  char head[16];
  auto bad = [&](const std::string& why) { return absl::DataLossError(fmt::format("{}: {}", file, why)); };
  if (!in.read(head, 16) || std::memcmp(head, "PTKCKPT1", 8) != 0) return bad("not a ptk checkpoint (bad magic)");
  uint64_t len = 0;
  std::memcpy(&len, head + 8, 8);
  PTK_ASSIGN_OR_RETURN(uint64_t size, FileSize(file));
  if (len > size - 16) return bad("the header length runs past the end of the file");
  std::string json(len, '\0');
  if (!in.read(json.data(), static_cast<std::streamsize>(len))) return bad("cannot read the header");
  simdjson::dom::parser parser;
  simdjson::dom::element h, m;
  if (parser.parse(json).get(h) || h["model"].get(m)) return bad("the header has no model description");
  if (auto dup = FirstDuplicateJsonKey(h)) return bad(fmt::format("the header gives the key {} twice", *dup));
  CheckpointHeader out;
  GPTConfig& c = out.config;
  bool untie = false;
  if (m["num_layers"].get(c.num_layers) || m["hidden_size"].get(c.hidden_size) ||
      m["num_attention_heads"].get(c.num_attention_heads) || m["ffn_hidden_size"].get(c.ffn_hidden_size) ||
      m["max_position_embeddings"].get(c.max_position_embeddings) || m["padded_vocab_size"].get(c.padded_vocab_size) ||
      m["untie_embeddings_and_output_weights"].get(untie))
    return bad("the header's model description misses a field");
  c.untie_embeddings_and_output_weights = untie;
  if (std::string_view norm; !m["normalization"].get(norm))  // written for the Llama line only
    return absl::UnimplementedError(fmt::format(
        "{}: a model of Megatron's Llama line (RMSNorm, RoPE, SwiGLU, grouped-query attention or bias-free layers: "
        "{}): ptk-convert exports GPT-3-style models only (GPT2LMHeadModel, Megatron); LlamaForCausalLM export is "
        "not implemented",
        file, simdjson::minify(m)));
  simdjson::dom::array settings;
  if (!h["settings"].get(settings))
    for (simdjson::dom::element pair : settings) {
      simdjson::dom::array kv;
      std::string_view k, v;
      if (!pair.get(kv) && kv.size() == 2 && !kv.at(0).get(k) && !kv.at(1).get(v))
        out.settings[std::string(k)] = std::string(v);
    }
  return out;
}

// A setting of the saved run as a number; `fallback` (and a note) when it was not recorded.
double SettingOr(const CheckpointHeader& h, const std::string& flag, double fallback, std::vector<std::string>* notes) {
  auto it = h.settings.find(flag);
  if (it != h.settings.end()) {
    char* end = nullptr;
    const double v = std::strtod(it->second.c_str(), &end);
    if (end != it->second.c_str() && *end == '\0') return v;
  }
  notes->push_back(
      fmt::format("the checkpoint does not record {}: {} (Megatron's default) assumed", flag, py::FloatRepr(fallback)));
  return fallback;
}

// ---- config.json as transformers writes it: keys sorted, two-space indent.
std::string PrettyConfig(std::vector<std::pair<std::string, std::string>> fields) {
  std::sort(fields.begin(), fields.end());
  std::string out = "{\n";
  for (size_t i = 0; i < fields.size(); ++i)
    out += fmt::format("  \"{}\": {}{}\n", fields[i].first, fields[i].second, i + 1 < fields.size() ? "," : "");
  return out + "}\n";
}
std::string Num(double v) { return py::FloatRepr(v); }
std::string Int(int64_t v) { return std::to_string(v); }
std::string Str(std::string_view s) { return "\"" + JsonEscape(s) + "\""; }
std::string Bool(bool b) { return b ? "true" : "false"; }

// One HF tensor: its name (without the "transformer." prefix for the body), shape and values.
struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Megatron's fused QKV rows ((head, {q, k, v}, head_dim), each a row of `c` inputs) -> HF's c_attn
// columns ({q, k, v}, head, head_dim) in Conv1D's (in, out) layout; `to_hf` false goes back.
void MapQkvWeight(const float* meg, float* hf, int64_t c, int64_t heads, int64_t hd, bool to_hf) {
  for (int64_t n = 0; n < heads; ++n)
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t d = 0; d < hd; ++d) {
        const int64_t row = (n * 3 + w) * hd + d, col = w * c + n * hd + d;
        for (int64_t i = 0; i < c; ++i) {
          if (to_hf) {
            hf[i * 3 * c + col] = meg[row * c + i];
          } else {
            hf[row * c + i] = meg[i * 3 * c + col];  // here `meg` is HF's, `hf` Megatron's
          }
        }
      }
}
void MapQkvBias(const float* meg, float* hf, int64_t c, int64_t heads, int64_t hd, bool to_hf) {
  for (int64_t n = 0; n < heads; ++n)
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t d = 0; d < hd; ++d) {
        const int64_t row = (n * 3 + w) * hd + d, col = w * c + n * hd + d;
        if (to_hf) {
          hf[col] = meg[row];
        } else {
          hf[row] = meg[col];
        }
      }
}
// (rows, cols) -> (cols, rows).
void Transpose(const float* in, float* out, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) out[k * rows + r] = in[r * cols + k];
}

// The HF tensors of a model, in GPT2LMHeadModel's order, with their shapes (data empty).
std::vector<HfTensor> HfTensorsOf(const GPTConfig& c) {
  const int64_t h = c.hidden_size, f = c.ffn_hidden_size;
  std::vector<HfTensor> t;
  t.push_back({"wte.weight", {c.vocab_size, h}, {}});
  t.push_back({"wpe.weight", {c.max_position_embeddings, h}, {}});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("h.{}.", l);
    t.push_back({p + "ln_1.weight", {h}, {}});
    t.push_back({p + "ln_1.bias", {h}, {}});
    t.push_back({p + "attn.c_attn.weight", {h, 3 * h}, {}});
    t.push_back({p + "attn.c_attn.bias", {3 * h}, {}});
    t.push_back({p + "attn.c_proj.weight", {h, h}, {}});
    t.push_back({p + "attn.c_proj.bias", {h}, {}});
    t.push_back({p + "ln_2.weight", {h}, {}});
    t.push_back({p + "ln_2.bias", {h}, {}});
    t.push_back({p + "mlp.c_fc.weight", {h, f}, {}});
    t.push_back({p + "mlp.c_fc.bias", {f}, {}});
    t.push_back({p + "mlp.c_proj.weight", {f, h}, {}});
    t.push_back({p + "mlp.c_proj.bias", {h}, {}});
  }
  t.push_back({"ln_f.weight", {h}, {}});
  t.push_back({"ln_f.bias", {h}, {}});
  if (c.untie_embeddings_and_output_weights) t.push_back({kLmHead, {c.vocab_size, h}, {}});
  return t;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Between ptk's flat parameters (layout order) and HF's tensors, one direction or the other:
// to_hf fills hf[i].data from params; else fills params from hf[i].data (padded vocabulary rows
// copied from the last real row, as Megatron's saver pads).
void MapParams(const ParamLayout& layout, std::vector<float>* params, std::vector<HfTensor>* hf, bool to_hf) {
  const GPTConfig& c = layout.config;
  const int64_t h = c.hidden_size, f = c.ffn_hidden_size, heads = c.num_attention_heads, hd = c.head_dim();
  float* P = params->data();
  std::map<std::string, HfTensor*> by_name;
  for (HfTensor& t : *hf) {
    if (to_hf) t.data.assign(static_cast<size_t>(Elements(t.shape)), 0.0f);
    by_name[t.name] = &t;
  }
  auto copy = [&](const std::string& name, int64_t offset) {
    HfTensor* t = by_name.at(name);
    if (to_hf) {
      std::copy(P + offset, P + offset + static_cast<int64_t>(t->data.size()), t->data.begin());
    } else {
      std::copy(t->data.begin(), t->data.end(), P + offset);
    }
  };
  auto transposed = [&](const std::string& name, int64_t offset, int64_t meg_rows, int64_t meg_cols) {
    HfTensor* t = by_name.at(name);
    if (to_hf) {
      Transpose(P + offset, t->data.data(), meg_rows, meg_cols);
    } else {
      Transpose(t->data.data(), P + offset, meg_cols, meg_rows);
    }
  };
  auto vocab = [&](const std::string& name, int64_t offset) {
    copy(name, offset);  // the first vocab_size rows
    if (!to_hf)
      for (int64_t r = c.vocab_size; r < c.padded_vocab_size; ++r)
        std::copy(P + offset + (c.vocab_size - 1) * h, P + offset + c.vocab_size * h, P + offset + r * h);
  };
  vocab("wte.weight", layout.wte);
  copy("wpe.weight", layout.wpe);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& lp = layout.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("h.{}.", l);
    copy(p + "ln_1.weight", lp.ln1_w);
    copy(p + "ln_1.bias", lp.ln1_b);
    HfTensor* qkv_w = by_name.at(p + "attn.c_attn.weight");
    HfTensor* qkv_b = by_name.at(p + "attn.c_attn.bias");
    if (to_hf) {
      MapQkvWeight(P + lp.qkv_w, qkv_w->data.data(), h, heads, hd, true);
      MapQkvBias(P + lp.qkv_b, qkv_b->data.data(), h, heads, hd, true);
    } else {
      MapQkvWeight(qkv_w->data.data(), P + lp.qkv_w, h, heads, hd, false);
      MapQkvBias(qkv_b->data.data(), P + lp.qkv_b, h, heads, hd, false);
    }
    transposed(p + "attn.c_proj.weight", lp.proj_w, h, h);
    copy(p + "attn.c_proj.bias", lp.proj_b);
    copy(p + "ln_2.weight", lp.ln2_w);
    copy(p + "ln_2.bias", lp.ln2_b);
    transposed(p + "mlp.c_fc.weight", lp.fc1_w, f, h);
    copy(p + "mlp.c_fc.bias", lp.fc1_b);
    transposed(p + "mlp.c_proj.weight", lp.fc2_w, h, f);
    copy(p + "mlp.c_proj.bias", lp.fc2_b);
  }
  copy("ln_f.weight", layout.lnf_w);
  copy("ln_f.bias", layout.lnf_b);
  if (c.untie_embeddings_and_output_weights) vocab(kLmHead, layout.out_w);
}

absl::StatusOr<std::string> ReadOrDefault(const std::string& path, std::string_view fallback) {
  if (path.empty()) return std::string(fallback);
  return ReadFileToString(path);
}

// ---- Publishing an export whole. The new export is written into TARGET.ptk-tmp-PID beside the
// target and swapped in: rename(2) when there is no target, else renameat2(RENAME_EXCHANGE) (one
// atomic step: readers see the old directory or the new one), or where the filesystem cannot
// exchange (EINVAL: NFS, some FUSE), two renames: the target aside as TARGET.ptk-old-PID, the new
// one in. The copy left beside is removed last. RecoverExport, run by the next export under the
// lock, renames an old copy back when a kill fell between the two renames and removes the rest.
constexpr char kExportNewTag[] = ".ptk-tmp-";
constexpr char kExportOldTag[] = ".ptk-old-";
// What an export writes: a directory holding these and nothing else is a ptk export.
constexpr const char* kExportFiles[] = {"config.json", "generation_config.json", "tokenizer_config.json", "vocab.json",
                                        "merges.txt",  "model.safetensors"};

ExportStepHook& ExportHook() {
  static ExportStepHook hook;
  return hook;
}
absl::Status ExportStep(std::string_view name) { return ExportHook() ? ExportHook()(name) : absl::OkStatus(); }

absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", path, ec.message()));
  return absl::OkStatus();
}

// --save-dir as one absolute directory name ("hf/", "./hf" and "hf" are one target).
absl::StatusOr<std::string> ExportTarget(const std::string& save_dir) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(save_dir, ec);
  if (ec || save_dir.empty()) return UsageError(fmt::format("--save-dir {:?}: not a usable directory name", save_dir));
  std::string dir = p.lexically_normal().string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir == "/") return UsageError("--save-dir /: an export needs a directory of its own");
  return dir;
}

// The copies of `target` that earlier exports left beside it: (old copies, new copies), sorted.
absl::StatusOr<std::pair<std::vector<std::string>, std::vector<std::string>>> ExportCopies(const std::string& target) {
  std::pair<std::vector<std::string>, std::vector<std::string>> out;
  const std::string base = Basename(target);
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(Dirname(target), ec)) {
    const std::string name = e.path().filename().string();
    std::error_code ec2;
    if (!e.is_directory(ec2)) continue;
    if (name.rfind(base + kExportOldTag, 0) == 0) out.first.push_back(e.path().string());
    if (name.rfind(base + kExportNewTag, 0) == 0) out.second.push_back(e.path().string());
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", Dirname(target), ec.message()));
  std::sort(out.first.begin(), out.first.end());
  std::sort(out.second.begin(), out.second.end());
  return out;
}

// What a killed or failed export left beside `target`: an old copy renamed back when the target is
// missing (a kill between the two renames), every other copy removed. Call under the target's lock.
absl::Status RecoverExport(const std::string& target) {
  PTK_ASSIGN_OR_RETURN(auto copies, ExportCopies(target));
  auto& [olds, news] = copies;
  if (!PathExists(target) && !olds.empty()) {
    PTK_RETURN_IF_ERROR(RenameFile(olds.front(), target));
    PTK_RETURN_IF_ERROR(FsyncDir(Dirname(target)));
    log::Info("{}: the export an interrupted ptk-convert had renamed aside ({}) is put back", target, olds.front());
    olds.erase(olds.begin());
  }
  for (const std::string& p : olds) PTK_RETURN_IF_ERROR(RemoveTree(p));
  for (const std::string& p : news) PTK_RETURN_IF_ERROR(RemoveTree(p));
  RemoveStaleTemporaries(target);
  return absl::OkStatus();
}

// The target may be missing, empty or an earlier export (exactly the files an export writes);
// anything else (another model's files beside ours) is replaced only with --force.
absl::Status CheckExportTarget(const std::string& target, bool force) {
  std::error_code ec;
  const auto st = std::filesystem::symlink_status(target, ec);
  if (ec || st.type() == std::filesystem::file_type::not_found) return absl::OkStatus();
  if (st.type() == std::filesystem::file_type::symlink)
    return UsageError(fmt::format(
        "--save-dir {}: is a symbolic link (an export replaces its directory whole): give the directory it names",
        target));
  if (st.type() != std::filesystem::file_type::directory)
    return UsageError(fmt::format("--save-dir {}: exists and is not a directory", target));
  std::vector<std::string> foreign;
  for (const auto& e : std::filesystem::directory_iterator(target, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code ec2;
    // An export's files, and the temporaries of one that an older ptk-convert, which replaced the
    // files one by one, left when killed.
    const bool ours =
        e.is_regular_file(ec2) && std::find_if(std::begin(kExportFiles), std::end(kExportFiles), [&](const char* f) {
                                    return name == f || name.rfind(std::string(f) + ".ptk-tmp", 0) == 0;
                                  }) != std::end(kExportFiles);
    if (!ours) foreign.push_back(name);
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", target, ec.message()));
  if (foreign.empty() || force) return absl::OkStatus();
  std::sort(foreign.begin(), foreign.end());
  std::string shown;
  for (size_t i = 0; i < foreign.size() && i < 5; ++i) shown += (i ? ", " : "") + foreign[i];
  if (foreign.size() > 5) shown += fmt::format(" and {} more", foreign.size() - 5);
  return UsageError(fmt::format(
      "--save-dir {}: holds {} that a ptk export does not write ({}): give a new or empty directory, or --force "
      "to replace the directory whole (everything in it is removed)",
      target, foreign.size() == 1 ? "an entry" : fmt::format("{} entries", foreign.size()), shown));
}

// The export replaces `target` whole (with --force, whatever it holds): never a directory that
// holds what the export reads, or the current directory.
absl::Status CheckNotInside(const std::string& target, const char* what, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::error_code ec;
  const std::string t = std::filesystem::weakly_canonical(target, ec).string();
  if (ec) return absl::OkStatus();
  const std::string p = std::filesystem::weakly_canonical(path, ec).string();
  if (ec || (p != t && p.rfind(t + "/", 0) != 0)) return absl::OkStatus();
  return UsageError(fmt::format(
      "--save-dir {}: holds {} ({}), and an export replaces its directory whole: give a directory of its own", target,
      what, path));
}

// Swaps the complete, synced export `tmp` in as `target` (see above); `old` names the aside copy of
// the two-rename path.
absl::Status PublishExport(const std::string& tmp, const std::string& target, const std::string& old) {
  const std::string parent = Dirname(target);
  std::string leftover;  // the old export, once out of the target's place
  if (!PathExists(target)) {
    PTK_RETURN_IF_ERROR(ExportStep("rename new export in"));
    PTK_RETURN_IF_ERROR(RenameFile(tmp, target));
  } else {
    absl::Status exchange = ExportStep("exchange directories");
    int err = 0;
    if (exchange.ok()) {
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
        leftover = tmp;
      } else {
        err = errno;
      }
    } else if (absl::IsUnimplemented(exchange)) {
      err = EINVAL;  // a test's hook: as on a filesystem that cannot exchange
    } else {
      return exchange;
    }
    if (leftover.empty()) {
      if (err != EINVAL && err != ENOSYS && err != ENOTSUP)
        return ErrnoToStatus(err, fmt::format("exchange {} and {}", tmp, target));
      PTK_RETURN_IF_ERROR(ExportStep("rename old export aside"));
      PTK_RETURN_IF_ERROR(RenameFile(target, old));
      PTK_RETURN_IF_ERROR(ExportStep("rename new export in"));
      PTK_RETURN_IF_ERROR(RenameFile(tmp, target));
      leftover = old;
    }
  }
  PTK_RETURN_IF_ERROR(ExportStep("fsync parent directory"));
  PTK_RETURN_IF_ERROR(FsyncDir(parent));
  if (leftover.empty()) return absl::OkStatus();
  PTK_RETURN_IF_ERROR(ExportStep("remove old export"));
  return RemoveTree(leftover);
}

// An import writes iteration 0 and points the tracker at it: into the --save of a training run it
// would move `latest` back and make the next ptk-train --load restart from the imported weights.
// So the directory must hold no checkpoint but iteration 0 (a new directory, or an earlier import,
// which a rerun replaces).
absl::Status CheckImportTarget(const std::string& save) {
  std::vector<std::string> iterations;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("iter_", 0) == 0 && name != Basename(CheckpointDir(save, 0))) iterations.push_back(name);
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", save, ec.message()));
  std::sort(iterations.begin(), iterations.end());
  absl::StatusOr<int64_t> latest = LatestCheckpointIteration(save);
  std::string held;
  if (latest.ok() && *latest != 0) {
    held = fmt::format("its latest checkpoint is iteration {}", *latest);
  } else if (!latest.ok() && !absl::IsNotFound(latest.status())) {
    held = std::string(StatusMessage(latest.status()));
  } else if (!iterations.empty()) {
    held = fmt::format("it holds {}{}", iterations.back(),
                       iterations.size() > 1 ? fmt::format(" and {} more", iterations.size() - 1) : "");
  }
  if (held.empty()) return absl::OkStatus();
  return UsageError(fmt::format(
      "--save-dir {}: holds a training run's checkpoints ({}); an import (iteration 0) would move "
      "latest_checkpointed_iteration.txt back. Import into a new directory, then ptk-train --load NEW --finetune "
      "--save {} to continue from the imported weights",
      save, held, save));
}

}  // namespace

void SetExportStepHookForTesting(ExportStepHook hook) { ExportHook() = std::move(hook); }

absl::StatusOr<PtkCheckpoint> LoadPtkCheckpoint(const std::string& load_dir, int64_t true_vocab_size) {
  PtkCheckpoint out;
  PTK_ASSIGN_OR_RETURN(out.iteration, LatestCheckpointIteration(load_dir));
  out.file = CheckpointFile(load_dir, out.iteration);
  PTK_ASSIGN_OR_RETURN(CheckpointHeader header, ReadPtkCheckpointHeader(out.file));
  GPTConfig& c = header.config;
  // What the model description leaves to the run's settings.
  if (true_vocab_size > 0) {
    c.vocab_size = true_vocab_size;
  } else if (auto it = header.settings.find("--vocab-size"); it != header.settings.end()) {
    c.vocab_size = std::atoll(it->second.c_str());
  } else {
    return UsageError(fmt::format(
        "{} does not record the tokenizer's vocabulary size (its padded size is {}): give --true-vocab-size", out.file,
        c.padded_vocab_size));
  }
  if (c.vocab_size < 1 || c.vocab_size > c.padded_vocab_size)
    return UsageError(fmt::format("a vocabulary of {} does not fit the checkpoint's padded vocabulary of {}",
                                  c.vocab_size, c.padded_vocab_size));
  auto seq = header.settings.find("--seq-length");
  c.seq_length = seq != header.settings.end() ? std::atoll(seq->second.c_str()) : c.max_position_embeddings;
  c.seq_length = std::clamp<int64_t>(c.seq_length, 1, c.max_position_embeddings);
  c.layernorm_epsilon = SettingOr(header, "--layernorm-epsilon", 1e-5, &out.notes);
  c.hidden_dropout = SettingOr(header, "--hidden-dropout", 0.1, &out.notes);
  c.attention_dropout = SettingOr(header, "--attention-dropout", 0.1, &out.notes);
  c.init_method_std = SettingOr(header, "--init-method-std", 0.02, &out.notes);
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  std::vector<float> m, v;
  TrainState state;
  PTK_RETURN_IF_ERROR(LoadCheckpoint(load_dir, out.iteration, layout, &out.params, &m, &v, &state));
  out.config = c;
  return out;
}

absl::StatusOr<ConvertSummary> ExportToHf(const ConvertOptions& o) {
  ConvertSummary s;
  PTK_ASSIGN_OR_RETURN(PtkCheckpoint ck, LoadPtkCheckpoint(o.load_dir, o.true_vocab_size));
  s.iteration = ck.iteration;
  s.source = ck.file;
  s.notes = ck.notes;
  const GPTConfig& c = ck.config;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  std::vector<float>& params = ck.params;

  PTK_ASSIGN_OR_RETURN(auto tokenizer, Gpt2Tokenizer::LoadOrDefault(o.vocab_file, o.merge_file));
  if (tokenizer->vocab_size() != c.vocab_size)
    return UsageError(fmt::format(
        "the model's vocabulary has {} entries, the tokenizer's {} ({}): give --vocab-file and --merge-file "
        "of the tokenizer the model was trained with",
        c.vocab_size, tokenizer->vocab_size(), o.vocab_file.empty() ? "ptk's built-in GPT-2 files" : o.vocab_file));
  PTK_ASSIGN_OR_RETURN(std::string vocab_json, ReadOrDefault(o.vocab_file, Gpt2Tokenizer::DefaultVocabJson()));
  PTK_ASSIGN_OR_RETURN(std::string merges_txt, ReadOrDefault(o.merge_file, Gpt2Tokenizer::DefaultMergesTxt()));
  const int64_t eod = tokenizer->eod();

  std::vector<HfTensor> tensors = HfTensorsOf(c);
  MapParams(layout, &params, &tensors, /*to_hf=*/true);
  // Weights that no reader can use are refused here, as the import refuses them.
  for (const HfTensor& t : tensors)
    for (size_t i = 0; i < t.data.size(); ++i)
      if (!std::isfinite(t.data[i]))
        return absl::DataLossError(fmt::format(
            "{}: tensor {} (element {}) holds {}: a model with non-finite weights is not exported", ck.file,
            t.name == kLmHead ? t.name : kPrefix + t.name, i, std::isnan(t.data[i]) ? "a NaN" : "an infinity"));
  std::vector<SafetensorsEntry> entries;
  for (const HfTensor& t : tensors) entries.push_back({t.name == kLmHead ? t.name : kPrefix + t.name, t.shape, t.data});

  const std::string config = PrettyConfig({
      {"activation_function", Str("gelu_new")},
      {"architectures", "[\n    \"GPT2LMHeadModel\"\n  ]"},
      {"attn_pdrop", Num(c.attention_dropout)},
      {"bos_token_id", Int(eod)},
      {"embd_pdrop", Num(c.hidden_dropout)},
      {"eos_token_id", Int(eod)},
      {"initializer_range", Num(c.init_method_std)},
      {"layer_norm_epsilon", Num(c.layernorm_epsilon)},
      {"model_type", Str("gpt2")},
      {"n_embd", Int(c.hidden_size)},
      {"n_head", Int(c.num_attention_heads)},
      {"n_inner", Int(c.ffn_hidden_size)},
      {"n_layer", Int(c.num_layers)},
      {"n_positions", Int(c.max_position_embeddings)},
      {"reorder_and_upcast_attn", Bool(false)},
      {"resid_pdrop", Num(c.hidden_dropout)},
      {"scale_attn_by_inverse_layer_idx", Bool(false)},
      {"scale_attn_weights", Bool(true)},
      {"tie_word_embeddings", Bool(!c.untie_embeddings_and_output_weights)},
      {"torch_dtype", Str("float32")},
      {"use_cache", Bool(true)},
      {"vocab_size", Int(c.vocab_size)},
  });
  const std::string generation = PrettyConfig({{"bos_token_id", Int(eod)}, {"eos_token_id", Int(eod)}});
  const std::string eot(Gpt2Tokenizer::kEndOfText);
  const std::string tokenizer_config = PrettyConfig({
      {"add_prefix_space", Bool(false)},
      {"bos_token", Str(eot)},
      {"clean_up_tokenization_spaces", Bool(false)},  // decode gives the text's bytes, as ptk's Decode
      {"eos_token", Str(eot)},
      {"model_max_length", Int(c.max_position_embeddings)},
      {"tokenizer_class", Str("GPT2Tokenizer")},
      {"unk_token", Str(eot)},
  });

  // One export into a directory at a time (a lock file beside it), published whole: every file written
  // into a new directory beside the target, which then takes the target's place (PublishExport).
  PTK_ASSIGN_OR_RETURN(const std::string dir, ExportTarget(o.save_dir));
  PTK_RETURN_IF_ERROR(MakeDirs(Dirname(dir)));
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(dir));
  PTK_RETURN_IF_ERROR(RecoverExport(dir));
  PTK_RETURN_IF_ERROR(CheckExportTarget(dir, o.force));
  for (const auto& [what, path] : {std::pair<const char*, std::string>{"--load-dir", o.load_dir},
                                   {"--vocab-file", o.vocab_file},
                                   {"--merge-file", o.merge_file},
                                   {"the current directory", "."}})
    PTK_RETURN_IF_ERROR(CheckNotInside(dir, what, path));
  const std::string tmp = fmt::format("{}{}{}", dir, kExportNewTag, ::getpid());
  const std::string old = fmt::format("{}{}{}", dir, kExportOldTag, ::getpid());
  const std::vector<std::pair<std::string, const std::string*>> small = {{"config.json", &config},
                                                                         {"generation_config.json", &generation},
                                                                         {"tokenizer_config.json", &tokenizer_config},
                                                                         {"vocab.json", &vocab_json},
                                                                         {"merges.txt", &merges_txt}};
  absl::Status written = [&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(MakeDirs(tmp));
    PTK_RETURN_IF_ERROR(ExportStep("write model.safetensors"));
    PTK_RETURN_IF_ERROR(WriteSafetensors(JoinPath(tmp, "model.safetensors"), entries, {{"format", "pt"}}));
    for (const auto& [name, text] : small) {
      PTK_RETURN_IF_ERROR(ExportStep("write " + name));
      PTK_RETURN_IF_ERROR(WriteFileAtomic(JoinPath(tmp, name), *text));
    }
    PTK_RETURN_IF_ERROR(ExportStep("fsync new export"));
    PTK_RETURN_IF_ERROR(FsyncDir(tmp));
    return PublishExport(tmp, dir, old);
  }();
  if (!written.ok()) {
    // Whatever failed (a full disk): the target as it was, nothing of this export left beside it.
    absl::Status undo = RecoverExport(dir);
    if (!undo.ok()) log::Warning("after a failed export: {}", StatusMessage(undo));
    return written;
  }
  s.destination = dir;
  s.config = c;
  for (const HfTensor& t : tensors) s.num_params += static_cast<int64_t>(t.data.size());
  if (c.padded_vocab_size > c.vocab_size)
    s.notes.push_back(fmt::format(
        "the {} padded vocabulary rows (ids {} to {}, no token of the tokenizer) are dropped: HF's logits are the "
        "first {} of ptk's",
        c.padded_vocab_size - c.vocab_size, c.vocab_size, c.padded_vocab_size - 1, c.vocab_size));
  return s;
}

absl::StatusOr<ConvertSummary> ImportFromHf(const ConvertOptions& o) {
  ConvertSummary s;
  const std::string config_path = JoinPath(o.load_dir, "config.json");
  const std::string weights_path = JoinPath(o.load_dir, "model.safetensors");
  s.source = weights_path;
  auto bad_config = [&](const std::string& why) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", config_path, why));
  };
  if (!PathExists(weights_path)) {
    if (PathExists(JoinPath(o.load_dir, "model.safetensors.index.json")))
      return absl::FailedPreconditionError(fmt::format(
          "{}: the weights are sharded (model.safetensors.index.json); ptk reads one model.safetensors", o.load_dir));
    if (PathExists(JoinPath(o.load_dir, "pytorch_model.bin")))
      return absl::FailedPreconditionError(fmt::format(
          "{}: the weights are a PyTorch pickle (pytorch_model.bin); ptk reads model.safetensors (save the model "
          "with safe_serialization=True)",
          o.load_dir));
    return absl::NotFoundError(weights_path + ": missing");
  }
  PTK_ASSIGN_OR_RETURN(std::string config_text, ReadFileToString(config_path));
  simdjson::dom::parser parser;
  simdjson::dom::object cfg_object;
  if (parser.parse(config_text).get(cfg_object)) return bad_config("not a JSON object");
  // As transformers reads it (Python's json.load): a key given twice takes its last value.
  // simdjson's lookup would find the first.
  std::map<std::string_view, simdjson::dom::element> cfg;
  for (auto field : cfg_object) cfg[field.key] = field.value;
  auto find = [&](const char* key, simdjson::dom::element* e) {
    auto it = cfg.find(key);
    if (it == cfg.end() || it->second.is_null()) return false;
    *e = it->second;
    return true;
  };
  // A dimension: a positive integer as ptk-train's flags take it (at most 2^31 - 1).
  auto get_int = [&](const char* key, int64_t* out, std::optional<int64_t> fallback) -> absl::Status {
    simdjson::dom::element e;
    if (!find(key, &e)) {
      if (fallback) {
        *out = *fallback;
        return absl::OkStatus();
      }
      return bad_config(fmt::format("{} is missing", key));
    }
    if (e.get(*out) || *out < 1 || *out > kMaxDimension)
      return bad_config(fmt::format("{} is not a positive integer of at most {}", key, kMaxDimension));
    return absl::OkStatus();
  };
  // A key that is absent (or null) takes HF's default; one of another type is an error naming it.
  auto get = [&](const char* key, auto fallback, auto* out, const char* what) -> absl::Status {
    simdjson::dom::element e;
    if (!find(key, &e)) {
      *out = fallback;
      return absl::OkStatus();
    }
    if (e.get(*out)) return bad_config(fmt::format("{} is not {}", key, what));
    return absl::OkStatus();
  };
  // A real number in [lo, hi] (hi excluded when hi_open), as the model can use it.
  auto get_real = [&](const char* key, double fallback, double* out, double lo, bool lo_open, double hi,
                      bool hi_open) -> absl::Status {
    PTK_RETURN_IF_ERROR(get(key, fallback, out, "a number"));
    if (!std::isfinite(*out) || (lo_open ? *out <= lo : *out < lo) || (hi_open ? *out >= hi : *out > hi))
      return bad_config(fmt::format("{} {} is outside {}{}, {}{}", key, Num(*out), lo_open ? "(" : "[", Num(lo),
                                    Num(hi), hi_open ? ")" : "]"));
    return absl::OkStatus();
  };
  std::string_view model_type, act;
  bool scale = true, by_layer = false, cross = false, tie = true;
  double embd_pdrop = 0;
  GPTConfig& c = s.config;
  PTK_RETURN_IF_ERROR(get("model_type", std::string_view(), &model_type, "a string"));
  if (model_type != "gpt2")
    return bad_config(fmt::format("model_type {:?}: ptk reads GPT-2 models (model_type \"gpt2\")", model_type));
  PTK_RETURN_IF_ERROR(get("activation_function", std::string_view("gelu_new"), &act, "a string"));
  if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu_fast")
    return bad_config(fmt::format(
        "activation_function {:?}: ptk computes the tanh GELU (gelu_new, gelu_pytorch_tanh, gelu_fast)", act));
  PTK_RETURN_IF_ERROR(get("scale_attn_weights", true, &scale, "true or false"));
  PTK_RETURN_IF_ERROR(get("scale_attn_by_inverse_layer_idx", false, &by_layer, "true or false"));
  PTK_RETURN_IF_ERROR(get("add_cross_attention", false, &cross, "true or false"));
  if (!scale || by_layer || cross)
    return bad_config(
        "ptk's attention is scaled by 1/sqrt(head_dim) only, without cross-attention (scale_attn_weights true, "
        "scale_attn_by_inverse_layer_idx false, add_cross_attention false)");
  PTK_RETURN_IF_ERROR(get_int("n_layer", &c.num_layers, std::nullopt));
  PTK_RETURN_IF_ERROR(get_int("n_embd", &c.hidden_size, std::nullopt));
  PTK_RETURN_IF_ERROR(get_int("n_head", &c.num_attention_heads, std::nullopt));
  PTK_RETURN_IF_ERROR(get_int("n_inner", &c.ffn_hidden_size, 4 * c.hidden_size));
  PTK_RETURN_IF_ERROR(get_int("n_positions", &c.max_position_embeddings, std::nullopt));
  PTK_RETURN_IF_ERROR(get_int("vocab_size", &c.vocab_size, std::nullopt));
  c.seq_length = c.max_position_embeddings;
  c.padded_vocab_size = PaddedVocabSize(c.vocab_size, o.make_vocab_size_divisible_by);
  PTK_RETURN_IF_ERROR(get("tie_word_embeddings", true, &tie, "true or false"));
  c.untie_embeddings_and_output_weights = !tie;
  // Numbers: simdjson reads integers as doubles too (a dropout of 0). Each in the range the model
  // can use (GPTConfig::Validate, as ptk-train's flags).
  PTK_RETURN_IF_ERROR(get_real("layer_norm_epsilon", 1e-5, &c.layernorm_epsilon, 0, true, kMaxLayerNormEpsilon, false));
  PTK_RETURN_IF_ERROR(get_real("resid_pdrop", 0.1, &c.hidden_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(get_real("attn_pdrop", 0.1, &c.attention_dropout, 0, false, 1, true));
  PTK_RETURN_IF_ERROR(get_real("initializer_range", 0.02, &c.init_method_std, 0, true, kMaxInitMethodStd, false));
  PTK_RETURN_IF_ERROR(get_real("embd_pdrop", c.hidden_dropout, &embd_pdrop, 0, false, 1, true));
  // The parameters the dimensions imply, counted without overflow: at most what ptk can index.
  const double h = static_cast<double>(c.hidden_size),
               implied =
                   static_cast<double>(c.num_layers) * (4 * h * h + 2 * h * static_cast<double>(c.ffn_hidden_size)) +
                   h * static_cast<double>(c.vocab_size + c.max_position_embeddings);
  if (implied > 0x1p40)
    return bad_config(
        fmt::format("n_layer {}, n_embd {}, n_inner {}, vocab_size {} and n_positions {} make {:.3g} "
                    "parameters: more than ptk can hold",
                    c.num_layers, c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.max_position_embeddings, implied));
  if (absl::Status st = c.Validate(); !st.ok()) return bad_config(std::string(StatusMessage(st)));
  if (embd_pdrop != c.hidden_dropout)
    s.notes.push_back(fmt::format("embd_pdrop {} differs from resid_pdrop {}: ptk's --hidden-dropout applies to both",
                                  Num(embd_pdrop), Num(c.hidden_dropout)));
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));

  // The weights: every tensor config.json implies, with its shape, and nothing else.
  PTK_ASSIGN_OR_RETURN(auto st_file, SafetensorsFile::Open(weights_path));
  std::vector<HfTensor> tensors = HfTensorsOf(c);
  std::map<std::string, const SafetensorsTensor*> present;
  for (const SafetensorsTensor& t : st_file->tensors()) {
    std::string name = t.name;
    if (name.rfind(kPrefix, 0) == 0) name = name.substr(sizeof kPrefix - 1);
    // The causal-mask buffers older GPT-2 files carry: not weights.
    static const std::regex kMask(R"(h\.\d+\.attn\.(masked_)?bias)");
    if (std::regex_match(name, kMask)) continue;
    if (!present.emplace(name, &t).second)
      return absl::DataLossError(
          fmt::format("{}: tensor {} is there with and without the {} prefix", weights_path, t.name, kPrefix));
  }
  auto refuse = [&](const std::string& tensor, const std::string& why) {
    return absl::DataLossError(fmt::format("{}: tensor {}: {}", weights_path, tensor, why));
  };
  for (HfTensor& t : tensors) {
    const std::string shown = t.name == kLmHead ? t.name : kPrefix + t.name;
    auto it = present.find(t.name);
    if (it == present.end())
      return refuse(shown, fmt::format("missing (config.json asks for shape {})", Shape(t.shape)));
    if (it->second->shape != t.shape)
      return refuse(shown, fmt::format("shape {}, config.json asks for {}", Shape(it->second->shape), Shape(t.shape)));
    PTK_ASSIGN_OR_RETURN(t.data, st_file->ReadFloat(*it->second));
    for (float x : t.data)
      if (!std::isfinite(x)) return refuse(shown, "holds a NaN or an infinity");
    present.erase(it);
  }
  if (!c.untie_embeddings_and_output_weights && present.count(kLmHead)) {
    // A tied model's file may carry the output layer too: it must be the embedding.
    const SafetensorsTensor* head = present.at(kLmHead);
    PTK_ASSIGN_OR_RETURN(std::vector<float> lm, st_file->ReadFloat(*head));
    if (head->shape != tensors[0].shape || lm != tensors[0].data)
      return refuse(kLmHead, "differs from transformer.wte.weight, but config.json ties them (tie_word_embeddings)");
    present.erase(kLmHead);
  }
  if (!present.empty())
    return refuse(present.begin()->second->name,
                  fmt::format("not a weight of the GPT-2 model config.json describes ({} such tensor{})",
                              present.size(), present.size() > 1 ? "s" : ""));

  std::vector<float> params(static_cast<size_t>(layout.num_params), 0.0f);
  MapParams(layout, &params, &tensors, /*to_hf=*/false);
  const std::vector<float> zeros(params.size(), 0.0f);
  TrainState state;
  state.seed = 1234;
  auto num = [](double v) { return fmt::format("{}", v); };  // as ptk-train records its settings
  state.settings = {
      {"--num-layers", Int(c.num_layers)},
      {"--hidden-size", Int(c.hidden_size)},
      {"--num-attention-heads", Int(c.num_attention_heads)},
      {"--ffn-hidden-size", Int(c.ffn_hidden_size)},
      {"--max-position-embeddings", Int(c.max_position_embeddings)},
      {"--vocab-size", Int(c.vocab_size)},
      {"--make-vocab-size-divisible-by (padded vocabulary)", Int(c.padded_vocab_size)},
      {"--untie-embeddings-and-output-weights", c.untie_embeddings_and_output_weights ? "on" : "off"},
      {"--layernorm-epsilon", num(c.layernorm_epsilon)},
      {"--hidden-dropout", num(c.hidden_dropout)},
      {"--attention-dropout", num(c.attention_dropout)},
      {"--init-method-std", num(c.init_method_std)},
  };
  // As a training run: one writer per --save directory, and what a killed save left put right.
  PTK_RETURN_IF_ERROR(MakeDirs(o.save_dir));
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(JoinPath(o.save_dir, "ptk-train")));
  PTK_RETURN_IF_ERROR(RecoverCheckpointDir(o.save_dir));
  PTK_RETURN_IF_ERROR(CheckImportTarget(o.save_dir));
  PTK_RETURN_IF_ERROR(SaveCheckpoint(o.save_dir, layout, params, zeros, zeros, state, o.args_json));
  s.destination = CheckpointFile(o.save_dir, 0);
  s.num_params = layout.num_params;
  s.train_flags = fmt::format(
      "--num-layers {} --hidden-size {} --num-attention-heads {} --ffn-hidden-size {} --max-position-embeddings {} "
      "--layernorm-epsilon {}{}{}",
      c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size, c.max_position_embeddings,
      num(c.layernorm_epsilon), c.untie_embeddings_and_output_weights ? " --untie-embeddings-and-output-weights" : "",
      c.vocab_size != 50257 ? fmt::format(" --vocab-size {}", c.vocab_size) : "");
  if (o.make_vocab_size_divisible_by != 128)
    s.train_flags += fmt::format(" --make-vocab-size-divisible-by {}", o.make_vocab_size_divisible_by);
  if (c.padded_vocab_size > c.vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary is padded from {} to {} rows with copies of the last row, as "
                    "Megatron's checkpoint converter pads",
                    c.vocab_size, c.padded_vocab_size));
  return s;
}

absl::StatusOr<ConvertSummary> RunConvert(const ConvertOptions& o) {
  if (o.loader == "ptk" && o.saver == "hf") return ExportToHf(o);
  if (o.loader == "hf" && o.saver == "ptk") return ImportFromHf(o);
  if (o.loader == "megatron" && o.saver == "ptk") return ImportFromMegatron(o);
  if (o.loader == "ptk" && o.saver == "megatron") return ExportToMegatron(o);
  return UsageError(
      fmt::format("--loader {} --saver {}: ptk-convert converts ptk to hf or megatron, and hf or megatron to ptk",
                  o.loader, o.saver));
}

}  // namespace ptk
