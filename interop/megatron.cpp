// Megatron-LM `torch` checkpoint -> ptk checkpoint: the shards merged, the optimizer's state mapped.
#include "interop/megatron.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/progress.h"
#include "common/status.h"
#include "interop/megatron_common.h"
#include "interop/megatron_optim.h"
#include "interop/torch_format.h"
#include "trainer/checkpoint.h"

namespace ptk {
namespace {

using torchfmt::DType;
using torchfmt::PyRef;
using torchfmt::PyValue;

constexpr char kTracker[] = "latest_checkpointed_iteration.txt";
constexpr char kFile[] = "model_optim_rng.pt";

using namespace megatron;  // NOLINT: the shared helpers

// ---- megatron -> ptk ---------------------------------------------------------------------------

// One rank's file, with its parameters in Megatron's optimizer order.
struct RankFile {
  std::unique_ptr<torchfmt::TorchArchiveReader> reader;
  // The model's state dict: "model", or one per chunk of an interleaved run ("model0", "model1", ...).
  std::vector<const PyValue*> models;
  // Optimizer: the AdamW state (by index) and, in --bf16/--fp16 runs, the fp32 masters per group.
  const PyValue* adam_state = nullptr;
  const PyValue* fp32_groups = nullptr;
  std::map<std::string, int64_t> index;  // local name -> optimizer index
  std::map<std::string, std::pair<size_t, size_t>> group_pos;
  // The distributed optimizer's distrib_optim.pt beside it: fp32 params and moments.
  std::optional<DistribState> distrib;
  std::optional<int64_t> distrib_step;
};

// The iteration directory the tracker names (its number in s->iteration; "release" keeps 0).
absl::StatusOr<std::string> TrackedIterationDir(const std::string& load_dir, ConvertSummary* s) {
  const std::string tracker = JoinPath(load_dir, kTracker);
  if (!PathExists(tracker))
    return absl::NotFoundError(fmt::format("{}: missing: not a Megatron checkpoint directory", tracker));
  PTK_ASSIGN_OR_RETURN(std::string tracker_text, ReadFileToString(tracker));
  std::string it_text(tracker_text);
  it_text.erase(std::remove_if(it_text.begin(), it_text.end(), [](char ch) { return std::isspace(ch); }),
                it_text.end());
  std::string iter_dir;
  if (it_text == "release") {
    iter_dir = JoinPath(load_dir, "release");
    s->release = true;
  } else {
    if (it_text.empty() || it_text.size() > 18 || !std::all_of(it_text.begin(), it_text.end(), ::isdigit))
      return absl::DataLossError(fmt::format("{}: not an iteration number: {:?}", tracker, tracker_text));
    s->iteration = std::atoll(it_text.c_str());
    iter_dir = JoinPath(load_dir, fmt::format("iter_{:07d}", s->iteration));
  }
  if (!IsDirectory(iter_dir)) return absl::NotFoundError(fmt::format("{}: missing (the tracker names it)", iter_dir));
  return iter_dir;
}

// The shards present (mp_rank_TT or mp_rank_TT_PPP, each with model_optim_rng.pt), opened (each file's
// archive directory and pickle read; `progress`: counted, shards of the total): files[t][p].
struct Shards {
  int64_t tp = 0, pp = 0;
  std::vector<std::vector<RankFile>> files;
};
absl::StatusOr<Shards> OpenShards(const std::string& iter_dir, bool progress) {
  Shards sh;
  bool with_pp = false;
  std::error_code ec;
  static const std::regex kRank(R"(mp_rank_(\d\d)(_(\d\d\d))?)");
  for (const auto& e : std::filesystem::directory_iterator(iter_dir, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, kRank)) continue;
    sh.tp = std::max<int64_t>(sh.tp, std::atoll(m[1].str().c_str()) + 1);
    if (m[2].matched) {
      with_pp = true;
      sh.pp = std::max<int64_t>(sh.pp, std::atoll(m[3].str().c_str()) + 1);
    }
  }
  if (sh.tp == 0) return absl::NotFoundError(fmt::format("{}: no mp_rank_* directory", iter_dir));
  if (!with_pp) sh.pp = 1;
  sh.files.resize(static_cast<size_t>(sh.tp));
  ProgressReporter opened({.label = "convert",
                           .item_unit = "shards",
                           .items_total = static_cast<uint64_t>(sh.tp * sh.pp),
                           .enabled = progress});
  for (int64_t t = 0; t < sh.tp; ++t)
    for (int64_t p = 0; p < sh.pp; ++p) {
      const std::string f = JoinPath(JoinPath(iter_dir, RankDir(t, p, with_pp ? sh.pp : 1)), kFile);
      if (!PathExists(f))
        return absl::NotFoundError(fmt::format(
            "{}: missing: the checkpoint has {} tensor- x {} pipeline-parallel shards and this one is absent", f, sh.tp,
            sh.pp));
      RankFile rf;
      PTK_ASSIGN_OR_RETURN(rf.reader, torchfmt::TorchArchiveReader::Open(f));
      sh.files[static_cast<size_t>(t)].push_back(std::move(rf));
      opened.AddItems(1);
      opened.Refresh();  // on a terminal the line says each shard as it is opened
    }
  return sh;
}

absl::Status Bad(const std::string& file, const std::string& why) {
  return absl::DataLossError(fmt::format("{}: {}", file, why));
}

// What the import reads everything through: the shards, the model the args describe, its Megatron
// names and order.
struct Import {
  Import(const ConvertOptions& o_, ConvertSummary& s_, Shards& sh_) : o(o_), s(s_), sh(sh_) {}
  const ConvertOptions& o;
  ConvertSummary& s;
  Shards& sh;
  ProgressReporter* progress = nullptr;  // counts each parameter gathered
  const PyValue* args = nullptr;
  MegatronModel model;
  std::optional<ParamLayout> layout;
  std::vector<MegParam> params;
  std::vector<MegBuffer> mbuffers;  // the routers' expert biases (MegBuffers)
  ModelBuffers buffers;             // read by ReadBuffers
  int64_t vp = 1;                   // model chunks per rank (virtual pipeline stages): params' stage is v * pp + p
  bool te = false;                  // Transformer Engine's fused LayerNorm names, or the local ones
  bool tied_copy = false;           // the last stage's copy of the tied embedding
  // Gathered: weights (fp32 masters where the optimizer has them) and moments.
  std::vector<float> weights, m1, m2;
  bool have_moments = true, used_masters = false, used_distrib = false, low_precision = false;
  int64_t adam_step = 0;

  std::string LocalName(const MegParam& m) const { return te ? m.te_name : m.local_name; }
  // The chunk of a parameter on its rank, and its name in the rank's optimizer maps (chunk-qualified
  // when there are several: each chunk numbers its layers from 0).
  int64_t Chunk(const MegParam& m) const { return m.stage / sh.pp; }
  int64_t Rank(const MegParam& m) const { return m.stage % sh.pp; }
  std::string Key(int64_t v, const std::string& local) const {
    return vp > 1 ? fmt::format("model{}.{}", v, local) : local;
  }

  // One rank's optimizer groups mapped to its parameters (rf.index, rf.group_pos, rf.adam_state),
  // or the distributed optimizer's distrib_optim.pt beside it read (rf.distrib).
  absl::Status MapOptimizer(RankFile& rf, int64_t p, const std::vector<std::pair<std::string, bool>>& order) {
    const std::string& f = rf.reader->path();
    const PyValue* opt = rf.reader->root().Get("optimizer");
    if (!opt || opt->kind != PyValue::Kind::kDict) return absl::OkStatus();  // --no-save-optim
    const PyValue* inner = opt;
    if (const PyValue* nested = opt->Get("optimizer"); nested && nested->kind == PyValue::Kind::kDict) {
      inner = nested;
      rf.fp32_groups = opt->Get("fp32_from_fp16_params");
    }
    const PyValue* groups = inner->Get("param_groups");
    const PyValue* state = inner->Get("state");
    if (!groups || groups->kind != PyValue::Kind::kList) return absl::OkStatus();
    // The distributed optimizer's state_dict keeps its groups without their parameters (and Adam's
    // step in each); the fp32 params and moments are in distrib_optim.pt.
    if (std::any_of(groups->items.begin(), groups->items.end(),
                    [](const PyRef& g) { return g->Get("params") == nullptr; }))
      return ReadDistrib(rf, p, groups);
    std::vector<std::string> decay, no_decay, all;
    for (const auto& [n, d] : order) (d ? decay : no_decay).push_back(n);
    std::vector<std::vector<std::string>*> assign;
    if (groups->items.size() == 1) {
      for (const auto& [n, d] : order) all.push_back(n);
      assign.push_back(&all);
    } else if (groups->items.size() == 2) {
      // The group without weight decay: wd_mult 0 (or weight_decay 0 in older files); else the second.
      const bool first_is_no_decay = NumAttr(groups->items[0].get(), "wd_mult").value_or(1.0) == 0.0;
      assign = first_is_no_decay ? std::vector<std::vector<std::string>*>{&no_decay, &decay}
                                 : std::vector<std::vector<std::string>*>{&decay, &no_decay};
    } else {
      return Bad(f, fmt::format("the optimizer has {} parameter groups; ptk maps Megatron's two (weight decay or not)",
                                groups->items.size()));
    }
    int64_t base = 0;
    for (size_t g = 0; g < assign.size(); ++g) {
      const PyValue* ids = groups->items[g]->Get("params");
      if (!ids || ids->kind != PyValue::Kind::kList || ids->items.size() != assign[g]->size())
        return Bad(f, fmt::format("optimizer parameter group {} holds {} parameters; the model's stage has {} there", g,
                                  ids ? ids->items.size() : 0, assign[g]->size()));
      for (size_t k = 0; k < ids->items.size(); ++k) {
        const PyValue* id = ids->items[k].get();
        rf.index[(*assign[g])[k]] = id->IsInt() ? id->i : base + static_cast<int64_t>(k);
        rf.group_pos[(*assign[g])[k]] = {g, k};
      }
      base += static_cast<int64_t>(ids->items.size());
    }
    if (state && state->kind == PyValue::Kind::kDict && !state->dict.empty()) rf.adam_state = state;
    return absl::OkStatus();
  }

  absl::Status ReadDistrib(RankFile& rf, int64_t p, const PyValue* groups) {
    const std::string dfile = JoinPath(Dirname(rf.reader->path()), "distrib_optim.pt");
    if (!PathExists(dfile)) return absl::OkStatus();
    // One grad buffer per model chunk, each laid out alone.
    const std::vector<DistribBuffer> buffers =
        RankDistribBuffers(params, p, sh.pp, vp, te, tied_copy, model.ckpt_padded, sh.tp, s.config.hidden_size, args);
    PTK_ASSIGN_OR_RETURN(DistribState d, ReadDistribOptimChunks(dfile, buffers));
    rf.distrib = std::move(d);
    for (const PyRef& g : groups->items)
      if (auto st = NumAttr(g.get(), "step")) rf.distrib_step = static_cast<int64_t>(*st);
    return absl::OkStatus();
  }

  // The routers' expert biases (fp32, alike on every tensor rank: tensor rank 0's taken), under ptk's names.
  absl::Status ReadBuffers() {
    for (const MegBuffer& b : mbuffers) {
      RankFile& rf = sh.files[0][static_cast<size_t>(b.stage % sh.pp)];
      const PyValue* t = rf.models[static_cast<size_t>(b.stage / sh.pp)]->Get(b.local_name);
      if (!t || t->kind != PyValue::Kind::kTensor || t->tensor.shape != std::vector<int64_t>{b.size})
        return Bad(rf.reader->path(), fmt::format("{}: not a tensor of the {} experts", b.local_name, b.size));
      PTK_ASSIGN_OR_RETURN(std::vector<float> v, rf.reader->ReadFloat(t->tensor, b.local_name));
      buffers.emplace_back(b.name, std::move(v));
    }
    return absl::OkStatus();
  }

  // Every rank: the names it must hold, nothing else (extra states aside), and the optimizer's indices.
  absl::Status CheckRanks() {
    for (int64_t t = 0; t < sh.tp; ++t)
      for (int64_t p = 0; p < sh.pp; ++p) {
        RankFile& rf = sh.files[static_cast<size_t>(t)][static_cast<size_t>(p)];
        const std::string& f = rf.reader->path();
        // Key, decay: the chunks' parameters one chunk after the other (megatron-core's
        // _get_param_groups walks the model chunks in order).
        std::vector<std::pair<std::string, bool>> order;
        for (int64_t v = 0; v < vp; ++v) {
          const int64_t vs = v * sh.pp + p;
          std::set<std::string> expected;
          for (const MegParam* m : StageOrder(params, vs, te)) {
            order.emplace_back(Key(v, LocalName(*m)), m->decay);
            expected.insert(LocalName(*m));
          }
          if (tied_copy && vs == sh.pp * vp - 1) {
            order.emplace_back(Key(v, "output_layer.weight"), true);
            expected.insert("output_layer.weight");
          }
          for (const MegBuffer& b : mbuffers)
            if (b.stage == vs) expected.insert(b.local_name);
          const PyValue* model = rf.models[static_cast<size_t>(v)];
          const std::string where = vp > 1 ? fmt::format("model{} ", v) : "";
          for (const auto& [k, val] : model->dict) {
            if (k->kind != PyValue::Kind::kStr) return Bad(f, "a model key that is not a string");
            if (k->s.size() >= 12 && k->s.compare(k->s.size() - 12, 12, "_extra_state") == 0) continue;
            if (!expected.count(k->s))
              return Bad(
                  f, fmt::format("{}tensor {}: not a weight of the GPT model the checkpoint's args describe "
                                 "(stage {} of {}{}, {} layer names)",
                                 where, k->s, p, sh.pp, vp > 1 ? fmt::format(", chunk {} of {}", v, vp) : std::string(),
                                 te ? "Transformer Engine" : "local"));
          }
          for (const auto& n : expected)
            if (!model->Get(n)) return Bad(f, fmt::format("{}tensor {}: missing", where, n));
        }
        PTK_RETURN_IF_ERROR(MapOptimizer(rf, p, order));
      }
    return absl::OkStatus();
  }

  // A tied embedding over pipeline stages: the last stage keeps a copy (output_layer.weight), which
  // Megatron keeps equal to stage 0's embedding (their gradients are summed). ptk's tied model has one
  // tensor, stage 0's. Megatron's loader takes each copy as it is, so a checkpoint where they differ
  // (damaged, or edited) loads there: warned, naming both tensors and the first element that differs.
  absl::Status CheckTiedCopy() {
    if (!tied_copy) return absl::OkStatus();
    const std::string emb = "embedding.word_embeddings.weight", out = "output_layer.weight";
    for (int64_t t = 0; t < sh.tp; ++t) {
      RankFile& first = sh.files[static_cast<size_t>(t)][0];
      RankFile& last = sh.files[static_cast<size_t>(t)][static_cast<size_t>(sh.pp - 1)];
      const PyValue* e = first.models[0]->Get(emb);
      const PyValue* c = last.models[static_cast<size_t>(vp - 1)]->Get(out);
      if (!e || e->kind != PyValue::Kind::kTensor) return Bad(first.reader->path(), "tensor " + emb + ": not a tensor");
      if (!c || c->kind != PyValue::Kind::kTensor) return Bad(last.reader->path(), "tensor " + out + ": not a tensor");
      if (c->tensor.shape != e->tensor.shape)
        return Bad(last.reader->path(),
                   fmt::format("tensor {} (the last stage's copy of the tied embedding): shape {}, {} in {} has {}",
                               out, ShapeStr(c->tensor.shape), emb, first.reader->path(), ShapeStr(e->tensor.shape)));
      PTK_ASSIGN_OR_RETURN(const std::vector<float> a, first.reader->ReadFloat(e->tensor, emb));
      PTK_ASSIGN_OR_RETURN(const std::vector<float> b, last.reader->ReadFloat(c->tensor, out));
      const int64_t cols = e->tensor.shape.size() > 1 ? e->tensor.shape[1] : 1, rows = e->tensor.shape[0];
      for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], sizeof(float)) == 0) continue;
        const int64_t row = t * rows + static_cast<int64_t>(i) / cols, col = static_cast<int64_t>(i) % cols;
        log::Warning(
            "{}: {} (the last stage's copy of the tied embedding) differs from {} in {} at [{}, {}] ({} vs {}), "
            "which Megatron keeps equal: a damaged or edited checkpoint. Megatron would load each as it is; ptk's "
            "tied model takes stage 0's embedding for both",
            last.reader->path(), out, emb, first.reader->path(), row, col, b[i], a[i]);
        return absl::OkStatus();
      }
    }
    return absl::OkStatus();
  }

  // The same for the distributed optimizer's state (distrib_optim.pt): the last stage's fp32 param and
  // moments of its copy against stage 0's of the embedding, which ptk takes.
  void CheckTiedDistribCopy() const {
    if (!tied_copy) return;
    const int64_t rows = model.ckpt_padded / sh.tp, cols = s.config.hidden_size;
    for (int64_t t = 0; t < sh.tp; ++t) {
      const RankFile& first = sh.files[static_cast<size_t>(t)][0];
      const RankFile& last = sh.files[static_cast<size_t>(t)][static_cast<size_t>(sh.pp - 1)];
      if (!first.distrib || !last.distrib) continue;
      if (megatron::WarnIfTiedCopyDiffers(JoinPath(Dirname(first.reader->path()), "distrib_optim.pt"), *first.distrib,
                                          Key(0, "embedding.word_embeddings.weight"),
                                          JoinPath(Dirname(last.reader->path()), "distrib_optim.pt"), *last.distrib,
                                          Key(vp - 1, "output_layer.weight"), t * rows, rows, cols))
        return;
    }
  }

  // Tensor-parallel shard t of m (its full shape `full`) into w, a, b: the weight (the fp32 master
  // where there is one) and its moments.
  absl::Status GatherShard(const MegParam& m, int64_t t, const std::vector<int64_t>& full, std::vector<float>& w,
                           std::vector<float>& a, std::vector<float>& b) {
    const int64_t tp = sh.tp, rows = full[0], cols = full.size() > 1 ? full[1] : 1;
    const std::string local = LocalName(m), name = Key(Chunk(m), local);
    RankFile& rf = sh.files[static_cast<size_t>(t)][static_cast<size_t>(Rank(m))];
    const std::string& f = rf.reader->path();
    const PyValue* tv = rf.models[static_cast<size_t>(Chunk(m))]->Get(local);
    if (!tv || tv->kind != PyValue::Kind::kTensor) return Bad(f, fmt::format("tensor {}: not a tensor", name));
    std::vector<int64_t> want = full;
    if (m.split >= 0) want[static_cast<size_t>(m.split)] /= tp;
    if (tv->tensor.shape != want)
      return Bad(f, fmt::format("tensor {}: shape {}, the checkpoint's args ask for {} on each of {} tensor-parallel "
                                "ranks",
                                name, ShapeStr(tv->tensor.shape), ShapeStr(want), tp));
    const torchfmt::TensorRef* src = &tv->tensor;
    if (rf.distrib) {  // the distributed optimizer's fp32 params and moments
      const int64_t at = rf.distrib->offset.at(name);
      for (auto [from, to] :
           {std::pair{&rf.distrib->param, &w}, {&rf.distrib->exp_avg, &a}, {&rf.distrib->exp_avg_sq, &b}})
        CopyShard(to->data(), from->data() + at, rows, cols, m.split, t, tp, /*gather=*/true, m.chunks);
      used_distrib = true;
      if (rf.distrib_step) adam_step = *rf.distrib_step;
      return absl::OkStatus();
    }
    // The fp32 master of a --bf16/--fp16 run.
    if (rf.fp32_groups && rf.group_pos.count(name)) {
      const auto [g, k] = rf.group_pos.at(name);
      if (rf.fp32_groups->kind == PyValue::Kind::kList && g < rf.fp32_groups->items.size() &&
          k < rf.fp32_groups->items[g]->items.size() &&
          rf.fp32_groups->items[g]->items[k]->kind == PyValue::Kind::kTensor) {
        const torchfmt::TensorRef& master = rf.fp32_groups->items[g]->items[k]->tensor;
        if (master.numel() != Elements(want))
          return Bad(f, fmt::format("fp32 master of {}: {} elements, the tensor has {}", name, master.numel(),
                                    Elements(want)));
        src = &master;
        used_masters = true;
      }
    }
    if (src->dtype != DType::kFloat32) low_precision = true;
    PTK_ASSIGN_OR_RETURN(std::vector<float> shard, rf.reader->ReadFloat(*src, name));
    CopyShard(w.data(), shard.data(), rows, cols, m.split, t, tp, /*gather=*/true, m.chunks);
    return GatherMoments(rf, name, m, t, rows, cols, want, a, b);
  }

  absl::Status GatherMoments(RankFile& rf, const std::string& name, const MegParam& m, int64_t t, int64_t rows,
                             int64_t cols, const std::vector<int64_t>& want, std::vector<float>& a,
                             std::vector<float>& b) {
    const std::string& f = rf.reader->path();
    const PyValue* st = rf.adam_state && rf.index.count(name) ? IntKey(rf.adam_state, rf.index.at(name)) : nullptr;
    const PyValue* ea = st ? st->Get("exp_avg") : nullptr;
    const PyValue* es = st ? st->Get("exp_avg_sq") : nullptr;
    if (!ea || !es || ea->kind != PyValue::Kind::kTensor || es->kind != PyValue::Kind::kTensor) {
      have_moments = false;
      return absl::OkStatus();
    }
    if (ea->tensor.numel() != Elements(want) || es->tensor.numel() != Elements(want))
      return Bad(f, fmt::format("AdamW moments of {}: {} / {} elements, the tensor has {}", name, ea->tensor.numel(),
                                es->tensor.numel(), Elements(want)));
    PTK_ASSIGN_OR_RETURN(std::vector<float> sa, rf.reader->ReadFloat(ea->tensor, name + " exp_avg"));
    PTK_ASSIGN_OR_RETURN(std::vector<float> sb, rf.reader->ReadFloat(es->tensor, name + " exp_avg_sq"));
    CopyShard(a.data(), sa.data(), rows, cols, m.split, t, sh.tp, true, m.chunks);
    CopyShard(b.data(), sb.data(), rows, cols, m.split, t, sh.tp, true, m.chunks);
    if (const PyValue* step = st->Get("step")) {
      if (step->IsNumber()) {
        adam_step = static_cast<int64_t>(step->Number());
      } else if (step->kind == PyValue::Kind::kTensor) {
        PTK_ASSIGN_OR_RETURN(std::vector<float> sv, rf.reader->ReadFloat(step->tensor, name + " step"));
        if (!sv.empty()) adam_step = static_cast<int64_t>(sv[0]);
      }
    }
    return absl::OkStatus();
  }

  // Every parameter's shards gathered into weights, m1, m2 (ptk's rows of it: the first
  // padded_vocab_size of the vocabulary's).
  absl::Status Gather() {
    weights.assign(static_cast<size_t>(layout->num_params), 0.0f);
    m1.assign(weights.size(), 0.0f);
    m2.assign(weights.size(), 0.0f);
    for (const MegParam& m : params) {
      std::vector<int64_t> full = m.info->shape;
      if (m.vocab) full[0] = model.ckpt_padded;
      const int64_t elements = full[0] * (full.size() > 1 ? full[1] : 1);
      std::vector<float> w(static_cast<size_t>(elements)), a(w.size()), b(w.size());
      for (int64_t t = 0; t < (m.split >= 0 ? sh.tp : 1); ++t) PTK_RETURN_IF_ERROR(GatherShard(m, t, full, w, a, b));
      const auto n = static_cast<std::ptrdiff_t>(m.info->size);
      std::copy(w.begin(), w.begin() + n, weights.begin() + m.info->offset);
      std::copy(a.begin(), a.begin() + n, m1.begin() + m.info->offset);
      std::copy(b.begin(), b.begin() + n, m2.begin() + m.info->offset);
      if (progress != nullptr) {
        progress->AddItems(1);
        progress->Refresh();  // on a terminal the line says each parameter as it is gathered
      }
    }
    for (float x : weights)
      if (!std::isfinite(x)) return Bad(s.source, "a weight is NaN or infinite");
    return absl::OkStatus();
  }

  // What the summary says of where the numbers came from.
  void Notes() {
    if (!have_moments) {
      std::fill(m1.begin(), m1.end(), 0.0f);
      std::fill(m2.begin(), m2.end(), 0.0f);
      adam_step = 0;
      if (!s.release)  // a release loads without them anyway
        s.notes.push_back(std::string(BoolAttr(args, "use_distributed_optimizer", false)
                                          ? "the distributed optimizer's distrib_optim.pt is missing (for some ranks "
                                            "at least): the AdamW moments start at zero"
                                          : "the checkpoint holds no AdamW moments (saved with --no-save-optim, or "
                                            "before a step): they start at zero") +
                          kNoOptimizerLoad);
    }
    if (low_precision)
      s.notes.push_back(
          "some weights are the model's bf16/fp16 copies widened to fp32: the checkpoint holds no fp32 master for "
          "them (a distributed optimizer keeps them in distrib_optim.pt)");
    if (used_masters) s.notes.push_back("the weights are the optimizer's fp32 master copies (a --bf16/--fp16 run)");
    if (used_distrib)
      s.notes.push_back("the weights and AdamW moments are the distributed optimizer's fp32 state (distrib_optim.pt)");
    const GPTConfig& c = s.config;
    if (model.ckpt_padded > c.padded_vocab_size)
      s.notes.push_back(
          fmt::format("the vocabulary's {} padded rows are cut to {} (a multiple of {}, as ptk-train pads "
                      "{} tokens)",
                      model.ckpt_padded, c.padded_vocab_size, model.divisible, c.vocab_size));
  }
};

// Whether the shards hold Transformer Engine's layer names (the norms fused into the linear layers) or the local
// spec's: the first layer's input norm in linear_qkv. MLA keeps its input norm apart under either spec: TE's names
// are then the norms fused into linear_fc1 or into the latents' up projections, wherever a layer has one (where none
// has, both specs' names are the same).
bool TransformerEngineNames(const Shards& sh, const GPTConfig& c) {
  if (sh.files[0][0].models[0]->Get("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")) return true;
  for (const auto& row : sh.files)
    for (const RankFile& rf : row)
      for (const PyValue* m : rf.models)
        for (const auto& [k, v] : m->dict)
          if (c.mla() && k->kind == PyValue::Kind::kStr && k->s.ends_with(".layer_norm_weight")) return true;
  return false;
}

}  // namespace

absl::StatusOr<ConvertSummary> ImportFromMegatron(const ConvertOptions& o) {
  ConvertSummary s;
  PTK_ASSIGN_OR_RETURN(const std::string iter_dir, TrackedIterationDir(o.load_dir, &s));
  // Megatron's torch_dist format (PyTorch's distributed checkpoint): .metadata beside the .distcp files.
  if (PathExists(JoinPath(iter_dir, ".metadata")) || PathExists(JoinPath(iter_dir, "common.pt")))
    return ImportFromMegatronDist(o, iter_dir, s.iteration, s.release);
  PTK_ASSIGN_OR_RETURN(Shards sh, OpenShards(iter_dir, o.progress));
  RankFile& first = sh.files[0][0];
  s.source = first.reader->path();
  const PyValue& root = first.reader->root();
  if (root.kind != PyValue::Kind::kDict) return Bad(s.source, "the pickle is not a dict: not a Megatron checkpoint");
  Import im(o, s, sh);
  im.args = root.Get("args");
  if (!im.args || im.args->kind != PyValue::Kind::kObject)
    return Bad(s.source, "no args (an argparse.Namespace): not a Megatron training checkpoint");
  // A release checkpoint is Megatron's iteration 0 whatever it stores (its load_checkpoint).
  if (const PyValue* iter = root.Get("iteration"); iter && iter->IsInt() && !s.release) s.iteration = iter->i;

  // The model configuration, and what ptk's GPT does not have.
  PTK_ASSIGN_OR_RETURN(im.model, ModelFromArgs(im.args, s.source, o, sh.tp));
  s.config = im.model.config;
  const auto tp_arg = NumAttr(im.args, "tensor_model_parallel_size"),
             pp_arg = NumAttr(im.args, "pipeline_model_parallel_size");
  if ((tp_arg && static_cast<int64_t>(*tp_arg) != sh.tp) || (pp_arg && static_cast<int64_t>(*pp_arg) != sh.pp))
    return Bad(s.source, fmt::format("args say tensor x pipeline parallel {} x {}, the directory holds {} x {} shards",
                                     tp_arg.value_or(1), pp_arg.value_or(1), sh.tp, sh.pp));
  // An interleaved run's chunks (Megatron's save_checkpoint: model0, model1, ... with
  // args.virtual_pipeline_model_parallel_size): chunk v of stage p is virtual stage v * pp + p, its
  // layers numbered from 0 (megatron-core's get_transformer_layer_offset: v * L / V + p * L / (P * V)).
  if (root.Get("model0")) {
    while (root.Get(fmt::format("model{}", im.vp))) ++im.vp;
    const auto vp_arg = NumAttr(im.args, "virtual_pipeline_model_parallel_size");
    if (!vp_arg || static_cast<int64_t>(*vp_arg) < im.vp)
      return Bad(s.source, fmt::format("model0..model{}, args.virtual_pipeline_model_parallel_size {}", im.vp - 1,
                                       vp_arg ? fmt::format("{}", *vp_arg) : "absent"));
    if (static_cast<int64_t>(*vp_arg) > im.vp)
      return Bad(s.source, fmt::format("model{}: missing (args.virtual_pipeline_model_parallel_size {})", im.vp,
                                       static_cast<int64_t>(*vp_arg)));
    if (s.config.num_layers % (sh.pp * im.vp) != 0)
      return Bad(s.source, fmt::format("{} layers do not divide into {} pipeline stages x {} model chunks",
                                       s.config.num_layers, sh.pp, im.vp));
    if (auto n = NumAttr(im.args, "num_layers_per_virtual_pipeline_stage");
        n && static_cast<int64_t>(*n) != s.config.num_layers / (sh.pp * im.vp))
      return Bad(s.source,
                 fmt::format("args.num_layers_per_virtual_pipeline_stage {}: {} layers over {} stages x {} chunks "
                             "are {} a chunk",
                             *n, s.config.num_layers, sh.pp, im.vp, s.config.num_layers / (sh.pp * im.vp)));
  } else if (auto vp_arg = NumAttr(im.args, "virtual_pipeline_model_parallel_size"); vp_arg && *vp_arg > 1) {
    return Bad(s.source, fmt::format("args.virtual_pipeline_model_parallel_size {} but no model0, model1, ...: "
                                     "the chunks' state dicts are missing",
                                     *vp_arg));
  }
  PTK_ASSIGN_OR_RETURN(im.layout, ParamLayout::Create(s.config));
  PTK_ASSIGN_OR_RETURN(im.params, MegParams(*im.layout, sh.pp * im.vp));
  im.mbuffers = MegBuffers(s.config, im.params);

  // Every file holds the same chunks; the layer spec: Transformer Engine's fused LayerNorm names or
  // the local ones.
  for (auto& row : sh.files)
    for (RankFile& rf : row) {
      const PyValue& r = rf.reader->root();
      if (r.kind != PyValue::Kind::kDict) return Bad(rf.reader->path(), "the pickle is not a dict");
      for (int64_t v = 0; v < im.vp; ++v) {
        const std::string key = im.vp > 1 ? fmt::format("model{}", v) : "model";
        const PyValue* m = r.Get(key);
        if (!m || m->kind != PyValue::Kind::kDict)
          return Bad(
              rf.reader->path(),
              fmt::format("no {} state dict{}", key,
                          im.vp > 1 ? fmt::format(" (the first file has model0..model{})", im.vp - 1) : std::string()));
        rf.models.push_back(m);
      }
      if (r.Get(fmt::format("model{}", im.vp)) || (im.vp > 1 && r.Get("model")))
        return Bad(rf.reader->path(), fmt::format("its model chunks differ from the first file's ({})",
                                                  im.vp > 1 ? fmt::format("model0..model{}", im.vp - 1) : "model"));
    }
  im.te = TransformerEngineNames(sh, s.config);
  SplitMlaDown(im.te, &im.params);
  im.tied_copy = !s.config.untie_embeddings_and_output_weights && sh.pp * im.vp > 1;
  PTK_RETURN_IF_ERROR(im.CheckRanks());
  PTK_RETURN_IF_ERROR(im.CheckTiedCopy());
  im.CheckTiedDistribCopy();
  {
    // A large model's shards are tens of GB: the import says how far it is gathering them.
    ProgressReporter progress(
        {.label = "convert", .item_unit = "tensors", .items_total = im.params.size(), .enabled = o.progress});
    im.progress = &progress;
    PTK_RETURN_IF_ERROR(im.Gather());
    im.progress = nullptr;
  }
  PTK_RETURN_IF_ERROR(im.ReadBuffers());
  im.Notes();
  PTK_RETURN_IF_ERROR(SaveImported(o, im.args, root, first.reader.get(), *im.layout, im.model.divisible,
                                   im.have_moments, im.adam_step, im.weights, im.m1, im.m2, &s, std::move(im.buffers)));
  s.notes.push_back(fmt::format("read {} tensor- x {} pipeline-parallel shards{} ({} layer names){}", sh.tp, sh.pp,
                                im.vp > 1 ? fmt::format(" of {} model chunks each (interleaved)", im.vp) : "",
                                im.te ? "Transformer Engine" : "local",
                                im.have_moments ? ", with the AdamW moments" : ""));
  return s;
}

}  // namespace ptk
