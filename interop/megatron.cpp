// Megatron-LM `torch` checkpoint -> ptk checkpoint: the shards merged, the optimizer's state mapped.
#include "interop/megatron.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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
  const PyValue* model = nullptr;
  // Optimizer: the AdamW state (by index) and, in --bf16/--fp16 runs, the fp32 masters per group.
  const PyValue* adam_state = nullptr;
  const PyValue* fp32_groups = nullptr;
  std::map<std::string, int64_t> index;  // local name -> optimizer index
  std::map<std::string, std::pair<size_t, size_t>> group_pos;
  // The distributed optimizer's distrib_optim.pt beside it: fp32 params and moments.
  std::optional<DistribState> distrib;
  std::optional<int64_t> distrib_step;
};

}  // namespace

absl::StatusOr<ConvertSummary> ImportFromMegatron(const ConvertOptions& o) {
  ConvertSummary s;
  const std::string tracker = JoinPath(o.load_dir, kTracker);
  if (!PathExists(tracker))
    return absl::NotFoundError(fmt::format("{}: missing: not a Megatron checkpoint directory", tracker));
  PTK_ASSIGN_OR_RETURN(std::string tracker_text, ReadFileToString(tracker));
  std::string it_text(tracker_text);
  it_text.erase(std::remove_if(it_text.begin(), it_text.end(), [](char ch) { return std::isspace(ch); }),
                it_text.end());
  std::string iter_dir;
  if (it_text == "release") {
    iter_dir = JoinPath(o.load_dir, "release");
  } else {
    if (it_text.empty() || it_text.size() > 18 || !std::all_of(it_text.begin(), it_text.end(), ::isdigit))
      return absl::DataLossError(fmt::format("{}: not an iteration number: {:?}", tracker, tracker_text));
    s.iteration = std::atoll(it_text.c_str());
    iter_dir = JoinPath(o.load_dir, fmt::format("iter_{:07d}", s.iteration));
  }
  if (!IsDirectory(iter_dir)) return absl::NotFoundError(fmt::format("{}: missing (the tracker names it)", iter_dir));
  // The shards present: mp_rank_TT or mp_rank_TT_PPP, each with model_optim_rng.pt.
  // Megatron's torch_dist format (PyTorch's distributed checkpoint): .metadata beside the .distcp files.
  if (PathExists(JoinPath(iter_dir, ".metadata")) || PathExists(JoinPath(iter_dir, "common.pt")))
    return ImportFromMegatronDist(o, iter_dir, s.iteration);
  int64_t tp = 0, pp = 0;
  bool with_pp = false;
  std::error_code ec;
  static const std::regex kRank(R"(mp_rank_(\d\d)(_(\d\d\d))?)");
  for (const auto& e : std::filesystem::directory_iterator(iter_dir, ec)) {
    const std::string name = e.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, kRank)) continue;
    tp = std::max<int64_t>(tp, std::atoll(m[1].str().c_str()) + 1);
    if (m[2].matched) {
      with_pp = true;
      pp = std::max<int64_t>(pp, std::atoll(m[3].str().c_str()) + 1);
    }
  }
  if (tp == 0) return absl::NotFoundError(fmt::format("{}: no mp_rank_* directory", iter_dir));
  if (!with_pp) pp = 1;
  std::vector<std::vector<RankFile>> files(static_cast<size_t>(tp));
  for (int64_t t = 0; t < tp; ++t)
    for (int64_t p = 0; p < pp; ++p) {
      const std::string f = JoinPath(JoinPath(iter_dir, RankDir(t, p, with_pp ? pp : 1)), kFile);
      if (!PathExists(f))
        return absl::NotFoundError(fmt::format(
            "{}: missing: the checkpoint has {} tensor- x {} pipeline-parallel shards and this one is absent", f, tp,
            pp));
      RankFile rf;
      PTK_ASSIGN_OR_RETURN(rf.reader, torchfmt::TorchArchiveReader::Open(f));
      files[static_cast<size_t>(t)].push_back(std::move(rf));
    }
  RankFile& first = files[0][0];
  s.source = first.reader->path();
  const PyValue& root = first.reader->root();
  auto bad = [&](const std::string& file, const std::string& why) {
    return absl::DataLossError(fmt::format("{}: {}", file, why));
  };
  if (root.kind != PyValue::Kind::kDict) return bad(s.source, "the pickle is not a dict: not a Megatron checkpoint");
  if (root.Get("model0"))
    return bad(s.source, "virtual pipeline stages (model0, model1, ...): ptk reads one model chunk");
  const PyValue* args = root.Get("args");
  if (!args || args->kind != PyValue::Kind::kObject)
    return bad(s.source, "no args (an argparse.Namespace): not a Megatron training checkpoint");
  if (const PyValue* iter = root.Get("iteration"); iter && iter->IsInt()) s.iteration = iter->i;

  // The model configuration, and what ptk's GPT does not have.
  PTK_ASSIGN_OR_RETURN(MegatronModel model, ModelFromArgs(args, s.source, o, tp));
  s.config = model.config;
  GPTConfig& c = s.config;
  const int64_t ckpt_padded = model.ckpt_padded, divisible = model.divisible;
  const auto tp_arg = NumAttr(args, "tensor_model_parallel_size"),
             pp_arg = NumAttr(args, "pipeline_model_parallel_size");
  if ((tp_arg && static_cast<int64_t>(*tp_arg) != tp) || (pp_arg && static_cast<int64_t>(*pp_arg) != pp))
    return bad(s.source, fmt::format("args say tensor x pipeline parallel {} x {}, the directory holds {} x {} shards",
                                     tp_arg.value_or(1), pp_arg.value_or(1), tp, pp));
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  PTK_ASSIGN_OR_RETURN(std::vector<MegParam> params, MegParams(layout, pp));

  // The layer spec: Transformer Engine's fused LayerNorm names or the local ones.
  for (auto& row : files)
    for (RankFile& rf : row) {
      rf.model = rf.reader->root().Get("model");
      if (!rf.model || rf.model->kind != PyValue::Kind::kDict) return bad(rf.reader->path(), "no model state dict");
    }
  const bool te = files[0][0].model->Get("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") != nullptr;
  auto local_name = [&](const MegParam& m) { return te ? m.te_name : m.local_name; };
  const bool tied_copy = !c.untie_embeddings_and_output_weights && pp > 1;

  // Every rank: the names it must hold, nothing else (extra states aside), and the optimizer's indices.
  for (int64_t t = 0; t < tp; ++t)
    for (int64_t p = 0; p < pp; ++p) {
      RankFile& rf = files[static_cast<size_t>(t)][static_cast<size_t>(p)];
      const std::string& f = rf.reader->path();
      std::vector<std::pair<std::string, bool>> order;  // local name, decay
      for (const MegParam* m : StageOrder(params, p, te)) order.emplace_back(local_name(*m), m->decay);
      if (tied_copy && p == pp - 1) order.emplace_back("output_layer.weight", true);
      std::set<std::string> expected;
      for (const auto& [n, d] : order) expected.insert(n);
      for (const auto& [k, v] : rf.model->dict) {
        if (k->kind != PyValue::Kind::kStr) return bad(f, "a model key that is not a string");
        if (k->s.size() >= 12 && k->s.compare(k->s.size() - 12, 12, "_extra_state") == 0) continue;
        if (!expected.count(k->s))
          return bad(f, fmt::format("tensor {}: not a weight of the GPT model the checkpoint's args describe (stage "
                                    "{} of {}, {} layer names)",
                                    k->s, p, pp, te ? "Transformer Engine" : "local"));
      }
      for (const auto& n : expected)
        if (!rf.model->Get(n)) return bad(f, fmt::format("tensor {}: missing", n));
      // The optimizer (absent with --no-save-optim).
      const PyValue* opt = rf.reader->root().Get("optimizer");
      if (!opt || opt->kind != PyValue::Kind::kDict) continue;
      const PyValue* inner = opt;
      if (const PyValue* nested = opt->Get("optimizer"); nested && nested->kind == PyValue::Kind::kDict) {
        inner = nested;
        rf.fp32_groups = opt->Get("fp32_from_fp16_params");
      }
      const PyValue* groups = inner->Get("param_groups");
      const PyValue* state = inner->Get("state");
      if (!groups || groups->kind != PyValue::Kind::kList) continue;
      // The distributed optimizer's state_dict keeps its groups without their parameters (and Adam's
      // step in each); the fp32 params and moments are in distrib_optim.pt.
      if (std::any_of(groups->items.begin(), groups->items.end(),
                      [](const PyRef& g) { return g->Get("params") == nullptr; })) {
        const std::string dfile = JoinPath(Dirname(f), "distrib_optim.pt");
        if (!PathExists(dfile)) continue;
        std::vector<DistribParam> dparams;
        for (const MegParam* m : StageOrder(params, p, te))
          dparams.push_back(DistribParam{local_name(*m), Elements(ShardShape(*m, ckpt_padded, tp)),
                                         tied_copy && m->info->name == "embedding.word_embeddings.weight"});
        if (tied_copy && p == pp - 1)
          dparams.push_back(DistribParam{"output_layer.weight", ckpt_padded / tp * c.hidden_size, true});
        PTK_ASSIGN_OR_RETURN(DistribState d, ReadDistribOptim(dfile, dparams, DistribBucketSize(args, p)));
        rf.distrib = std::move(d);
        for (const PyRef& g : groups->items)
          if (auto st = NumAttr(g.get(), "step")) rf.distrib_step = static_cast<int64_t>(*st);
        continue;
      }
      std::vector<std::string> decay, no_decay;
      for (const auto& [n, d] : order) (d ? decay : no_decay).push_back(n);
      std::vector<std::vector<std::string>*> assign;
      std::vector<std::string> all;
      if (groups->items.size() == 1) {
        for (const auto& [n, d] : order) all.push_back(n);
        assign.push_back(&all);
      } else if (groups->items.size() == 2) {
        // The group without weight decay: wd_mult 0 (or weight_decay 0 in older files); else the second.
        const PyValue* g0 = groups->items[0].get();
        const bool first_is_no_decay = NumAttr(g0, "wd_mult").value_or(1.0) == 0.0;
        assign = first_is_no_decay ? std::vector<std::vector<std::string>*>{&no_decay, &decay}
                                   : std::vector<std::vector<std::string>*>{&decay, &no_decay};
      } else {
        return bad(f, fmt::format("the optimizer has {} parameter groups; ptk maps Megatron's two (weight decay or "
                                  "not)",
                                  groups->items.size()));
      }
      int64_t base = 0;
      for (size_t g = 0; g < assign.size(); ++g) {
        const PyValue* ids = groups->items[g]->Get("params");
        if (!ids || ids->kind != PyValue::Kind::kList || ids->items.size() != assign[g]->size())
          return bad(f, fmt::format("optimizer parameter group {} holds {} parameters; the model's stage has {} there",
                                    g, ids ? ids->items.size() : 0, assign[g]->size()));
        for (size_t k = 0; k < ids->items.size(); ++k) {
          const PyValue* id = ids->items[k].get();
          rf.index[(*assign[g])[k]] = id->IsInt() ? id->i : base + static_cast<int64_t>(k);
          rf.group_pos[(*assign[g])[k]] = {g, k};
        }
        base += static_cast<int64_t>(ids->items.size());
      }
      if (state && state->kind == PyValue::Kind::kDict && !state->dict.empty()) rf.adam_state = state;
    }

  // Gather: weights (fp32 masters where the optimizer has them), moments.
  std::vector<float> weights(static_cast<size_t>(layout.num_params)), m1(weights.size(), 0.0f),
      m2(weights.size(), 0.0f);
  bool have_moments = true, used_masters = false, used_distrib = false, low_precision = false;
  int64_t adam_step = 0;
  for (const MegParam& m : params) {
    const std::vector<int64_t> full = [&] {
      std::vector<int64_t> f = m.info->shape;
      if (m.vocab) f[0] = ckpt_padded;
      return f;
    }();
    const int64_t rows = full[0], cols = full.size() > 1 ? full[1] : 1;
    std::vector<float> w(static_cast<size_t>(rows * cols)), a(w.size()), b(w.size());
    const int64_t shards = m.split >= 0 ? tp : 1;
    const std::string name = local_name(m);
    for (int64_t t = 0; t < shards; ++t) {
      RankFile& rf = files[static_cast<size_t>(t)][static_cast<size_t>(m.stage)];
      const std::string& f = rf.reader->path();
      const PyValue* tv = rf.model->Get(name);
      if (!tv || tv->kind != PyValue::Kind::kTensor) return bad(f, fmt::format("tensor {}: not a tensor", name));
      std::vector<int64_t> want = full;
      if (m.split >= 0) want[static_cast<size_t>(m.split)] /= tp;
      if (tv->tensor.shape != want)
        return bad(f, fmt::format("tensor {}: shape {}, the checkpoint's args ask for {} on each of {} tensor-parallel "
                                  "ranks",
                                  name, ShapeStr(tv->tensor.shape), ShapeStr(want), tp));
      const torchfmt::TensorRef* src = &tv->tensor;
      if (rf.distrib) {  // the distributed optimizer's fp32 params and moments
        const int64_t at = rf.distrib->offset.at(name);
        for (auto [from, to] :
             {std::pair{&rf.distrib->param, &w}, {&rf.distrib->exp_avg, &a}, {&rf.distrib->exp_avg_sq, &b}})
          CopyShard(to->data(), from->data() + at, rows, cols, m.split, t, tp, /*gather=*/true);
        used_distrib = true;
        if (rf.distrib_step) adam_step = *rf.distrib_step;
        continue;
      }
      // The fp32 master of a --bf16/--fp16 run.
      if (rf.fp32_groups && rf.group_pos.count(name)) {
        const auto [g, k] = rf.group_pos.at(name);
        if (rf.fp32_groups->kind == PyValue::Kind::kList && g < rf.fp32_groups->items.size() &&
            k < rf.fp32_groups->items[g]->items.size() &&
            rf.fp32_groups->items[g]->items[k]->kind == PyValue::Kind::kTensor) {
          const torchfmt::TensorRef& master = rf.fp32_groups->items[g]->items[k]->tensor;
          if (master.numel() != Elements(want))
            return bad(f, fmt::format("fp32 master of {}: {} elements, the tensor has {}", name, master.numel(),
                                      Elements(want)));
          src = &master;
          used_masters = true;
        }
      }
      if (src->dtype != DType::kFloat32) low_precision = true;
      PTK_ASSIGN_OR_RETURN(std::vector<float> shard, rf.reader->ReadFloat(*src, name));
      CopyShard(w.data(), shard.data(), rows, cols, m.split, t, tp, /*gather=*/true);
      // Its moments.
      const PyValue* st = rf.adam_state && rf.index.count(name) ? IntKey(rf.adam_state, rf.index.at(name)) : nullptr;
      const PyValue* ea = st ? st->Get("exp_avg") : nullptr;
      const PyValue* es = st ? st->Get("exp_avg_sq") : nullptr;
      if (!ea || !es || ea->kind != PyValue::Kind::kTensor || es->kind != PyValue::Kind::kTensor) {
        have_moments = false;
        continue;
      }
      if (ea->tensor.numel() != Elements(want) || es->tensor.numel() != Elements(want))
        return bad(f, fmt::format("AdamW moments of {}: {} / {} elements, the tensor has {}", name, ea->tensor.numel(),
                                  es->tensor.numel(), Elements(want)));
      PTK_ASSIGN_OR_RETURN(std::vector<float> sa, rf.reader->ReadFloat(ea->tensor, name + " exp_avg"));
      PTK_ASSIGN_OR_RETURN(std::vector<float> sb, rf.reader->ReadFloat(es->tensor, name + " exp_avg_sq"));
      CopyShard(a.data(), sa.data(), rows, cols, m.split, t, tp, true);
      CopyShard(b.data(), sb.data(), rows, cols, m.split, t, tp, true);
      if (const PyValue* step = st->Get("step")) {
        if (step->IsNumber()) {
          adam_step = static_cast<int64_t>(step->Number());
        } else if (step->kind == PyValue::Kind::kTensor) {
          PTK_ASSIGN_OR_RETURN(std::vector<float> sv, rf.reader->ReadFloat(step->tensor, name + " step"));
          if (!sv.empty()) adam_step = static_cast<int64_t>(sv[0]);
        }
      }
    }
    const size_t n = static_cast<size_t>(m.info->size);  // ptk's rows (the first padded_vocab_size)
    std::copy(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(n), weights.begin() + m.info->offset);
    std::copy(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(n), m1.begin() + m.info->offset);
    std::copy(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n), m2.begin() + m.info->offset);
  }
  for (float x : weights)
    if (!std::isfinite(x)) return bad(s.source, "a weight is NaN or infinite");
  if (!have_moments) {
    std::fill(m1.begin(), m1.end(), 0.0f);
    std::fill(m2.begin(), m2.end(), 0.0f);
    adam_step = 0;
    s.notes.push_back(BoolAttr(args, "use_distributed_optimizer", false)
                          ? "the distributed optimizer's distrib_optim.pt is missing (for some ranks at least): the "
                            "AdamW moments start at zero "
                            "(ptk-train --load ... --no-load-optim)"
                          : "the checkpoint holds no AdamW moments (saved with --no-save-optim, or before a step): "
                            "they start at zero");
  }
  if (low_precision)
    s.notes.push_back(
        "some weights are the model's bf16/fp16 copies widened to fp32: the checkpoint holds no fp32 master for them "
        "(a distributed optimizer keeps them in distrib_optim.pt)");
  if (used_masters) s.notes.push_back("the weights are the optimizer's fp32 master copies (a --bf16/--fp16 run)");
  if (used_distrib)
    s.notes.push_back("the weights and AdamW moments are the distributed optimizer's fp32 state (distrib_optim.pt)");
  if (ckpt_padded > c.padded_vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary's {} padded rows are cut to {} (a multiple of {}, as ptk-train pads "
                    "{} tokens)",
                    ckpt_padded, c.padded_vocab_size, divisible, c.vocab_size));

  PTK_RETURN_IF_ERROR(
      SaveImported(o, args, root, first.reader.get(), layout, divisible, adam_step, weights, m1, m2, &s));
  s.notes.push_back(fmt::format("read {} tensor- x {} pipeline-parallel shards ({} layer names){}", tp, pp,
                                te ? "Transformer Engine" : "local", have_moments ? ", with the AdamW moments" : ""));
  return s;
}

}  // namespace ptk
