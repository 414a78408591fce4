// Megatron's torch_dist checkpoints (megatron-core dist_checkpointing over
// torch.distributed.checkpoint) -> a ptk checkpoint. The keys' global tensors are the whole model's
// whatever the tensor size: SwiGLU's linear_fc1 too, whose rows megatron-core's
// apply_swiglu_sharded_factory saves as every rank's gate, then every rank's up ([gate; up], ptk's
// layout); only the distributed optimizer's grad-buffer formats hold a state per model-parallel rank.
#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include <fmt/core.h>

#include "common/file_paths.h"
#include "common/progress.h"
#include "common/status.h"
#include "interop/megatron_common.h"
#include "interop/megatron_optim.h"
#include "interop/torch_dist.h"

namespace ptk::megatron {
namespace {

// The distributed optimizer's state in megatron-core's grad-buffer layout, one world state per grad buffer of
// each model-parallel rank (the N of optimizer.distributed.dp_group_idx_N: megatron-core's model-parallel group
// rank, tensor rank + TP x pipeline rank; an interleaved run's rank has a grad buffer per model chunk,
// gbuf_idx_V): dp_reshardable's buckets or dp_zero_gather_scatter's object (one buffer).
struct GradBuffers {
  // rank -> grad buffer -> bucket -> what -> key
  std::map<int64_t, std::map<int64_t, std::map<int64_t, std::map<std::string, std::string>>>> buckets;
  std::map<int64_t, std::string> objects;  // rank -> its param_state object
  std::string groups;                      // dp_group_idx_0.optimizer: the param groups and Adam's step
  bool empty() const { return buckets.empty() && objects.empty(); }
};

// What reading the grad buffers needs of the checkpoint and the model.
struct DistSource {
  torchdist::DistCheckpoint* ck;
  const PyValue* args;
  const ParamLayout& layout;
  const MegatronModel& model;
  int64_t tp, pp, vp;  // vp model chunks per pipeline stage
  bool te;             // Transformer Engine's parameter order (args.transformer_impl)
  std::string meta, layout_name;
};

// The world state of grad buffer `v` (model chunk v: virtual stage v x PP + p of `params`) of model-parallel
// rank `rank` (tensor rank rank % TP, pipeline rank p = rank / TP), checked against that chunk's layout.
absl::StatusOr<DistribState> RankGradBuffer(const DistSource& x, const std::vector<MegParam>& params,
                                            const GradBuffers& g, int64_t rank, int64_t v) {
  const int64_t p = rank / x.tp, stages = x.pp * x.vp;
  const bool tied_copy = !x.model.config.untie_embeddings_and_output_weights && stages > 1;
  const std::vector<DistribParam> dparams = StageDistribParams(params, v * x.pp + p, stages, x.te, tied_copy,
                                                               x.model.ckpt_padded, x.tp, x.model.config.hidden_size);
  // megatron-core's DDP: no buckets but on the first pipeline stage's first chunk (Megatron-LM's get_model
  // disables bucketing for the chunks after it).
  const std::optional<int64_t> bucket_size = v == 0 ? DistribBucketSize(x.args, p) : std::nullopt;
  const std::string rank_name = fmt::format(
      "model-parallel rank {} (tensor rank {}, pipeline rank {}{}: optimizer.distributed.dp_group_idx_{}."
      "gbuf_idx_{})",
      rank, rank % x.tp, p, x.vp > 1 ? fmt::format(", model chunk {}", v) : "", rank, v);
  if (auto it = g.objects.find(rank); it != g.objects.end()) {
    PTK_ASSIGN_OR_RETURN(auto item, x.ck->OpenItem(it->second));
    const PyValue& list = item->root();
    if (list.kind != PyValue::Kind::kList || list.items.size() != 1)
      return absl::DataLossError(
          fmt::format("{}: object {}: not the list of one state megatron-core saves", x.meta, it->second));
    return ReadDistribState(item.get(), *list.items[0], fmt::format("{}: object {}", x.meta, it->second), dparams,
                            bucket_size);
  }
  const auto it = g.buckets.find(rank);
  if (it == g.buckets.end() || !it->second.count(v))
    return absl::DataLossError(
        fmt::format("{}: {} state: nothing of {}, which the args' {} tensor x {} pipeline ranks{} have", x.meta,
                    x.layout_name, rank_name, x.tp, x.pp, x.vp > 1 ? fmt::format(" x {} model chunks", x.vp) : ""));
  const auto& buckets = it->second.at(v);
  DistribState d;
  const int64_t total = DistribLayout(dparams, bucket_size, &d.offset);
  int64_t next = 0;
  for (const auto& [b, keys] : buckets) {
    if (b != next++)
      return absl::DataLossError(
          fmt::format("{}: {}: bucket {} missing ({} state)", x.meta, keys.begin()->second, next - 1, x.layout_name));
    for (auto [what, dst] : {std::pair{"param", &d.param}, {"exp_avg", &d.exp_avg}, {"exp_avg_sq", &d.exp_avg_sq}}) {
      auto k = keys.find(what);
      if (k == keys.end())
        return absl::DataLossError(
            fmt::format("{}: {}, bucket {}: no tensor {} ({} state)", x.meta, rank_name, b, what, x.layout_name));
      PTK_ASSIGN_OR_RETURN(std::vector<float> values, x.ck->ReadFloat(k->second));
      dst->insert(dst->end(), values.begin(), values.end());
    }
  }
  if (static_cast<int64_t>(d.param.size()) != total || d.exp_avg.size() != d.param.size() ||
      d.exp_avg_sq.size() != d.param.size())
    return absl::DataLossError(fmt::format(
        "{}: {} state of {}: its {} buckets hold {} elements; the {} parameters common.pt's args give it, laid out "
        "as megatron-core lays them, take {}",
        x.meta, x.layout_name, rank_name, buckets.size(), d.param.size(), dparams.size(), total));
  return d;
}

// Refuses the grad-buffer states of ranks or grad buffers the args do not give.
absl::Status CheckGradBufferRanks(const DistSource& x, const GradBuffers& g) {
  auto beyond = [&](const std::string& what, int64_t rank) {
    return absl::DataLossError(
        fmt::format("{}: {}: {} state of model-parallel rank {}, beyond the args' {} tensor "
                    "x {} pipeline ranks",
                    x.meta, what, x.layout_name, rank, x.tp, x.pp));
  };
  for (const auto& [rank, item] : g.objects)
    if (rank >= x.tp * x.pp) return beyond(item, rank);
  for (const auto& [rank, buffers] : g.buckets) {
    if (rank >= x.tp * x.pp) return beyond(buffers.begin()->second.begin()->second.begin()->second, rank);
    const auto& [last, buckets] = *buffers.rbegin();
    if (last >= x.vp)
      return absl::DataLossError(
          fmt::format("{}: {}: grad buffer {} of model-parallel rank {}: the args give each "
                      "rank {} (one per model chunk, of one dtype)",
                      x.meta, buckets.begin()->second.begin()->second, last, rank, x.vp));
  }
  return absl::OkStatus();
}

// Every model-parallel rank's grad-buffer state gathered into the whole tensors (w, m1, m2 in ptk's layout):
// each rank's shard of each parameter of its stage (of each of its model chunks; SwiGLU's linear_fc1: the
// rank's [gate; up]).
absl::Status GatherGradBuffers(const DistSource& x, const GradBuffers& g, std::vector<float>& w, std::vector<float>& m1,
                               std::vector<float>& m2) {
  PTK_RETURN_IF_ERROR(CheckGradBufferRanks(x, g));
  if (x.layout.config.num_layers % (x.pp * x.vp) != 0)
    return absl::DataLossError(
        fmt::format("{}: {} state: the args' {} layers do not split into {} pipeline stages "
                    "x {} model chunks",
                    x.meta, x.layout_name, x.layout.config.num_layers, x.pp, x.vp));
  PTK_ASSIGN_OR_RETURN(const std::vector<MegParam> params, MegParams(x.layout, x.pp * x.vp));
  std::map<const MegParam*, std::array<std::vector<float>, 3>> full;  // at the checkpoint's vocabulary rows
  // A tied embedding's copy on the last (virtual) stage has its own fp32 param and moments in that rank's grad
  // buffer, as in distrib_optim.pt: checked against stage 0's (per tensor rank), which ptk takes.
  const bool tied_copy = !x.model.config.untie_embeddings_and_output_weights && x.pp * x.vp > 1;
  std::map<int64_t, DistribState> stage0;  // tensor rank -> stage 0's first grad buffer
  bool warned = false;
  auto where = [&](int64_t rank, int64_t v) {
    return fmt::format("{} (model-parallel rank {}, grad buffer {})", x.meta, rank, v);
  };
  for (int64_t rank = 0; rank < x.tp * x.pp; ++rank) {
    const int64_t t = rank % x.tp, p = rank / x.tp;
    for (int64_t v = 0; v < x.vp; ++v) {
      PTK_ASSIGN_OR_RETURN(DistribState d, RankGradBuffer(x, params, g, rank, v));
      if (tied_copy && p == 0 && v == 0) stage0[t] = d;
      if (tied_copy && p == x.pp - 1 && v == x.vp - 1 && !warned) {
        const int64_t rows = x.model.ckpt_padded / x.tp;
        warned = WarnIfTiedCopyDiffers(where(t, 0), stage0.at(t), "embedding.word_embeddings.weight", where(rank, v), d,
                                       "output_layer.weight", t * rows, rows, x.model.config.hidden_size);
      }
      for (const MegParam& m : params) {
        if (m.stage != v * x.pp + p || (m.split < 0 && t > 0)) continue;  // a replicated parameter: tensor rank 0's
        std::vector<int64_t> shape = m.info->shape;
        if (m.vocab) shape[0] = x.model.ckpt_padded;
        const int64_t rows = shape[0], cols = shape.size() > 1 ? shape[1] : 1;
        const int64_t at = d.offset.at(x.te ? m.te_name : m.local_name);
        auto& f = full[&m];
        int i = 0;
        for (std::vector<float>* src : {&d.param, &d.exp_avg, &d.exp_avg_sq}) {
          f[i].resize(static_cast<size_t>(rows * cols));
          CopyShard(f[i].data(), src->data() + at, rows, cols, m.split, m.split < 0 ? 0 : t, m.split < 0 ? 1 : x.tp,
                    /*gather=*/true, m.chunks);
          ++i;
        }
      }
    }
  }
  for (const auto& [m, f] : full) {  // ptk's rows: the vocabulary cut to ptk's padding is a prefix
    int i = 0;
    for (std::vector<float>* dst : {&w, &m1, &m2}) {
      std::copy(f[i].begin(), f[i].begin() + m->info->size, dst->begin() + m->info->offset);
      ++i;
    }
  }
  return absl::OkStatus();
}

// One torch_dist import: what common.pt and .metadata say, read step by step.
class DistImport {
 public:
  DistImport(const ConvertOptions& o, const std::string& iter_dir, int64_t iteration, bool release)
      : o_(o), iter_dir_(iter_dir) {
    s_.iteration = iteration;
    s_.release = release;
    s_.source = iter_dir;
  }

  absl::StatusOr<ConvertSummary> Run() {
    PTK_RETURN_IF_ERROR(OpenCommon());
    PTK_ASSIGN_OR_RETURN(ck_, torchdist::DistCheckpoint::Open(iter_dir_));
    meta_ = JoinPath(iter_dir_, ".metadata");
    PTK_RETURN_IF_ERROR(CheckKeys());
    // The optimizer's layout: common.pt's optimizer.param_state_sharding_type for the distributed optimizer.
    opt_common_ = root().Get("optimizer");
    const std::string sharding = opt_common_ ? StrAttr(opt_common_, "param_state_sharding_type").value_or("") : "";
    layout_name_ =
        sharding.empty() ? "the plain optimizer's layout" : fmt::format("the distributed optimizer's {:?}", sharding);
    PTK_RETURN_IF_ERROR(FindGradBuffers());
    weights_.assign(static_cast<size_t>(layout_->num_params), 0.0f);
    m1_.assign(weights_.size(), 0.0f);
    m2_.assign(weights_.size(), 0.0f);
    PTK_RETURN_IF_ERROR(ReadTensors());
    if (have_masters_) low_precision_ = false;
    for (size_t i = 0; i < weights_.size(); ++i)
      if (!std::isfinite(weights_[i])) return Bad(meta_, fmt::format("weight element {} is NaN or infinite", i));
    PTK_ASSIGN_OR_RETURN(const int64_t adam_step, AdamStep());
    AddNotes();
    PTK_RETURN_IF_ERROR(SaveImported(o_, args_, root(), reader_.get(), *layout_, model_.divisible, have_moments_,
                                     have_moments_ ? adam_step : 0, weights_, m1_, m2_, &s_, std::move(buffers_)));
    s_.notes.push_back(fmt::format("read a torch_dist checkpoint ({} tensors){}", ck_->tensors().size(),
                                   have_moments_ ? ", with the AdamW moments" : ""));
    return s_;
  }

 private:
  static absl::Status Bad(const std::string& file, const std::string& why) {
    return absl::DataLossError(fmt::format("{}: {}", file, why));
  }
  const PyValue& root() const { return reader_->root(); }
  const GPTConfig& config() const { return s_.config; }

  // common.pt: what is not sharded (args, iteration, the scheduler, the optimizer's groups); the model.
  absl::Status OpenCommon() {
    common_ = JoinPath(iter_dir_, "common.pt");
    if (!PathExists(common_))
      return absl::NotFoundError(
          fmt::format("{}: missing: a torch_dist checkpoint keeps its args and iteration there", common_));
    PTK_ASSIGN_OR_RETURN(reader_, torchfmt::TorchArchiveReader::Open(common_));
    if (root().kind != PyValue::Kind::kDict) return Bad(common_, "the pickle is not a dict: not Megatron's common.pt");
    args_ = root().Get("args");
    if (!args_ || args_->kind != PyValue::Kind::kObject)
      return Bad(common_, "no args (an argparse.Namespace): not a Megatron training checkpoint");
    if (const PyValue* it = root().Get("iteration"); it && it->IsInt() && !s_.release) s_.iteration = it->i;
    // An interleaved run's chunks (model0, model1, ... in its state dict) save the same keys: megatron-core's
    // TransformerBlock stacks each layer at its global number, whatever the stage and chunk.
    saved_vp_ =
        std::max<int64_t>(1, static_cast<int64_t>(NumAttr(args_, "virtual_pipeline_model_parallel_size").value_or(1)));
    saved_tp_ = static_cast<int64_t>(NumAttr(args_, "tensor_model_parallel_size").value_or(1));
    saved_pp_ = static_cast<int64_t>(NumAttr(args_, "pipeline_model_parallel_size").value_or(1));
    te_ = StrAttr(args_, "transformer_impl").value_or("transformer_engine") != "local";
    model_args_ = DistModelArgs(args_, saved_tp_, &s_.notes);  // the experts' global tensors: any expert layout
    args_ = model_args_.get();
    PTK_ASSIGN_OR_RETURN(model_, ModelFromArgs(args_, common_, o_, saved_tp_));
    if (model_.config.mtp_num_layers > 0)  // MultiTokenPredictionBlock's sharded keys are not read yet
      return absl::FailedPreconditionError(fmt::format(
          "{}: a multi-token prediction model (--mtp-num-layers {}) in the torch_dist format: ptk-convert reads MTP "
          "checkpoints in the torch format only (save with --ckpt-format torch)",
          common_, model_.config.mtp_num_layers));
    s_.config = model_.config;
    PTK_ASSIGN_OR_RETURN(ParamLayout layout, ParamLayout::Create(config()));
    layout_ = std::move(layout);
    PTK_ASSIGN_OR_RETURN(params_, MegParams(*layout_, 1));
    // megatron-core's non_homogeneous_layers: a model whose layers differ (MoE and dense) saves a key per layer.
    per_layer_ = !config().moe_layer_pattern.empty();
    // Each key read once (a stacked tensor holds every layer's parameter, every expert's); the routers' expert
    // biases (persistent buffers) as parameters of a layout of their own.
    for (const MegParam& m : params_) {
      const DistKey k = DistKeyOf(config(), m, te_, per_layer_);
      by_key_[k.key].emplace_back(&m, k);
    }
    const std::vector<MegBuffer> buffers = MegBuffers(config(), params_);
    buffer_infos_.reserve(buffers.size());  // MegParams point at them
    for (const MegBuffer& b : buffers) {
      buffer_infos_.push_back(ParamInfo{.name = b.name, .shape = {b.size}, .offset = 0, .size = b.size});
      MegParam m;
      m.info = &buffer_infos_.back();
      m.local_name = m.te_name = b.local_name;
      buffer_params_.push_back(m);
    }
    for (const MegParam& m : buffer_params_) {
      const DistKey k = DistKeyOf(config(), m, te_, per_layer_);
      buffers_by_key_[k.key].emplace_back(&m, k);
    }
    return absl::OkStatus();
  }

  // The keys the model must have, each with its global shape; nothing else but the optimizer's.
  absl::Status CheckKeys() {
    const GPTConfig& c = config();
    for (const auto* keys : {&by_key_, &buffers_by_key_})
      for (const auto& [key, members] : *keys) {
        const auto& [m, k] = members.front();
        std::vector<int64_t> shape = m->info->shape;
        if (m->vocab) shape[0] = model_.ckpt_padded;
        if (k.expert >= 0) shape.insert(shape.begin(), c.num_experts);
        if (k.layer >= 0) shape.insert(shape.begin(), c.num_layers);
        want_[key] = shape;
      }
    for (const auto& [key, e] : ck_->tensors()) {
      if (want_.count(key)) {
        if (e.shape != want_.at(key))
          return Bad(meta_, fmt::format("tensor {}: shape {}, the model common.pt's args describe has {} (--num-layers "
                                        "{}, --hidden-size {}, --ffn-hidden-size {}, padded vocabulary {}{})",
                                        key, ShapeStr(e.shape), ShapeStr(want_.at(key)), c.num_layers, c.hidden_size,
                                        c.ffn_hidden_size, model_.ckpt_padded,
                                        c.moe() ? fmt::format(", --num-experts {}, --moe-ffn-hidden-size {}",
                                                              c.num_experts, c.moe_ffn())
                                                : ""));
        continue;
      }
      if (key.rfind("optimizer.", 0) == 0) {
        optimizer_keys_.insert(key);
        continue;
      }
      // megatron-core's singleton_local_shards layout (what its metadata asks for, never Megatron-LM since 0.14):
      // each layer a key of its own, SwiGLU's gate and up as linear_fc1.weight_w / _v.
      static const std::regex kLayerKey(R"(decoder\.layers\.\d+\..*)"), kGlu(R"(.*\.linear_fc1\.(weight|bias)_[wv])");
      if (std::regex_match(key, kGlu) || (!per_layer_ && std::regex_match(key, kLayerKey)))
        return Bad(meta_, fmt::format("tensor {}: megatron-core's singleton_local_shards layout (a key per layer, "
                                      "SwiGLU's gate and up apart as linear_fc1.weight_w / _v), which Megatron-LM "
                                      "does not save and ptk does not read: save with Megatron-LM's save_checkpoint",
                                      key));
      return Bad(meta_, fmt::format("tensor {}: not a weight of the GPT model common.pt's args describe{}", key,
                                    c.untie_embeddings_and_output_weights ? "" : " (output layer tied)"));
    }
    for (const auto& [key, shape] : want_)
      if (!ck_->tensors().count(key)) return Bad(meta_, fmt::format("tensor {}: missing", key));
    return absl::OkStatus();
  }

  // The grad-buffer formats, one state per model-parallel rank N: dp_zero_gather_scatter's objects
  // optimizer.distributed.dp_group_idx_N.{param_state,optimizer}/shard_..., dp_reshardable's tensors
  // optimizer.distributed.dp_group_idx_N.gbuf_idx_0.dtype_(...).bucket_idx_B.<what>, each bucket's unpadded span
  // of the rank's world tensors (megatron-core's grad-buffer order).
  absl::Status FindGradBuffers() {
    GradBuffers& g = grad_buffers_;
    static const std::regex kGroupItem(R"(optimizer\.distributed\.dp_group_idx_(\d+)\.(param_state|optimizer)/.*)");
    for (const std::string& item : ck_->byte_items()) {
      std::smatch mt;
      if (!std::regex_match(item, mt, kGroupItem)) continue;
      const int64_t rank = std::atoll(mt[1].str().c_str());
      if (mt[2].str() == "optimizer") {
        if (rank == 0) g.groups = item;
      } else if (!g.objects.emplace(rank, item).second) {
        return Bad(meta_, fmt::format("object {}: a second param_state of model-parallel rank {} ({} state)", item,
                                      rank, layout_name_));
      }
    }
    static const std::regex kBucket(
        R"(optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.*)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq))");
    std::string dtype;
    for (const std::string& key : optimizer_keys_) {
      std::smatch mt;
      if (key.rfind("optimizer.distributed.", 0) != 0) continue;
      if (!std::regex_match(key, mt, kBucket))
        return Bad(meta_,
                   fmt::format("tensor {}: optimizer state in a layout ptk does not read ({})", key, layout_name_));
      if (!dtype.empty() && mt[3].str() != dtype)
        return Bad(meta_, fmt::format("tensor {}: {} state of parameters of several dtypes (a grad buffer each); ptk "
                                      "reads one",
                                      key, layout_name_));
      dtype = mt[3].str();
      g.buckets[std::atoll(mt[1].str().c_str())][std::atoll(mt[2].str().c_str())][std::atoll(mt[4].str().c_str())]
               [mt[5].str()] = key;
    }
    if (g.empty()) return absl::OkStatus();
    if (config().moe() || config().mla())  // the experts' grad buffers are the expert-data-parallel group's
      return Bad(meta_, fmt::format("{}: {} state of a {} model: ptk reads its torch_dist optimizer state in model "
                                    "space only (the plain optimizer's, or the distributed optimizer's "
                                    "fully_reshardable: --dist-ckpt-optim-fully-reshardable)",
                                    g.objects.empty() ? *optimizer_keys_.begin() : g.objects.begin()->second,
                                    layout_name_, config().moe() ? "mixture-of-experts" : "multi-latent attention"));
    const std::string first_bucket =
        g.buckets.empty() ? "" : g.buckets.begin()->second.begin()->second.begin()->second.begin()->second;
    if (saved_vp_ > 1 && !g.objects.empty())
      return Bad(meta_, fmt::format("object {}: {} state of an interleaved run ({} model chunks per stage, a grad "
                                    "buffer each): ptk reads its dp_reshardable or model-space formats",
                                    g.objects.begin()->second, layout_name_, saved_vp_));
    if (!g.buckets.empty() && !g.objects.empty())
      return Bad(meta_, fmt::format("object {} beside tensor {}: two optimizer states", g.objects.begin()->second,
                                    first_bucket));
    std::set<std::string> bucket_keys;
    for (const auto& [rank, buffers] : g.buckets)
      for (const auto& [gbuf, buckets] : buffers)
        for (const auto& [b, keys] : buckets)
          for (const auto& [what, key] : keys) bucket_keys.insert(key);
    for (const std::string& key : optimizer_keys_)
      if (!bucket_keys.count(key))
        return Bad(meta_, fmt::format("tensor {} beside {}'s {}: two optimizer states", key, layout_name_,
                                      g.buckets.empty() ? "objects" : "buckets"));
    return absl::OkStatus();
  }

  using Members = std::vector<std::pair<const MegParam*, DistKey>>;
  // The stacked tensor `base`'s values `v` scattered to its members' tensors: the layer's (and expert's) slice,
  // then ptk's rows (the vocabulary cut to ptk's padding: a prefix).
  void Scatter(const std::string& base, const Members& members, const std::vector<float>& v,
               std::vector<float>& dst) const {
    const int64_t experts = std::max<int64_t>(1, config().num_experts);
    for (const auto& [m, k] : members) {
      const int64_t slots = (k.layer >= 0 ? config().num_layers : 1) * (k.expert >= 0 ? experts : 1);
      const int64_t slot =
          std::max<int64_t>(k.layer, 0) * (k.expert >= 0 ? experts : 1) + std::max<int64_t>(k.expert, 0);
      const int64_t start = slot * (Elements(want_.at(base)) / slots);
      std::copy(v.begin() + start, v.begin() + start + m->info->size, dst.begin() + m->info->offset);
    }
  }

  // Tensor `key` (`base`'s or its optimizer state's): a stacked one holds exactly its members' layers (megatron-core
  // stacks a key over the layers that have it: a MoE model's MoE layers, its dense ones), each whole.
  absl::StatusOr<std::vector<float>> ReadKey(const std::string& key, const Members& members) {
    if (members.front().second.layer < 0) return ck_->ReadFloat(key);
    std::vector<bool> present;
    PTK_ASSIGN_OR_RETURN(std::vector<float> v, ck_->ReadFloat(key, &present));
    std::vector<int64_t> layers;
    for (const auto& [m, k] : members) layers.push_back(k.layer);
    PTK_RETURN_IF_ERROR(CheckStackedLayers(config(), meta_, key, present, layers));
    return v;
  }

  // The weights and the optimizer's state, with a progress line (tensors and bytes of the checkpoint's).
  absl::Status ReadTensors() {
    ProgressReporter progress({.label = "convert",
                               .item_unit = "tensors",
                               .items_total = ck_->tensors().size(),
                               .bytes_total = ck_->TensorBytes(),
                               .enabled = o_.progress});
    ck_->SetProgress(&progress);
    absl::Status st = ReadWeights();
    if (st.ok() && !grad_buffers_.empty()) {
      st = ReadGradBuffers();
    } else if (st.ok() && !optimizer_keys_.empty()) {
      st = ReadModelSpace();
    }
    ck_->SetProgress(nullptr);
    return st;
  }

  absl::Status ReadWeights() {
    for (const auto& [base, members] : by_key_) {
      if (ck_->tensors().at(base).dtype != torchfmt::DType::kFloat32) low_precision_ = true;
      PTK_ASSIGN_OR_RETURN(std::vector<float> v, ReadKey(base, members));
      Scatter(base, members, v, weights_);
    }
    for (const MegParam& m : buffer_params_) buffers_.emplace_back(m.info->name, std::vector<float>(m.info->size));
    for (const auto& [base, members] : buffers_by_key_) {  // the expert biases, each into its own vector
      PTK_ASSIGN_OR_RETURN(std::vector<float> v, ReadKey(base, members));
      for (const auto& member : members) {
        std::vector<float>& dst = buffers_[static_cast<size_t>(member.first - buffer_params_.data())].second;
        Scatter(base, Members{member}, v, dst);
      }
    }
    return absl::OkStatus();
  }

  // The grad-buffer formats' fp32 params and moments; their param groups (and Adam's step) in an object of
  // their own.
  absl::Status ReadGradBuffers() {
    const bool te = StrAttr(args_, "transformer_impl").value_or("transformer_engine") != "local";
    PTK_RETURN_IF_ERROR(GatherGradBuffers(
        DistSource{ck_.get(), args_, *layout_, model_, saved_tp_, saved_pp_, saved_vp_, te, meta_, layout_name_},
        grad_buffers_, weights_, m1_, m2_));
    have_moments_ = have_masters_ = true;
    const GradBuffers& g = grad_buffers_;
    if (g.groups.empty())
      return Bad(meta_, fmt::format("{} state: no object optimizer.distributed.dp_group_idx_0.optimizer beside {} (the "
                                    "param groups and Adam's step)",
                                    layout_name_, g.buckets.empty() ? g.objects.begin()->second : "its buckets"));
    PTK_ASSIGN_OR_RETURN(groups_reader_, ck_->OpenItem(g.groups));
    const PyValue& list = groups_reader_->root();
    groups_holder_ = list.kind == PyValue::Kind::kList && list.items.size() == 1 ? list.items[0].get() : nullptr;
    return absl::OkStatus();
  }

  // In model space, optimizer.state.<what>.<key>: the plain optimizer's (fp32_param: the masters of a
  // --bf16/--fp16 run), the distributed optimizer's fully_reshardable (param) and fully_sharded_model_space
  // (fp32_param; megatron-core <= 0.13: a [X, Y, ...] tensor whose ranks hold [x, y, ...] saved as
  // [X/x, Y/y, ..., x*y*...], each rank's flattened shard along the last axis).
  absl::Status ReadModelSpace() {
    const auto& tensors = ck_->tensors();
    const char* master = nullptr;
    for (const char* m : {"optimizer.state.fp32_param.", "optimizer.state.param."})
      if (tensors.count(m + by_key_.begin()->first)) master = m;
    for (const auto& [base, members] : by_key_) {
      for (const char* what : {"optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.", master}) {
        if (!what) continue;
        const std::string key = what + base;
        auto it = tensors.find(key);
        if (it == tensors.end())
          return Bad(meta_, fmt::format("tensor {}: missing from {} state (which has {}, ...)", key, layout_name_,
                                        *optimizer_keys_.begin()));
        PTK_ASSIGN_OR_RETURN(std::vector<float> v,
                             it->second.shape == want_.at(base) ? ReadKey(key, members) : ck_->ReadFloat(key));
        if (it->second.shape != want_.at(base)) {
          PTK_ASSIGN_OR_RETURN(v, Unflatten(v, it->second.shape, want_.at(base),
                                            fmt::format("{}: tensor {} ({} state)", meta_, key, layout_name_)));
        }
        Scatter(base, members, v,
                what == master                                    ? weights_
                : std::string(what) == "optimizer.state.exp_avg." ? m1_
                                                                  : m2_);
        optimizer_keys_.erase(key);
      }
    }
    if (!optimizer_keys_.empty())
      return Bad(meta_, fmt::format("tensor {}: optimizer state in a layout ptk does not read ({})",
                                    *optimizer_keys_.begin(), layout_name_));
    have_moments_ = true;
    have_masters_ = master != nullptr;
    return absl::OkStatus();
  }

  // Adam's step: the optimizer's param groups (optimizer[.optimizer].param_groups[].step), in common.pt or, for
  // the grad-buffer formats, in an object of their own.
  absl::StatusOr<int64_t> AdamStep() {
    if (!have_moments_) {
      if (!s_.release)  // a release loads without them anyway
        s_.notes.push_back(std::string("the checkpoint holds no AdamW moments (saved with --no-save-optim): they "
                                       "start at zero") +
                           kNoOptimizerLoad);
      return 0;
    }
    int64_t adam_step = 0;
    const PyValue* opt = grad_buffers_.empty() ? opt_common_ : groups_holder_;
    if (opt && opt->Get("optimizer")) opt = opt->Get("optimizer");
    const PyValue* groups = opt ? opt->Get("param_groups") : nullptr;
    if (groups && groups->kind == PyValue::Kind::kList)
      for (const auto& g : groups->items)
        if (auto st = NumAttr(g.get(), "step")) adam_step = std::max(adam_step, static_cast<int64_t>(*st));
    // megatron-core's plain optimizer keeps torch Adam's per-parameter step as one state.common_step (a tensor).
    const PyValue* state = opt && grad_buffers_.empty() ? opt->Get("state") : nullptr;
    if (const PyValue* step = state ? state->Get("common_step") : nullptr; adam_step == 0 && step) {
      if (step->IsNumber()) {
        adam_step = static_cast<int64_t>(step->Number());
      } else if (step->kind == PyValue::Kind::kTensor && step->tensor.numel() == 1) {
        PTK_ASSIGN_OR_RETURN(std::vector<float> v, reader_->ReadFloat(step->tensor, "optimizer.state.common_step"));
        adam_step = static_cast<int64_t>(v[0]);
      }
    }
    if (adam_step == 0) {  // Megatron steps once per iteration (skipped fp16 steps aside)
      adam_step = s_.iteration;
      s_.notes.push_back(
          fmt::format("the optimizer's param groups record no Adam step: taken as the iteration, {}", s_.iteration));
    }
    return adam_step;
  }

  void AddNotes() {
    const GPTConfig& c = config();
    if (low_precision_)
      s_.notes.push_back("the weights are the model's bf16/fp16 copies widened to fp32 (no fp32 masters saved)");
    if (!grad_buffers_.empty())
      s_.notes.push_back(
          fmt::format("the weights and AdamW moments are {} fp32 state ({})", layout_name_,
                      grad_buffers_.buckets.empty() ? "its param_state objects" : "its grad-buffer buckets"));
    else if (have_masters_)
      s_.notes.push_back(fmt::format("the weights are the optimizer's fp32 master copies ({} state)", layout_name_));
    if (model_.ckpt_padded > c.padded_vocab_size)
      s_.notes.push_back(
          fmt::format("the vocabulary's {} padded rows are cut to {} (a multiple of {}, as ptk-train pads "
                      "{} tokens)",
                      model_.ckpt_padded, c.padded_vocab_size, model_.divisible, c.vocab_size));
  }

  const ConvertOptions& o_;
  const std::string iter_dir_;
  ConvertSummary s_;
  std::string common_, meta_, layout_name_;
  std::unique_ptr<torchfmt::TorchArchiveReader> reader_, groups_reader_;
  const PyValue* args_ = nullptr;
  torchfmt::PyRef model_args_;              // common.pt's args without the experts' parallel layout (DistModelArgs)
  bool te_ = true;                          // Transformer Engine's names (args.transformer_impl)
  bool per_layer_ = false;                  // a key per layer (DistKeyOf)
  const PyValue* opt_common_ = nullptr;     // common.pt's optimizer: the param groups (and Adam's step)
  const PyValue* groups_holder_ = nullptr;  // the grad-buffer formats' param groups object
  int64_t saved_tp_ = 1, saved_pp_ = 1, saved_vp_ = 1;
  MegatronModel model_;
  std::optional<ParamLayout> layout_;
  std::vector<MegParam> params_;
  std::unique_ptr<torchdist::DistCheckpoint> ck_;
  std::map<std::string, std::vector<int64_t>> want_;  // each model key's global shape
  std::map<std::string, Members> by_key_;             // key -> (param, its indices on the key's leading axes)
  std::vector<ParamInfo> buffer_infos_;               // the expert biases: their names and sizes
  std::vector<MegParam> buffer_params_;
  std::map<std::string, Members> buffers_by_key_;
  ModelBuffers buffers_;
  std::set<std::string> optimizer_keys_;  // the optimizer's tensors, each to be read or refused
  GradBuffers grad_buffers_;
  std::vector<float> weights_, m1_, m2_;
  bool low_precision_ = false, have_moments_ = false, have_masters_ = false;
};

}  // namespace

absl::StatusOr<ConvertSummary> ImportFromMegatronDist(const ConvertOptions& o, const std::string& iter_dir,
                                                      int64_t iteration, bool release) {
  return DistImport(o, iter_dir, iteration, release).Run();
}

}  // namespace ptk::megatron
