// ptk checkpoint -> Megatron-LM `torch` checkpoint: split at the target sizes, as Megatron saves it.
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

// The optimizer's hyperparameters, as the ptk run recorded them.
struct Hyper {
  double lr = 0, min_lr = 0, wd = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8;
};
Hyper HyperOf(const TrainState& state) {
  Hyper h;
  h.lr = state.scheduler ? state.scheduler->max_lr : SettingNum(state, "--lr", 0);
  h.min_lr = state.scheduler ? state.scheduler->min_lr : SettingNum(state, "--min-lr", 0);
  h.wd = SettingNum(state, "--weight-decay", 0.01);
  h.b1 = SettingNum(state, "--adam-beta1", 0.9);
  h.b2 = SettingNum(state, "--adam-beta2", 0.999);
  h.eps = SettingNum(state, "--adam-eps", 1e-8);
  return h;
}

// The args Namespace: what Megatron's load checks (check_checkpoint_args) and its converter reads.
PyRef MegatronArgs(const ConvertOptions& o, const GPTConfig& c, const TrainState& state, const Hyper& h, int64_t vm,
                   const std::string& precision, int64_t vp) {
  const int64_t tp = o.target_tensor_parallel_size, pp = o.target_pipeline_parallel_size;
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
  set_b("group_query_attention", c.query_groups() != c.num_attention_heads);
  set_i("num_query_groups", c.query_groups());
  set_i("max_position_embeddings", c.max_position_embeddings);
  set_i("seq_length", c.seq_length);
  set_s("position_embedding_type", c.rope()                                           ? "rope"
                                   : c.position_embedding == PositionEmbedding::kNone ? "none"
                                                                                      : "learned_absolute");
  set_b("add_position_embedding", c.position_embedding == PositionEmbedding::kLearnedAbsolute);
  set_f("rotary_base", c.rotary_base);
  set_f("rotary_percent", c.rotary_percent);
  set_b("rotary_interleaved", false);
  set_b("use_rope_scaling", c.use_rope_scaling);
  set_f("rope_scaling_factor", 8.0);
  set_s("normalization", c.normalization == Normalization::kRMSNorm ? "RMSNorm" : "LayerNorm");
  set_f("norm_epsilon", c.layernorm_epsilon);
  set_f("layernorm_epsilon", c.layernorm_epsilon);  // the name of Megatron-LM before --norm-epsilon
  set_b("apply_layernorm_1p", c.apply_layernorm_1p);
  set_b("apply_residual_connection_post_layernorm", false);
  set_b("swiglu", c.swiglu);
  set_b("add_bias_linear", c.add_bias_linear);
  set_b("add_qkv_bias", c.qkv_bias());
  set_b("qk_layernorm", c.qk_layernorm);
  set_b("squared_relu", c.squared_relu);
  set_b("untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights);
  set_f("hidden_dropout", c.hidden_dropout);
  set_f("attention_dropout", c.attention_dropout);
  set_f("init_method_std", c.init_method_std);
  set_b("init_method_xavier_uniform", c.init_method_xavier_uniform);
  set_i("vocab_size", c.vocab_size);
  set_i("padded_vocab_size", vm);
  set_i("make_vocab_size_divisible_by", o.make_vocab_size_divisible_by);
  set_s("tokenizer_type", "GPT2BPETokenizer");
  set_i("tensor_model_parallel_size", tp);
  set_i("pipeline_model_parallel_size", pp);
  if (vp > 1) {  // as Megatron's arguments.py derives it from --num-layers-per-virtual-pipeline-stage
    set_i("virtual_pipeline_model_parallel_size", vp);
    set_i("num_layers_per_virtual_pipeline_stage", o.target_num_layers_per_virtual_pipeline_stage);
  } else {
    set_none("virtual_pipeline_model_parallel_size");
    set_none("num_layers_per_virtual_pipeline_stage");
  }
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
  set_f("lr", h.lr);
  set_f("min_lr", h.min_lr);
  set_s("lr_decay_style",
        state.scheduler ? state.scheduler->decay_style : SettingStr(state, "--lr-decay-style", "linear"));
  set_f("weight_decay", h.wd);
  set_f("adam_beta1", h.b1);
  set_f("adam_beta2", h.b2);
  set_f("adam_eps", h.eps);
  set_f("clip_grad", SettingNum(state, "--clip-grad", 1.0));
  return torchfmt::MakeNamespace(ns_attrs);
}

// opt_param_scheduler's state_dict.
PyRef SchedulerState(const TrainState& state, const Hyper& h) {
  PyRef sched = torchfmt::MakeDict();
  const SchedulerConfig sc = state.scheduler.value_or(SchedulerConfig{});
  PyValue* d = sched.get();
  torchfmt::DictSet(d, "max_lr", torchfmt::MakeFloat(state.scheduler ? sc.max_lr : h.lr));
  torchfmt::DictSet(d, "lr_warmup_steps", torchfmt::MakeInt(sc.warmup_steps));
  torchfmt::DictSet(d, "num_steps", torchfmt::MakeInt(state.scheduler_num_steps));
  torchfmt::DictSet(d, "lr_decay_style", torchfmt::MakeStr(sc.decay_style));
  torchfmt::DictSet(d, "lr_decay_steps", torchfmt::MakeInt(sc.decay_steps));
  torchfmt::DictSet(d, "min_lr", torchfmt::MakeFloat(state.scheduler ? sc.min_lr : h.min_lr));
  torchfmt::DictSet(d, "start_wd", torchfmt::MakeFloat(sc.start_wd));
  torchfmt::DictSet(d, "end_wd", torchfmt::MakeFloat(sc.end_wd));
  torchfmt::DictSet(d, "wd_incr_style", torchfmt::MakeStr(sc.wd_incr_style));
  torchfmt::DictSet(d, "wd_incr_steps", torchfmt::MakeInt(sc.wd_incr_steps));
  return sched;
}

// One AdamW parameter group as Megatron's optimizer saves it.
PyRef AdamGroup(std::vector<PyRef> ids_list, double wd_mult, const Hyper& h) {
  PyRef g = torchfmt::MakeDict();
  PyValue* d = g.get();
  torchfmt::DictSet(d, "lr", torchfmt::MakeFloat(h.lr));
  torchfmt::DictSet(d, "betas", torchfmt::MakeTuple({torchfmt::MakeFloat(h.b1), torchfmt::MakeFloat(h.b2)}));
  torchfmt::DictSet(d, "eps", torchfmt::MakeFloat(h.eps));
  torchfmt::DictSet(d, "weight_decay", torchfmt::MakeFloat(h.wd * wd_mult));
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
  torchfmt::DictSet(d, "max_lr", torchfmt::MakeFloat(h.lr));
  torchfmt::DictSet(d, "min_lr", torchfmt::MakeFloat(h.min_lr));
  torchfmt::DictSet(d, "params", torchfmt::MakeList(std::move(ids_list)));
  return g;
}

// One parameter's shard on the rank being written: weight, moments, shape, group.
struct Pending {
  std::vector<float> w, a, b;
  std::vector<int64_t> shape;
  bool decay;
  std::string name;
  int64_t chunk = 0;  // the model chunk (modelN) of an interleaved run
};

// Writes the ptk checkpoint as Megatron's shards (mp_rank_TT[_PPP]/model_optim_rng.pt).
struct Export {
  Export(const ConvertOptions& o_, const GPTConfig& c_, const TrainState& state_, const std::vector<float>& params_,
         const std::vector<float>& m1_, const std::vector<float>& m2_)
      : o(o_), c(c_), state(state_), params(params_), m1(m1_), m2(m2_) {}
  const ConvertOptions& o;
  const GPTConfig& c;
  const TrainState& state;
  const std::vector<float>& params;
  const std::vector<float>& m1;
  const std::vector<float>& m2;
  std::vector<MegParam> mparams;
  int64_t tp = 1, pp = 1, vm = 0;  // vm: the vocabulary padded for tp ranks
  int64_t vp = 1;                  // model chunks per rank: mparams' stage is v * pp + p
  bool te = false, tied_copy = false, with_moments = false, mixed = false;
  std::string precision;
  DType model_dtype = DType::kFloat32;
  Hyper h;
  PyRef args, sched;

  // Rank t's slice of m out of the whole of src (ptk's rows; the vocabulary padded to vm, the pad
  // rows copies of the last token's where pad_copy).
  std::vector<float> ShardOf(const MegParam& m, const std::vector<float>& src, bool pad_copy, int64_t t) const {
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
              /*gather=*/false, m.chunks);
    return out;
  }

  // The parameters of stage p in Megatron's order (named_parameters, chunk after chunk), with the
  // last (virtual) stage's copy of a tied embedding.
  std::vector<Pending> StageShards(int64_t t, int64_t p) const {
    std::vector<Pending> pend;
    int64_t chunk = 0;
    auto add = [&](const MegParam& m, const std::string& name) {
      Pending pd;
      pd.chunk = chunk;
      pd.name = name;
      pd.shape = ShardShape(m, vm, tp);
      pd.w = ShardOf(m, params, true, t);
      pd.a = ShardOf(m, m1, false, t);
      pd.b = ShardOf(m, m2, false, t);
      pd.decay = m.decay;
      pend.push_back(std::move(pd));
    };
    const MegParam* wte = nullptr;
    for (const MegParam& m : mparams)
      if (m.info->name == "embedding.word_embeddings.weight") wte = &m;
    for (chunk = 0; chunk < vp; ++chunk) {
      const int64_t vs = chunk * pp + p;
      for (const MegParam* m : StageOrder(mparams, vs, te)) add(*m, te ? m->te_name : m->local_name);
      if (tied_copy && vs == pp * vp - 1) add(*wte, "output_layer.weight");
    }
    return pend;
  }

  // Rank (t, p)'s model_optim_rng.pt into dir.
  absl::Status WriteRank(int64_t t, int64_t p, const std::string& dir) const {
    std::vector<torchfmt::StorageBlob> blobs;
    int key = 0;
    auto tensor = [&](const std::vector<float>& data, const std::vector<int64_t>& shape, DType dtype) {
      const std::string k = std::to_string(key++);
      blobs.push_back(torchfmt::MakeBlob(k, dtype, data.data(), static_cast<int64_t>(data.size())));
      return torchfmt::MakeTensor(k, dtype, shape);
    };
    std::vector<Pending> pend = StageShards(t, p);
    // Megatron's parameter order: named_parameters; groups: weights first, then 1-D ones.
    int64_t next = 0;
    std::vector<int64_t> ids(pend.size());
    for (size_t i = 0; i < pend.size(); ++i)
      if (pend[i].decay) ids[i] = next++;
    for (size_t i = 0; i < pend.size(); ++i)
      if (!pend[i].decay) ids[i] = next++;
    std::vector<PyRef> models;  // "model", or one per chunk
    for (int64_t v = 0; v < vp; ++v) models.push_back(torchfmt::MakeDict());
    PyRef model = models[0];
    auto extra = [&](const std::string& module) {
      torchfmt::DictSet(model.get(), module + "._extra_state", torchfmt::MakeNone());
    };
    std::vector<PyRef> decay_ids, no_decay_ids;          // the optimizer's groups (indices)
    std::vector<PyRef> masters_decay, masters_no_decay;  // fp32_from_fp16_params, by group
    std::vector<std::pair<int64_t, PyRef>> by_id;        // AdamW's state, by index
    for (size_t i = 0; i < pend.size(); ++i) {
      Pending& pd = pend[i];
      model = models[static_cast<size_t>(pd.chunk)];
      torchfmt::DictSet(model.get(), pd.name, tensor(pd.w, pd.shape, model_dtype));
      if (mixed) (pd.decay ? masters_decay : masters_no_decay).push_back(tensor(pd.w, pd.shape, DType::kFloat32));
      std::vector<float>().swap(pd.w);  // the blob holds the bytes now
      // Megatron's linear layers carry an (empty) extra state, after their last parameter (the bias, or
      // the weight of a layer without one).
      static const std::regex kLinear(R"((.*\.(linear_qkv|linear_proj|linear_fc1|linear_fc2))\.(weight|bias))");
      std::smatch mm;
      if (std::regex_match(pd.name, mm, kLinear) &&
          (mm[3] == "bias") == (mm[2] == "linear_qkv" ? c.qkv_bias() : c.add_bias_linear)) {
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
    if (p == pp - 1 && !c.untie_embeddings_and_output_weights && pp * vp == 1) extra("output_layer");
    std::sort(by_id.begin(), by_id.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    PyRef adam_state = torchfmt::MakeDict();
    for (auto& [id, entry] : by_id) torchfmt::DictSet(adam_state.get(), torchfmt::MakeInt(id), entry);
    PyRef optimizer = torchfmt::MakeDict();
    torchfmt::DictSet(optimizer.get(), "state", adam_state);
    torchfmt::DictSet(optimizer.get(), "param_groups",
                      torchfmt::MakeList({AdamGroup(decay_ids, 1.0, h), AdamGroup(no_decay_ids, 0.0, h)}));
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
    if (vp == 1) {
      torchfmt::DictSet(r, "model", models[0]);
    } else {  // Megatron's save_checkpoint: state_dict["model%d" % i] per model chunk
      for (int64_t v = 0; v < vp; ++v) torchfmt::DictSet(r, fmt::format("model{}", v), models[static_cast<size_t>(v)]);
    }
    torchfmt::DictSet(r, "optimizer", optimizer);
    torchfmt::DictSet(r, "opt_param_scheduler", sched);
    torchfmt::DictSet(r, "num_floating_point_operations_so_far", torchfmt::MakeInt(0));
    PTK_RETURN_IF_ERROR(torchfmt::WriteTorchFile(JoinPath(dir, kFile), *root, blobs));
    return FsyncDir(dir);
  }

  // Every rank's file into tmp_dir, then tmp_dir renamed to final_dir (an old one set aside at
  // old_dir until then) and the tracker pointed at it.
  absl::Status WriteAndPublish(const std::string& tmp_dir, const std::string& final_dir,
                               const std::string& old_dir) const {
    PTK_RETURN_IF_ERROR(RemoveAll(tmp_dir));
    for (int64_t p = 0; p < pp; ++p)
      for (int64_t t = 0; t < tp; ++t) {
        const std::string dir = JoinPath(tmp_dir, RankDir(t, p, pp));
        PTK_RETURN_IF_ERROR(MakeDirs(dir));
        PTK_RETURN_IF_ERROR(WriteRank(t, p, dir));
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
  }
};

}  // namespace

absl::StatusOr<ConvertSummary> ExportToMegatron(const ConvertOptions& o) {
  ConvertSummary s;
  const int64_t tp = o.target_tensor_parallel_size, pp = o.target_pipeline_parallel_size;
  if (o.saver_transformer_impl != "transformer_engine" && o.saver_transformer_impl != "local")
    return UsageError(
        fmt::format("--saver-transformer-impl {}: transformer_engine or local", o.saver_transformer_impl));
  PTK_ASSIGN_OR_RETURN(PtkCheckpoint ck, LoadPtkCheckpoint(o.load_dir, o.true_vocab_size));
  const GPTConfig& c = ck.config;
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
  if (c.num_attention_heads % tp != 0 || c.ffn_hidden_size % tp != 0 || c.query_groups() % tp != 0)
    return UsageError(
        fmt::format("--target-tensor-parallel-size {} does not divide the {} heads, {} query groups and ffn {}", tp,
                    c.num_attention_heads, c.query_groups(), c.ffn_hidden_size));
  int64_t vp = 1;
  if (const int64_t n = o.target_num_layers_per_virtual_pipeline_stage; n > 0) {
    // Megatron's checks (arguments.py): pipeline parallelism, and chunks that divide each stage's layers.
    if (pp < 2)
      return UsageError(
          fmt::format("--target-num-layers-per-virtual-pipeline-stage {}: the interleaved schedule needs "
                      "--target-pipeline-parallel-size 2 or more",
                      n));
    if (c.num_layers % pp != 0 || (c.num_layers / pp) % n != 0)
      return UsageError(
          fmt::format("--target-num-layers-per-virtual-pipeline-stage {} does not divide the {} layers "
                      "of each of {} pipeline stages ({} layers)",
                      n, c.num_layers / pp, pp, c.num_layers));
    vp = c.num_layers / pp / n;
  }
  Export ex(o, c, state, params, m1, m2);
  ex.tp = tp;
  ex.pp = pp;
  ex.vp = vp;
  ex.vm = PaddedVocabSize(c.vocab_size, o.make_vocab_size_divisible_by * tp);
  if (c.num_layers % pp != 0)
    return UsageError(
        fmt::format("--target-pipeline-parallel-size {} does not divide the model's {} layers", pp, c.num_layers));
  PTK_ASSIGN_OR_RETURN(ex.mparams, MegParams(layout, pp * vp));
  ex.te = o.saver_transformer_impl == "transformer_engine";
  ex.tied_copy = !c.untie_embeddings_and_output_weights && pp * vp > 1;
  ex.with_moments = state.adam_step > 0;
  // As the saving run trained: fp32, or bf16/fp16 model weights with the fp32 masters in the optimizer.
  ex.precision = SettingStr(state, "--bf16/--fp16", "fp32");
  ex.mixed = ex.precision == "bf16" || ex.precision == "fp16";
  ex.model_dtype = ex.precision == "bf16"   ? DType::kBFloat16
                   : ex.precision == "fp16" ? DType::kFloat16
                                            : DType::kFloat32;
  ex.h = HyperOf(state);
  ex.args = MegatronArgs(o, c, state, ex.h, ex.vm, ex.precision, vp);
  ex.sched = SchedulerState(state, ex.h);

  // The iteration's directory, written aside and renamed into place.
  PTK_RETURN_IF_ERROR(MakeDirs(o.save_dir));
  PTK_ASSIGN_OR_RETURN(auto lock, OutputLock::Acquire(JoinPath(o.save_dir, "ptk-convert")));
  const std::string final_dir = JoinPath(o.save_dir, fmt::format("iter_{:07d}", state.iteration));
  const std::string tmp_dir = fmt::format("{}.ptk-tmp-{}", final_dir, ::getpid());
  const std::string old_dir = fmt::format("{}.ptk-old-{}", final_dir, ::getpid());
  if (absl::Status st = ex.WriteAndPublish(tmp_dir, final_dir, old_dir); !st.ok()) {
    absl::Status undo = RemoveAll(tmp_dir);
    if (!undo.ok()) log::Warning("after a failed save: {}", StatusMessage(undo));
    if (!PathExists(final_dir) && PathExists(old_dir)) (void)RenameFile(old_dir, final_dir);
    return st;
  }
  s.destination = final_dir;
  s.config = c;
  s.num_params = layout.num_params;
  if (ex.vm > c.padded_vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary is padded from {} to {} rows (a multiple of {} x {} tensor-parallel "
                    "ranks, as Megatron pads it) with copies of the last token's row",
                    c.padded_vocab_size, ex.vm, o.make_vocab_size_divisible_by, tp));
  s.notes.push_back(fmt::format(
      "wrote {} tensor- x {} pipeline-parallel shards{} ({} layer names) as a{} run with Megatron's plain optimizer "
      "saves them{}; no rng_state (ptk's generators are not PyTorch's): Megatron loads it with --ckpt-format torch "
      "--no-load-rng{}",
      tp, pp,
      vp > 1 ? fmt::format(" of {} model chunks each (--num-layers-per-virtual-pipeline-stage {})", vp,
                           o.target_num_layers_per_virtual_pipeline_stage)
             : "",
      ex.te ? "Transformer Engine" : "local",
      ex.mixed ? fmt::format(" --{} (fp32 masters in the optimizer)", ex.precision) : "n fp32",
      ex.with_moments ? ", AdamW moments included" : ", no AdamW step yet",
      ex.mixed ? fmt::format(" --{}", ex.precision) : ""));
  return s;
}

}  // namespace ptk
