// ptk checkpoint -> Megatron-LM `torch` checkpoint: split at the target sizes, as Megatron saves it.
#include "interop/megatron.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
#include "common/progress.h"
#include "common/status.h"
#include "interop/megatron_common.h"
#include "interop/megatron_export_args.h"
#include "interop/megatron_optim.h"
#include "interop/torch_format.h"
#include "trainer/checkpoint.h"
#include "trainer/training_log.h"

namespace ptk {
namespace {

using torchfmt::DType;
using torchfmt::PyRef;
using torchfmt::PyValue;

constexpr char kTracker[] = "latest_checkpointed_iteration.txt";
constexpr char kFile[] = "model_optim_rng.pt";

using namespace megatron;         // NOLINT: the shared helpers
using namespace megatron_export;  // NOLINT: args, scheduler, groups

absl::Status RemoveAll(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(fmt::format("{}: cannot remove: {}", path, ec.message()));
  return absl::OkStatus();
}

// The storages of a torch.save file being built, and tensors over them.
struct BlobSink {
  std::vector<torchfmt::StorageBlob> blobs;
  PyRef Tensor(const std::vector<float>& data, const std::vector<int64_t>& shape, DType dtype) {
    const std::string k = std::to_string(blobs.size());
    blobs.push_back(torchfmt::MakeBlob(k, dtype, data.data(), static_cast<int64_t>(data.size())));
    return torchfmt::MakeTensor(k, dtype, shape);
  }
};

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
  ProgressReporter* progress = nullptr;  // counts each rank's files written
  const TrainState& state;
  const std::vector<float>& params;
  const std::vector<float>& m1;
  const std::vector<float>& m2;
  std::vector<MegParam> mparams;
  std::vector<MegBuffer> mbuffers;  // checked against state.buffers (CheckExportBuffers)
  const std::vector<float>& BufferOf(const MegBuffer& b) const {
    for (const auto& [name, values] : state.buffers)
      if (name == b.name) return values;
    static const std::vector<float> kNone;
    return kNone;
  }
  int64_t tp = 1, pp = 1, vm = 0;  // vm: the vocabulary padded for tp ranks
  int64_t vp = 1;                  // model chunks per rank: mparams' stage is v * pp + p
  bool te = false, tied_copy = false, with_moments = false, mixed = false;
  bool distopt = false;  // --target-use-distributed-optimizer
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
    BlobSink sink;
    auto tensor = [&](const std::vector<float>& data, const std::vector<int64_t>& shape, DType dtype) {
      return sink.Tensor(data, shape, dtype);
    };
    std::vector<Pending> pend = StageShards(t, p);
    if (o.target_use_distributed_optimizer) PTK_RETURN_IF_ERROR(WriteDistribOptim(p, dir, pend));
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
      if (mixed && !distopt)
        (pd.decay ? masters_decay : masters_no_decay).push_back(tensor(pd.w, pd.shape, DType::kFloat32));
      std::vector<float>().swap(pd.w);  // the blob holds the bytes now
      // Megatron's linear layers carry an (empty) extra state, after their last parameter (the bias, or
      // the weight of a layer without one).
      // MLA's projections (linear_q_proj, linear_q_down_proj, ..., linear_kv_up_proj) and MTP's eh_proj have no bias.
      static const std::regex kLinear(
          R"((.*\.(linear_qkv|linear_proj|linear_fc1|linear_fc2|linear_(q|kv)[a-z_]*_proj|eh_proj))\.(weight|bias))");
      std::smatch mm;
      if (std::regex_match(pd.name, mm, kLinear) &&
          (mm[4] == "bias") ==
              (mm[2] == "linear_qkv" ? c.qkv_bias() : !mm[3].matched && mm[2] != "eh_proj" && c.add_bias_linear)) {
        if (te && mm[2] == "linear_proj") extra(mm[1].str().substr(0, mm[1].str().size() - 11) + "core_attention");
        extra(mm[1].str());
      }
      if (pd.name == "output_layer.weight") extra("output_layer");
      (pd.decay ? decay_ids : no_decay_ids).push_back(torchfmt::MakeInt(ids[i]));
      if (with_moments && !distopt) {
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
    for (const MegBuffer& b : mbuffers)  // the routers' expert biases, fp32 on every tensor rank
      if (b.stage % pp == p)
        torchfmt::DictSet(models[static_cast<size_t>(b.stage / pp)].get(), b.local_name,
                          tensor(BufferOf(b), {b.size}, DType::kFloat32));
    std::sort(by_id.begin(), by_id.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    PyRef adam_state = torchfmt::MakeDict();
    for (auto& [id, entry] : by_id) torchfmt::DictSet(adam_state.get(), torchfmt::MakeInt(id), entry);
    PyRef optimizer = OptimizerDict(
        adam_state, {AdamGroup(decay_ids, 1.0, h), AdamGroup(no_decay_ids, 0.0, h)},
        {torchfmt::MakeList(std::move(masters_decay)), torchfmt::MakeList(std::move(masters_no_decay))}, sink);
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
    PTK_RETURN_IF_ERROR(torchfmt::WriteTorchFile(JoinPath(dir, kFile), *root, sink.blobs));
    return FsyncDir(dir);
  }

  // The optimizer's state_dict in model_optim_rng.pt: torch Adam's (`adam_state` by index, `groups`),
  // wrapped by Float16OptimizerWithFloat16Params with the fp32 `masters` by group in a --bf16/--fp16
  // run; or DistributedOptimizer.state_dict's: the groups without their parameters, Adam's step in
  // each (the rest is in distrib_optim.pt).
  PyRef OptimizerDict(PyRef adam_state, std::vector<PyRef> groups, std::vector<PyRef> masters, BlobSink& sink) const {
    PyRef optimizer = torchfmt::MakeDict();
    if (distopt) {
      for (PyRef& g : groups) {
        auto& d = g->dict;
        d.erase(std::remove_if(d.begin(), d.end(), [](const auto& kv) { return kv.first->s == "params"; }), d.end());
        torchfmt::DictSet(g.get(), "step", torchfmt::MakeInt(state.adam_step));
      }
    } else {
      torchfmt::DictSet(optimizer.get(), "state", adam_state);
    }
    torchfmt::DictSet(optimizer.get(), "param_groups", torchfmt::MakeList(std::move(groups)));
    if (!mixed && !distopt) return optimizer;
    PyRef wrapped = torchfmt::MakeDict();
    torchfmt::DictSet(wrapped.get(), "optimizer", optimizer);
    if (precision == "fp16") {  // the loss scaler's state_dict
      const LossScaleState ls = state.loss_scale.value_or(LossScaleState{});
      PyRef gs = torchfmt::MakeDict();
      torchfmt::DictSet(gs.get(), "scale", sink.Tensor({static_cast<float>(ls.scale)}, {1}, DType::kFloat32));
      torchfmt::DictSet(gs.get(), "growth_tracker", torchfmt::MakeInt(ls.growth_tracker));
      torchfmt::DictSet(gs.get(), "hysteresis_tracker", torchfmt::MakeInt(ls.hysteresis_tracker));
      torchfmt::DictSet(wrapped.get(), "grad_scaler", gs);
    }
    if (!distopt) torchfmt::DictSet(wrapped.get(), "fp32_from_fp16_params", torchfmt::MakeList(std::move(masters)));
    return wrapped;
  }

  // Rank (t, p)'s distrib_optim.pt into dir, as DistributedOptimizer.save_parameter_state writes it at
  // data-parallel size 1: one grad buffer per model chunk (keys 0 .. vp-1), {(param dtype, grad dtype):
  // the fp32 params and AdamW moments where megatron-core's grad buffer puts them, numel_unpadded}; one
  // bucket unless --target-ddp-bucket-size (args: --overlap-grad-reduce --ddp-bucket-size).
  absl::Status WriteDistribOptim(int64_t p, const std::string& dir, const std::vector<Pending>& pend) const {
    BlobSink sink;
    PyRef root = torchfmt::MakeDict();
    torchfmt::DictSet(root.get(), "buckets_coalesced", torchfmt::MakeBool(true));
    // Megatron-LM's grad dtype: fp32 under --bf16 (accumulate_allreduce_grads_in_fp32), else the params'.
    const std::string param_dtype = precision == "bf16"   ? "torch.bfloat16"
                                    : precision == "fp16" ? "torch.float16"
                                                          : "torch.float32";
    const std::string grad_dtype = precision == "bf16" ? "torch.float32" : param_dtype;
    const std::vector<DistribBuffer> buffers =
        RankDistribBuffers(mparams, p, pp, vp, te, tied_copy, vm, tp, c.hidden_size, args.get());
    for (int64_t v = 0; v < vp; ++v) {
      std::map<std::string, int64_t> offset;
      const DistribBuffer& b = buffers[static_cast<size_t>(v)];
      const int64_t total = DistribLayout(b.params, b.bucket_size, &offset);
      std::vector<float> world[3];
      for (auto& w : world) w.assign(static_cast<size_t>(total), 0.0f);
      for (const Pending& pd : pend) {
        if (pd.chunk != v) continue;
        const int64_t at = offset.at(vp > 1 ? fmt::format("model{}.{}", v, pd.name) : pd.name);
        std::copy(pd.w.begin(), pd.w.end(), world[0].begin() + at);
        std::copy(pd.a.begin(), pd.a.end(), world[1].begin() + at);
        std::copy(pd.b.begin(), pd.b.end(), world[2].begin() + at);
      }
      PyRef st = torchfmt::MakeDict();
      for (int k = 0; k < 3; ++k)
        torchfmt::DictSet(st.get(),
                          k == 0   ? "param"
                          : k == 1 ? "exp_avg"
                                   : "exp_avg_sq",
                          sink.Tensor(world[k], {total}, DType::kFloat32));
      torchfmt::DictSet(st.get(), "numel_unpadded", torchfmt::MakeInt(total));
      PyRef by_dtype = torchfmt::MakeDict();
      torchfmt::DictSet(by_dtype.get(),
                        torchfmt::MakeTuple({torchfmt::MakeGlobal(param_dtype), torchfmt::MakeGlobal(grad_dtype)}), st);
      torchfmt::DictSet(root.get(), torchfmt::MakeInt(v), by_dtype);
    }
    return torchfmt::WriteTorchFile(JoinPath(dir, "distrib_optim.pt"), *root, sink.blobs);
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
        if (progress != nullptr) {
          progress->AddItems(1);
          for (const char* name : {kFile, "distrib_optim.pt"})
            if (auto size = FileSize(JoinPath(dir, name)); size.ok()) progress->AddBytes(*size);
          progress->Refresh();  // on a terminal the line says each rank as it is written
        }
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

// What the summary says was written, and the flags Megatron loads it with.
std::string WroteNote(const Export& ex) {
  const ConvertOptions& o = ex.o;
  return fmt::format(
      "wrote {} tensor- x {} pipeline-parallel shards{} ({} layer names) as a{} run with Megatron's {} saves them{}; "
      "no "
      "rng_state (ptk's generators are not PyTorch's): Megatron loads it with --ckpt-format torch --no-load-rng{}{}",
      ex.tp, ex.pp,
      ex.vp > 1 ? fmt::format(" of {} model chunks each (--num-layers-per-virtual-pipeline-stage {})", ex.vp,
                              o.target_num_layers_per_virtual_pipeline_stage)
                : "",
      ex.te ? "Transformer Engine" : "local",
      ex.mixed ? fmt::format(" --{} ({})", ex.precision,
                             ex.distopt ? "fp32 params in distrib_optim.pt" : "fp32 masters in the optimizer")
               : "n fp32",
      ex.distopt ? "distributed optimizer (--use-distributed-optimizer: distrib_optim.pt beside each shard)"
                 : "plain optimizer",
      ex.with_moments ? ", AdamW moments included" : ", no AdamW step yet",
      ex.mixed ? fmt::format(" --{}", ex.precision) : "", ex.distopt ? " --use-distributed-optimizer" : "");
}

// True while process `pid` exists on this host (EPERM: it exists, as another user's).
bool ProcessAlive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// True when `dir` holds a ptk checkpoint file (*.ptk): ptk-train's save, not an export's.
bool HoldsPtkCheckpoint(const std::string& dir) {
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
    if (it->path().extension() == ".ptk") return true;
  return false;
}

// What killed exports left beside the iteration directories of `save_dir` (a SIGKILL mid-write leaves
// iter_N.ptk-tmp-PID with a partial model_optim_rng.pt, as large as what was written; a kill between
// the two renames leaves iter_N.ptk-old-PID, the previous copy, with iter_N missing). Called under
// the directory's ptk-convert lock, so no other export writes there; ptk-train saves into its --save
// directory under the same names with a lock of its own, so only a copy whose process is gone from
// this host and which holds no ptk checkpoint file is touched: a missing iteration is renamed back
// from its old copy, the rest removed. Each is named in `notes`, and so is a live process's copy,
// left alone.
absl::Status SweepDeadExports(const std::string& save_dir, std::vector<std::string>* notes) {
  static const std::regex kLeft(R"(iter_\d{7,}\.ptk-(tmp|old)-(\d{1,9}))");
  std::vector<std::pair<std::string, pid_t>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(save_dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, kLeft)) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(m[2].str()));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (ProcessAlive(pid)) {
      notes->push_back(fmt::format("left {}: process {} is alive (a concurrent run's)", e.path().string(), pid));
      continue;
    }
    if (!HoldsPtkCheckpoint(e.path().string())) found.emplace_back(e.path().string(), pid);
  }
  if (ec) return absl::InternalError(fmt::format("{}: cannot list: {}", save_dir, ec.message()));
  std::sort(found.begin(), found.end());
  for (const auto& [path, pid] : found) {
    const std::string iter_dir = path.substr(0, path.rfind(".ptk-"));
    if (path.find(".ptk-old-") != std::string::npos && !PathExists(iter_dir)) {
      PTK_RETURN_IF_ERROR(RenameFile(path, iter_dir));
      PTK_RETURN_IF_ERROR(FsyncDir(save_dir));
      notes->push_back(fmt::format("{}: put back from {}, which a killed ptk-convert (process {}) had renamed aside",
                                   iter_dir, path, pid));
      continue;
    }
    PTK_RETURN_IF_ERROR(RemoveAll(path));
    notes->push_back(fmt::format("removed {}, left by a killed ptk-convert (process {} is gone)", path, pid));
  }
  return absl::OkStatus();
}

// The optimizer groups of the saving run, which this export writes as Megatron's two (weight decay or not): a run
// with --decoupled-lr (megatron-core keeps the embedding and output layer in a group of their own max_lr and
// min_lr) or with --apply-wd-to-qk-layernorm on query and key norms (they move to the decayed group) is refused,
// rather than written into groups a Megatron resume would read with other rates or weight decay.
absl::Status CheckExportableGroups(const TrainState& state, const GPTConfig& c, const std::string& file) {
  if (state.scheduler && state.scheduler->decoupled_lr)
    return absl::FailedPreconditionError(fmt::format(
        "{} was trained with --decoupled-lr {}: megatron-core keeps the word embeddings and output layer in a "
        "parameter group of their own (max_lr, min_lr), which the export does not write (Megatron's two groups, "
        "weight decay or not, only)",
        file, *state.scheduler->decoupled_lr));
  if (c.qk_layernorm && SettingStr(state, "--apply-wd-to-qk-layernorm", "off") == "on")
    return absl::FailedPreconditionError(
        fmt::format("{} was trained with --apply-wd-to-qk-layernorm: megatron-core then puts the query and key norms "
                    "in the decayed group, which the export does not write (their group is the norms' there)",
                    file));
  return absl::OkStatus();
}

// The checkpoint's buffers are the expert biases megatron-core's routers hold, each of its size: none more, none
// missing (a checkpoint of --moe-router-enable-expert-bias holds one per MoE layer).
absl::Status CheckExportBuffers(const std::vector<MegBuffer>& want, const TrainState& state, const std::string& file) {
  for (const auto& [name, values] : state.buffers) {
    auto it = std::find_if(want.begin(), want.end(), [&](const MegBuffer& b) { return b.name == name; });
    if (it == want.end())
      return absl::FailedPreconditionError(fmt::format(
          "{}: holds buffer {}, which the model it describes has not (megatron-core's routers hold an expert_bias "
          "with --moe-router-enable-expert-bias only)",
          file, name));
    if (static_cast<int64_t>(values.size()) != it->size)
      return absl::DataLossError(
          fmt::format("{}: buffer {} has {} values for {} experts", file, name, values.size(), it->size));
  }
  for (const MegBuffer& b : want)
    if (std::none_of(state.buffers.begin(), state.buffers.end(), [&](const auto& kv) { return kv.first == b.name; }))
      return absl::DataLossError(fmt::format(
          "{}: a model of --moe-router-enable-expert-bias without its buffer {}: not ptk-train's checkpoint", file,
          b.name));
  return absl::OkStatus();
}

// The target layout against the checkpoint's model `c` (read from `file`): the vocabulary's padding, the
// tensor-parallel split, the distributed optimizer's flags, the interleaved schedule (Megatron's checks, arguments.py)
// and the pipeline split. The model chunks per pipeline rank (1 without the interleaved schedule).
absl::StatusOr<int64_t> CheckExportTarget(const ConvertOptions& o, const GPTConfig& c, const std::string& file) {
  const int64_t tp = o.target_tensor_parallel_size, pp = o.target_pipeline_parallel_size;
  if (PaddedVocabSize(c.vocab_size, o.make_vocab_size_divisible_by) != c.padded_vocab_size)
    return UsageError(
        fmt::format("{}: a vocabulary of {} padded to {} is not a multiple of "
                    "--make-vocab-size-divisible-by {}: give the value the run was trained with",
                    file, c.vocab_size, c.padded_vocab_size, o.make_vocab_size_divisible_by));
  if (c.num_attention_heads % tp != 0 || c.ffn_hidden_size % tp != 0 || c.query_groups() % tp != 0 ||
      (c.moe() && c.moe_ffn() % tp != 0))
    return UsageError(
        fmt::format("--target-tensor-parallel-size {} does not divide the {} heads, {} query groups and ffn {}{}", tp,
                    c.num_attention_heads, c.query_groups(), c.ffn_hidden_size,
                    c.moe() ? fmt::format(" and the experts' ffn {}", c.moe_ffn()) : ""));
  if (o.target_ddp_bucket_size > 0 && !o.target_use_distributed_optimizer)
    return UsageError(fmt::format(
        "--target-ddp-bucket-size {}: places the distributed optimizer's state (--target-use-distributed-optimizer)",
        o.target_ddp_bucket_size));
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
  if (c.num_layers % pp != 0)
    return UsageError(
        fmt::format("--target-pipeline-parallel-size {} does not divide the model's {} layers", pp, c.num_layers));
  return vp;
}

// The iteration's directory, written aside and renamed into place in --save-dir (taken for the export, what killed
// exports left swept away, with a note each in `notes`). The directory written.
absl::StatusOr<std::string> SaveExport(Export& ex, const ConvertOptions& o, std::vector<std::string>* notes) {
  SaveDirectory save_dir;  // locked; a failed export (a full disk) leaves no --save-dir it made
  PTK_RETURN_IF_ERROR(save_dir.Take(o.save_dir, "ptk-convert", o.lock_wait));
  PTK_RETURN_IF_ERROR(SweepDeadExports(o.save_dir, notes));
  const std::string final_dir = JoinPath(o.save_dir, fmt::format("iter_{:07d}", ex.state.iteration));
  const std::string tmp_dir = fmt::format("{}.ptk-tmp-{}", final_dir, ::getpid());
  const std::string old_dir = fmt::format("{}.ptk-old-{}", final_dir, ::getpid());
  // A large model's ranks are tens of GB: the export says how far it is (it was silent until done).
  ProgressReporter progress({.label = "convert",
                             .item_unit = "ranks",
                             .items_total = static_cast<uint64_t>(ex.tp * ex.pp),
                             .enabled = o.progress});
  ex.progress = &progress;
  absl::Status written = ex.WriteAndPublish(tmp_dir, final_dir, old_dir);
  progress.Finish();
  ex.progress = nullptr;
  if (absl::Status st = std::move(written); !st.ok()) {
    absl::Status undo = RemoveAll(tmp_dir);
    if (!undo.ok()) log::Warning("after a failed save: {}", StatusMessage(undo));
    if (!PathExists(final_dir) && PathExists(old_dir)) (void)RenameFile(old_dir, final_dir);
    return st;
  }
  save_dir.Keep();
  return final_dir;
}

}  // namespace

absl::StatusOr<ConvertSummary> ExportToMegatron(const ConvertOptions& o) {
  ConvertSummary s;
  const int64_t tp = o.target_tensor_parallel_size, pp = o.target_pipeline_parallel_size;
  if (o.saver_transformer_impl != "transformer_engine" && o.saver_transformer_impl != "local")
    return UsageError(
        fmt::format("--saver-transformer-impl {}: transformer_engine or local", o.saver_transformer_impl));
  PTK_ASSIGN_OR_RETURN(PtkCheckpoint ck,
                       LoadPtkCheckpoint(o.load_dir, o.true_vocab_size, o.progress, /*with_optimizer=*/true));
  const GPTConfig& c = ck.config;
  PTK_RETURN_IF_ERROR(CheckMlaExport(o, c, ck.file));  // MLA: the local spec's down projections split
  PTK_RETURN_IF_ERROR(CheckMtpExport(o, c, ck.file));  // MTP: tensor-parallel size 1, the plain optimizer
  if (c.moe() && o.target_use_distributed_optimizer)   // megatron-core's grad buffers of experts: not checked yet
    return absl::FailedPreconditionError(fmt::format(
        "{}: a mixture-of-experts model (--num-experts {}): --target-use-distributed-optimizer is not written for "
        "MoE checkpoints yet (the plain optimizer's state is: leave the flag out, and resume Megatron without "
        "--use-distributed-optimizer)",
        ck.file, c.num_experts));
  s.notes = ck.notes;
  s.source = ck.file;
  s.iteration = ck.iteration;
  PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(c));
  // The weights, moments and state of the one read (it read the checkpoint a second time for them).
  const std::vector<float>&params = ck.params, &m1 = ck.m1, &m2 = ck.m2;
  const TrainState& state = ck.state;
  PTK_ASSIGN_OR_RETURN(const int64_t vp, CheckExportTarget(o, c, ck.file));
  PTK_RETURN_IF_ERROR(CheckExportableGroups(state, c, ck.file));
  Export ex(o, c, state, params, m1, m2);
  ex.tp = tp;
  ex.pp = pp;
  ex.vp = vp;
  ex.vm = PaddedVocabSize(c.vocab_size, o.make_vocab_size_divisible_by * tp);
  PTK_ASSIGN_OR_RETURN(ex.mparams, MegParams(layout, pp * vp));
  ex.mbuffers = MegBuffers(c, ex.mparams);
  PTK_RETURN_IF_ERROR(CheckExportBuffers(ex.mbuffers, state, ck.file));
  ex.te = o.saver_transformer_impl == "transformer_engine";
  SplitMlaDown(ex.te, &ex.mparams);
  ex.tied_copy = !c.untie_embeddings_and_output_weights && pp * vp > 1;
  ex.with_moments = state.adam_step > 0;
  ex.distopt = o.target_use_distributed_optimizer;
  // As the saving run trained: fp32, or bf16/fp16 model weights with the fp32 masters in the optimizer.
  ex.precision = SettingStr(state, "--bf16/--fp16", "fp32");
  ex.mixed = ex.precision == "bf16" || ex.precision == "fp16";
  ex.model_dtype = ex.precision == "bf16"   ? torchfmt::DType::kBFloat16
                   : ex.precision == "fp16" ? torchfmt::DType::kFloat16
                                            : torchfmt::DType::kFloat32;
  ex.h = HyperOf(state);
  ex.args = MegatronArgs(o, c, state, ex.h, ex.vm, ex.precision, vp);
  ex.sched = SchedulerState(state, ex.h);

  PTK_ASSIGN_OR_RETURN(const std::string final_dir, SaveExport(ex, o, &s.notes));
  s.destination = final_dir;
  s.config = c;
  s.num_params = layout.num_params;
  if (ex.vm > c.padded_vocab_size)
    s.notes.push_back(
        fmt::format("the vocabulary is padded from {} to {} rows (a multiple of {} x {} tensor-parallel "
                    "ranks, as Megatron pads it) with copies of the last token's row",
                    c.padded_vocab_size, ex.vm, o.make_vocab_size_divisible_by, tp));
  s.notes.push_back(WroteNote(ex));
  return s;
}

}  // namespace ptk
