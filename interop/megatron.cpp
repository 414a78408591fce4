// ptk checkpoint <-> Megatron-LM `torch` checkpoint: the shard layout, the names, the optimizer.
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
        // megatron-core's bucket size: --ddp-bucket-size, else max(4e7, 1e6 x data-parallel size), only with
        // --overlap-grad-reduce, and only on the first pipeline stage.
        std::optional<int64_t> bucket;
        if (BoolAttr(args, "overlap_grad_reduce", false) && p == 0) {
          const int64_t dp = static_cast<int64_t>(NumAttr(args, "data_parallel_size").value_or(1));
          bucket = static_cast<int64_t>(NumAttr(args, "ddp_bucket_size").value_or(std::max(4e7, 1e6 * dp)));
        }
        PTK_ASSIGN_OR_RETURN(DistribState d, ReadDistribOptim(dfile, dparams, bucket));
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

// ---- ptk -> megatron ---------------------------------------------------------------------------
namespace {

// A setting the ptk run recorded, as a number (fallback when absent).
double SettingNum(const TrainState& st, const std::string& flag, double fallback) {
  for (const auto& [k, v] : st.settings)
    if (k == flag) {
      char* end = nullptr;
      const double d = std::strtod(v.c_str(), &end);
      if (end != v.c_str() && *end == '\0') return d;
    }
  return fallback;
}
std::string SettingStr(const TrainState& st, const std::string& flag, const std::string& fallback) {
  for (const auto& [k, v] : st.settings)
    if (k == flag) return v;
  return fallback;
}

absl::Status RemoveAll(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", path, ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ConvertSummary> ExportToMegatron(const ConvertOptions& o) {
  ConvertSummary s;
  const int64_t tp = o.target_tensor_parallel_size, pp = o.target_pipeline_parallel_size;
  if (o.saver_transformer_impl != "transformer_engine" && o.saver_transformer_impl != "local")
    return UsageError(
        fmt::format("--saver-transformer-impl {}: transformer_engine or local", o.saver_transformer_impl));
  PTK_ASSIGN_OR_RETURN(PtkCheckpoint ck, LoadPtkCheckpoint(o.load_dir, o.true_vocab_size));
  GPTConfig& c = ck.config;
  s.notes = ck.notes;
  s.source = ck.file;
  s.iteration = ck.iteration;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  std::vector<float> params, m1, m2;
  TrainState state;
  PTK_RETURN_IF_ERROR(LoadCheckpoint(o.load_dir, ck.iteration, layout, &params, &m1, &m2, &state));
  if (PaddedVocabSize(c.vocab_size, o.make_vocab_size_divisible_by) != c.padded_vocab_size)
    return UsageError(
        fmt::format("{}: a vocabulary of {} padded to {} is not a multiple of "
                    "--make-vocab-size-divisible-by {}: give the value the run was trained with",
                    ck.file, c.vocab_size, c.padded_vocab_size, o.make_vocab_size_divisible_by));
  if (c.num_attention_heads % tp != 0 || c.ffn_hidden_size % tp != 0)
    return UsageError(fmt::format("--target-tensor-parallel-size {} does not divide the {} heads and ffn {}", tp,
                                  c.num_attention_heads, c.ffn_hidden_size));
  const int64_t vm = PaddedVocabSize(c.vocab_size, o.make_vocab_size_divisible_by * tp);
  PTK_ASSIGN_OR_RETURN(std::vector<MegParam> mparams, MegParams(layout, pp));
  const bool te = o.saver_transformer_impl == "transformer_engine";
  const bool tied_copy = !c.untie_embeddings_and_output_weights && pp > 1;
  const bool with_moments = state.adam_step > 0;
  // As the saving run trained: fp32, or bf16/fp16 model weights with the fp32 masters in the optimizer.
  const std::string precision = SettingStr(state, "--bf16/--fp16", "fp32");
  const bool mixed = precision == "bf16" || precision == "fp16";
  const DType model_dtype = precision == "bf16"   ? DType::kBFloat16
                            : precision == "fp16" ? DType::kFloat16
                                                  : DType::kFloat32;

  // The args Namespace: what Megatron's load checks (check_checkpoint_args) and its converter reads.
  PyRef ns_attrs = torchfmt::MakeDict();
  PyValue* a = ns_attrs.get();
  auto set_i = [&](const char* k, int64_t v) { torchfmt::DictSet(a, k, torchfmt::MakeInt(v)); };
  auto set_f = [&](const char* k, double v) { torchfmt::DictSet(a, k, torchfmt::MakeFloat(v)); };
  auto set_s = [&](const char* k, const std::string& v) { torchfmt::DictSet(a, k, torchfmt::MakeStr(v)); };
  auto set_b = [&](const char* k, bool v) { torchfmt::DictSet(a, k, torchfmt::MakeBool(v)); };
  auto set_none = [&](const char* k) { torchfmt::DictSet(a, k, torchfmt::MakeNone()); };
  set_i("num_layers", c.num_layers);
  set_i("hidden_size", c.hidden_size);
  set_i("ffn_hidden_size", c.ffn_hidden_size);
  set_i("num_attention_heads", c.num_attention_heads);
  set_i("kv_channels", c.head_dim());
  set_b("group_query_attention", false);
  set_i("num_query_groups", c.num_attention_heads);
  set_i("max_position_embeddings", c.max_position_embeddings);
  set_i("seq_length", c.seq_length);
  set_s("position_embedding_type", "learned_absolute");
  set_b("add_position_embedding", true);
  set_s("normalization", "LayerNorm");
  set_f("layernorm_epsilon", c.layernorm_epsilon);
  set_b("apply_layernorm_1p", false);
  set_b("apply_residual_connection_post_layernorm", false);
  set_b("swiglu", false);
  set_b("add_bias_linear", true);
  set_b("add_qkv_bias", true);
  set_b("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights);
  set_f("hidden_dropout", c.hidden_dropout);
  set_f("attention_dropout", c.attention_dropout);
  set_f("init_method_std", c.init_method_std);
  set_i("vocab_size", c.vocab_size);
  set_i("padded_vocab_size", vm);
  set_i("make_vocab_size_divisible_by", o.make_vocab_size_divisible_by);
  set_s("tokenizer_type", "GPT2BPETokenizer");
  set_i("tensor_model_parallel_size", tp);
  set_i("pipeline_model_parallel_size", pp);
  set_none("virtual_pipeline_model_parallel_size");
  set_b("sequence_parallel", false);
  set_i("data_parallel_size", 1);
  set_i("world_size", tp * pp);
  set_none("num_experts");
  set_s("transformer_impl", o.saver_transformer_impl);
  set_s("ckpt_format", "torch");
  set_b("use_distributed_optimizer", false);
  set_b("fp16", precision == "fp16");
  set_b("bf16", precision == "bf16");
  torchfmt::DictSet(a, "params_dtype",
                    torchfmt::MakeGlobal(precision == "bf16"   ? "torch.bfloat16"
                                         : precision == "fp16" ? "torch.float16"
                                                               : "torch.float32"));
  set_i("iteration", state.iteration);
  set_i("train_iters", static_cast<int64_t>(SettingNum(state, "--train-iters", 0)));
  set_i("micro_batch_size", static_cast<int64_t>(SettingNum(state, "--micro-batch-size", 1)));
  set_i("global_batch_size", static_cast<int64_t>(SettingNum(state, "--global-batch-size", 1)));
  set_i("consumed_train_samples", state.consumed_train_samples);
  set_i("consumed_valid_samples", state.consumed_valid_samples);
  set_i("skipped_train_samples", 0);
  set_i("seed", static_cast<int64_t>(state.seed));
  set_s("optimizer", "adam");
  const double lr = state.scheduler ? state.scheduler->max_lr : SettingNum(state, "--lr", 0);
  const double min_lr = state.scheduler ? state.scheduler->min_lr : SettingNum(state, "--min-lr", 0);
  set_f("lr", lr);
  set_f("min_lr", min_lr);
  set_s("lr_decay_style",
        state.scheduler ? state.scheduler->decay_style : SettingStr(state, "--lr-decay-style", "linear"));
  const double wd = SettingNum(state, "--weight-decay", 0.01), b1 = SettingNum(state, "--adam-beta1", 0.9),
               b2 = SettingNum(state, "--adam-beta2", 0.999), eps = SettingNum(state, "--adam-eps", 1e-8);
  set_f("weight_decay", wd);
  set_f("adam_beta1", b1);
  set_f("adam_beta2", b2);
  set_f("adam_eps", eps);
  set_f("clip_grad", SettingNum(state, "--clip-grad", 1.0));
  PyRef args = torchfmt::MakeNamespace(ns_attrs);

  PyRef sched = torchfmt::MakeDict();
  {
    const SchedulerConfig sc = state.scheduler.value_or(SchedulerConfig{});
    PyValue* d = sched.get();
    torchfmt::DictSet(d, "max_lr", torchfmt::MakeFloat(state.scheduler ? sc.max_lr : lr));
    torchfmt::DictSet(d, "lr_warmup_steps", torchfmt::MakeInt(sc.warmup_steps));
    torchfmt::DictSet(d, "num_steps", torchfmt::MakeInt(state.scheduler_num_steps));
    torchfmt::DictSet(d, "lr_decay_style", torchfmt::MakeStr(sc.decay_style));
    torchfmt::DictSet(d, "lr_decay_steps", torchfmt::MakeInt(sc.decay_steps));
    torchfmt::DictSet(d, "min_lr", torchfmt::MakeFloat(state.scheduler ? sc.min_lr : min_lr));
    torchfmt::DictSet(d, "start_wd", torchfmt::MakeFloat(sc.start_wd));
    torchfmt::DictSet(d, "end_wd", torchfmt::MakeFloat(sc.end_wd));
    torchfmt::DictSet(d, "wd_incr_style", torchfmt::MakeStr(sc.wd_incr_style));
    torchfmt::DictSet(d, "wd_incr_steps", torchfmt::MakeInt(sc.wd_incr_steps));
  }

  // The iteration's directory, written aside and renamed into place.
  PTK_RETURN_IF_ERROR(MakeDirs(o.save_dir));
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(JoinPath(o.save_dir, "ptk-convert")));
  const std::string final_dir = JoinPath(o.save_dir, fmt::format("iter_{:07d}", state.iteration));
  const std::string tmp_dir = fmt::format("{}.ptk-tmp-{}", final_dir, ::getpid());
  const std::string old_dir = fmt::format("{}.ptk-old-{}", final_dir, ::getpid());
  absl::Status st = [&]() -> absl::Status {
    PTK_RETURN_IF_ERROR(RemoveAll(tmp_dir));
    for (int64_t p = 0; p < pp; ++p)
      for (int64_t t = 0; t < tp; ++t) {
        const std::string dir = JoinPath(tmp_dir, RankDir(t, p, pp));
        PTK_RETURN_IF_ERROR(MakeDirs(dir));
        std::vector<torchfmt::StorageBlob> blobs;
        PyRef model = torchfmt::MakeDict();
        // The optimizer's parameter groups (indices) and state, in Megatron's order.
        std::vector<PyRef> decay_ids, no_decay_ids;
        struct Pending {
          std::vector<float> w, a, b;
          std::vector<int64_t> shape;
          bool decay;
          std::string name;
        };
        std::vector<Pending> pend;
        auto shard_of = [&](const MegParam& m, const std::vector<float>& src, bool pad_copy) {
          const std::vector<int64_t>& shape = m.info->shape;
          const int64_t rows = m.vocab ? vm : shape[0], cols = shape.size() > 1 ? shape[1] : 1;
          std::vector<float> full;
          const float* base = src.data() + m.info->offset;
          if (m.vocab) {
            full.assign(static_cast<size_t>(rows * cols), 0.0f);
            std::copy(base, base + m.info->size, full.begin());
            if (pad_copy)
              for (int64_t r = c.padded_vocab_size; r < vm; ++r)
                std::copy(base + (c.vocab_size - 1) * cols, base + c.vocab_size * cols, full.begin() + r * cols);
          } else {
            full.assign(base, base + m.info->size);
          }
          std::vector<float> out(static_cast<size_t>(rows * cols / (m.split >= 0 ? tp : 1)));
          CopyShard(full.data(), out.data(), rows, cols, m.split, m.split >= 0 ? t : 0, m.split >= 0 ? tp : 1,
                    /*gather=*/false);
          return out;
        };
        auto add = [&](const MegParam& m, const std::string& name) {
          Pending pd;
          pd.name = name;
          pd.shape = ShardShape(m, vm, tp);
          pd.w = shard_of(m, params, true);
          pd.a = shard_of(m, m1, false);
          pd.b = shard_of(m, m2, false);
          pd.decay = m.decay;
          pend.push_back(std::move(pd));
        };
        const MegParam* wte = nullptr;
        for (const MegParam& m : mparams)
          if (m.info->name == "embedding.word_embeddings.weight") wte = &m;
        for (const MegParam* m : StageOrder(mparams, p, te)) add(*m, te ? m->te_name : m->local_name);
        if (tied_copy && p == pp - 1) add(*wte, "output_layer.weight");
        // Megatron's parameter order: named_parameters; groups: weights first, then 1-D ones.
        int64_t next = 0;
        std::vector<int64_t> ids(pend.size());
        for (size_t i = 0; i < pend.size(); ++i)
          if (pend[i].decay) ids[i] = next++;
        for (size_t i = 0; i < pend.size(); ++i)
          if (!pend[i].decay) ids[i] = next++;
        PyRef adam_state = torchfmt::MakeDict();
        std::vector<std::pair<int64_t, PyRef>> by_id;
        int key = 0;
        auto tensor = [&](const std::vector<float>& data, const std::vector<int64_t>& shape, DType dtype) {
          const std::string k = std::to_string(key++);
          blobs.push_back(torchfmt::MakeBlob(k, dtype, data.data(), static_cast<int64_t>(data.size())));
          return torchfmt::MakeTensor(k, dtype, shape);
        };
        std::vector<PyRef> masters_decay, masters_no_decay;  // fp32_from_fp16_params, by group
        auto extra = [&](const std::string& module) {
          torchfmt::DictSet(model.get(), module + "._extra_state", torchfmt::MakeNone());
        };
        for (size_t i = 0; i < pend.size(); ++i) {
          Pending& pd = pend[i];
          torchfmt::DictSet(model.get(), pd.name, tensor(pd.w, pd.shape, model_dtype));
          if (mixed) (pd.decay ? masters_decay : masters_no_decay).push_back(tensor(pd.w, pd.shape, DType::kFloat32));
          std::vector<float>().swap(pd.w);  // the blob holds the bytes now
          // Megatron's linear layers carry an (empty) extra state, after their bias.
          static const std::regex kLinear(R"((.*\.(linear_qkv|linear_proj|linear_fc1|linear_fc2))\.bias)");
          std::smatch mm;
          if (std::regex_match(pd.name, mm, kLinear)) {
            if (te && mm[2] == "linear_proj") extra(mm[1].str().substr(0, mm[1].str().size() - 11) + "core_attention");
            extra(mm[1].str());
          }
          if (pd.name == "output_layer.weight") extra("output_layer");
          (pd.decay ? decay_ids : no_decay_ids).push_back(torchfmt::MakeInt(ids[i]));
          if (with_moments) {
            PyRef entry = torchfmt::MakeDict();
            PyRef step = tensor({static_cast<float>(state.adam_step)}, {}, DType::kFloat32);
            torchfmt::DictSet(entry.get(), "step", step);
            torchfmt::DictSet(entry.get(), "exp_avg", tensor(pd.a, pd.shape, DType::kFloat32));
            torchfmt::DictSet(entry.get(), "exp_avg_sq", tensor(pd.b, pd.shape, DType::kFloat32));
            std::vector<float>().swap(pd.a);
            std::vector<float>().swap(pd.b);
            by_id.emplace_back(ids[i], entry);
          }
        }
        std::sort(by_id.begin(), by_id.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
        for (auto& [id, entry] : by_id) torchfmt::DictSet(adam_state.get(), torchfmt::MakeInt(id), entry);
        if (p == pp - 1 && !c.untie_embeddings_and_output_weights && pp == 1) extra("output_layer");
        auto group = [&](std::vector<PyRef> ids_list, double wd_mult) {
          PyRef g = torchfmt::MakeDict();
          PyValue* d = g.get();
          torchfmt::DictSet(d, "lr", torchfmt::MakeFloat(lr));
          torchfmt::DictSet(d, "betas", torchfmt::MakeTuple({torchfmt::MakeFloat(b1), torchfmt::MakeFloat(b2)}));
          torchfmt::DictSet(d, "eps", torchfmt::MakeFloat(eps));
          torchfmt::DictSet(d, "weight_decay", torchfmt::MakeFloat(wd * wd_mult));
          torchfmt::DictSet(d, "amsgrad", torchfmt::MakeBool(false));
          torchfmt::DictSet(d, "maximize", torchfmt::MakeBool(false));
          torchfmt::DictSet(d, "foreach", torchfmt::MakeNone());
          torchfmt::DictSet(d, "capturable", torchfmt::MakeBool(false));
          torchfmt::DictSet(d, "differentiable", torchfmt::MakeBool(false));
          torchfmt::DictSet(d, "fused", torchfmt::MakeNone());
          torchfmt::DictSet(d, "is_expert_parallel", torchfmt::MakeBool(false));
          torchfmt::DictSet(d, "default_config", torchfmt::MakeBool(true));
          torchfmt::DictSet(d, "wd_mult", torchfmt::MakeFloat(wd_mult));
          torchfmt::DictSet(d, "lr_mult", torchfmt::MakeFloat(1.0));
          torchfmt::DictSet(d, "is_decoupled_lr", torchfmt::MakeBool(false));
          torchfmt::DictSet(d, "max_lr", torchfmt::MakeFloat(lr));
          torchfmt::DictSet(d, "min_lr", torchfmt::MakeFloat(min_lr));
          torchfmt::DictSet(d, "params", torchfmt::MakeList(std::move(ids_list)));
          return g;
        };
        PyRef optimizer = torchfmt::MakeDict();
        torchfmt::DictSet(optimizer.get(), "state", adam_state);
        torchfmt::DictSet(optimizer.get(), "param_groups",
                          torchfmt::MakeList({group(decay_ids, 1.0), group(no_decay_ids, 0.0)}));
        if (mixed) {  // Float16OptimizerWithFloat16Params.state_dict
          PyRef wrapped = torchfmt::MakeDict();
          torchfmt::DictSet(wrapped.get(), "optimizer", optimizer);
          if (precision == "fp16") {
            const LossScaleState ls = state.loss_scale.value_or(LossScaleState{});
            PyRef gs = torchfmt::MakeDict();
            torchfmt::DictSet(gs.get(), "scale", tensor({static_cast<float>(ls.scale)}, {1}, DType::kFloat32));
            torchfmt::DictSet(gs.get(), "growth_tracker", torchfmt::MakeInt(ls.growth_tracker));
            torchfmt::DictSet(gs.get(), "hysteresis_tracker", torchfmt::MakeInt(ls.hysteresis_tracker));
            torchfmt::DictSet(wrapped.get(), "grad_scaler", gs);
          }
          torchfmt::DictSet(wrapped.get(), "fp32_from_fp16_params",
                            torchfmt::MakeList({torchfmt::MakeList(std::move(masters_decay)),
                                                torchfmt::MakeList(std::move(masters_no_decay))}));
          optimizer = wrapped;
        }
        PyRef root = torchfmt::MakeDict();
        PyValue* r = root.get();
        torchfmt::DictSet(r, "args", args);
        torchfmt::DictSet(r, "checkpoint_version", torchfmt::MakeFloat(3.0));
        torchfmt::DictSet(r, "iteration", torchfmt::MakeInt(state.iteration));
        torchfmt::DictSet(r, "model", model);
        torchfmt::DictSet(r, "optimizer", optimizer);
        torchfmt::DictSet(r, "opt_param_scheduler", sched);
        torchfmt::DictSet(r, "num_floating_point_operations_so_far", torchfmt::MakeInt(0));
        PTK_RETURN_IF_ERROR(torchfmt::WriteTorchFile(JoinPath(dir, kFile), *root, blobs));
        PTK_RETURN_IF_ERROR(FsyncDir(dir));
      }
    PTK_RETURN_IF_ERROR(FsyncDir(tmp_dir));
    const bool replacing = PathExists(final_dir);
    if (replacing) {
      PTK_RETURN_IF_ERROR(RemoveAll(old_dir));
      PTK_RETURN_IF_ERROR(RenameFile(final_dir, old_dir));
    }
    PTK_RETURN_IF_ERROR(RenameFile(tmp_dir, final_dir));
    PTK_RETURN_IF_ERROR(FsyncDir(o.save_dir));
    if (replacing) PTK_RETURN_IF_ERROR(RemoveAll(old_dir));
    PTK_ASSIGN_OR_RETURN(auto w, AtomicFileWriter::Create(JoinPath(o.save_dir, kTracker)));
    PTK_RETURN_IF_ERROR(w->Write(std::to_string(state.iteration)));
    return w->Commit();
  }();
  if (!st.ok()) {
    absl::Status undo = RemoveAll(tmp_dir);
    if (!undo.ok()) log::Warning("after a failed save: {}", StatusMessage(undo));
    if (!PathExists(final_dir) && PathExists(old_dir)) (void)RenameFile(old_dir, final_dir);
    return st;
  }
  s.destination = final_dir;
  s.config = c;
  s.num_params = layout.num_params;
  if (vm > c.padded_vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary is padded from {} to {} rows (a multiple of {} x {} tensor-parallel "
                    "ranks, as Megatron pads it) with copies of the last token's row",
                    c.padded_vocab_size, vm, o.make_vocab_size_divisible_by, tp));
  s.notes.push_back(fmt::format(
      "wrote {} tensor- x {} pipeline-parallel shards ({} layer names) as a{} run with Megatron's plain optimizer "
      "saves them{}; no rng_state (ptk's generators are not PyTorch's): Megatron loads it with --ckpt-format torch "
      "--no-load-rng{}",
      tp, pp, te ? "Transformer Engine" : "local",
      mixed ? fmt::format(" --{} (fp32 masters in the optimizer)", precision) : "n fp32",
      with_moments ? ", AdamW moments included" : ", no AdamW step yet", mixed ? fmt::format(" --{}", precision) : ""));
  return s;
}

}  // namespace ptk
