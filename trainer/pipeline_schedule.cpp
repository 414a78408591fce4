// Megatron's non-interleaved 1F1B schedule and the forward-only pass over a pipeline's stages.
#include "trainer/pipeline_schedule.h"

#include <algorithm>

#include <fmt/core.h>

#include "common/status.h"

namespace ptk {
namespace {

// One stage's messages: Megatron's p2p_communication helpers over the pipeline group, each timed
// (level 2) under its Megatron name where it exchanges anything.
class StageLinks {
 public:
  StageLinks(Communicator* pipe, int64_t floats, Timers* timers = nullptr)
      : pipe_(pipe),
        bytes_(floats * static_cast<int64_t>(sizeof(float))),
        stage_(pipe->rank()),
        last_(pipe->size() - 1),
        timers_(timers) {}
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == last_; }
  absl::Status RecvForward(std::vector<float>* x) {
    return first() ? Ok() : Call("forward-recv", nullptr, -1, x, stage_ - 1);
  }
  absl::Status SendForward(const std::vector<float>& y) {
    return last() ? Ok() : Call("forward-send", &y, stage_ + 1, nullptr, -1);
  }
  absl::Status SendForwardRecvBackward(const std::vector<float>& y, std::vector<float>* dy) {
    return last() ? Ok() : Call("forward-send-backward-recv", &y, stage_ + 1, dy, stage_ + 1);
  }
  absl::Status SendBackwardRecvForward(const std::vector<float>& dx, std::vector<float>* x) {
    return first() ? Ok() : Call("backward-send-forward-recv", &dx, stage_ - 1, x, stage_ - 1);
  }
  absl::Status RecvBackward(std::vector<float>* dy) {
    return last() ? Ok() : Call("backward-recv", nullptr, -1, dy, stage_ + 1);
  }
  absl::Status SendBackward(const std::vector<float>& dx) {
    return first() ? Ok() : Call("backward-send", &dx, stage_ - 1, nullptr, -1);
  }

 private:
  static absl::Status Ok() { return absl::OkStatus(); }
  absl::Status Call(const char* timer, const std::vector<float>* send, int dst, std::vector<float>* recv, int src) {
    PTK_RETURN_IF_ERROR(StartTimer(timers_, timer, 2));
    PTK_RETURN_IF_ERROR(pipe_->SendRecv(send ? send->data() : nullptr, send ? bytes_ : 0, dst,
                                        recv ? recv->data() : nullptr, recv ? bytes_ : 0, src));
    return StopTimer(timers_, timer);
  }
  Communicator* pipe_;
  int64_t bytes_;
  int stage_, last_;
  Timers* timers_;
};

int64_t ActivationFloats(const GPTModel& model, const ModelBatch& mb) { return model.StageExchangeFloats(mb); }

}  // namespace

absl::StatusOr<LossSum> ForwardBackwardPipelining(GPTModel* model, Communicator* pipeline,
                                                  const std::vector<ModelBatch>& micro_batches,
                                                  std::span<const double> loss_scales, uint64_t seed,
                                                  PipelineStats* stats,
                                                  const std::function<absl::Status()>& before_last_backward,
                                                  Timers* timers) {
  const int P = pipeline->size(), s = pipeline->rank();
  const int m = static_cast<int>(micro_batches.size());
  if (loss_scales.size() != micro_batches.size())
    return absl::InvalidArgumentError("ForwardBackwardPipelining: one loss scale per micro-batch");
  if (P != model->layout().pipeline_size || s != model->layout().pipeline_rank)
    return absl::InvalidArgumentError(
        fmt::format("ForwardBackwardPipelining: rank {} of a pipeline group of {} runs stage {} of {}", s, P,
                    model->layout().pipeline_rank, model->layout().pipeline_size));
  if (m == 0) return LossSum{};
  const int64_t floats = ActivationFloats(*model, micro_batches[0]);
  StageLinks links(pipeline, floats, timers);
  std::vector<float> x(static_cast<size_t>(floats)), y(x.size()), dy(x.size()), dx(x.size());
  const size_t in_size = links.first() ? 0 : x.size(), out_size = links.last() ? 0 : x.size();
  // Micro-batch k's activations live in slot k % slots: k's forward comes after the backward of
  // k - slots, the micro-batches in flight being at most warm-up + 1 = P - s.
  const int warmup = std::min(P - s - 1, m), remaining = m - warmup, slots = std::min(P - s, m);
  LossSum loss;
  int in_flight = 0;
  auto forward = [&](int k) -> absl::Status {
    const ModelBatch& mb = micro_batches[static_cast<size_t>(k)];
    if (ActivationFloats(*model, mb) != floats)
      return absl::InvalidArgumentError("ForwardBackwardPipelining: micro-batches of different shapes");
    PTK_RETURN_IF_ERROR(StartTimer(timers, "forward-compute", 2));
    PTK_ASSIGN_OR_RETURN(const LossSum l,
                         model->StageForward(mb, k % slots, std::span<const float>(x.data(), in_size),
                                             std::span<float>(y.data(), out_size), loss_scales[static_cast<size_t>(k)],
                                             /*train=*/true, seed));
    PTK_RETURN_IF_ERROR(StopTimer(timers, "forward-compute"));
    loss.loss_sum += l.loss_sum;
    loss.tokens += l.tokens;
    ++in_flight;
    if (stats) stats->max_in_flight = std::max(stats->max_in_flight, in_flight);
    return absl::OkStatus();
  };
  auto backward = [&](int k) -> absl::Status {
    --in_flight;
    if (k + 1 == m && before_last_backward) PTK_RETURN_IF_ERROR(before_last_backward());
    PTK_RETURN_IF_ERROR(StartTimer(timers, "backward-compute", 2));
    PTK_RETURN_IF_ERROR(model->StageBackward(micro_batches[static_cast<size_t>(k)], k % slots,
                                             std::span<const float>(dy.data(), out_size),
                                             std::span<float>(dx.data(), in_size), /*train=*/true, seed));
    return StopTimer(timers, "backward-compute");
  };
  for (int i = 0; i < warmup; ++i) {
    PTK_RETURN_IF_ERROR(links.RecvForward(&x));
    PTK_RETURN_IF_ERROR(forward(i));
    PTK_RETURN_IF_ERROR(links.SendForward(y));
  }
  if (remaining > 0) PTK_RETURN_IF_ERROR(links.RecvForward(&x));
  for (int i = 0; i < remaining; ++i) {
    PTK_RETURN_IF_ERROR(forward(warmup + i));
    PTK_RETURN_IF_ERROR(links.SendForwardRecvBackward(y, &dy));
    PTK_RETURN_IF_ERROR(backward(i));
    if (i + 1 == remaining) {
      PTK_RETURN_IF_ERROR(links.SendBackward(dx));
    } else {
      PTK_RETURN_IF_ERROR(links.SendBackwardRecvForward(dx, &x));
    }
  }
  for (int i = 0; i < warmup; ++i) {  // cool-down
    PTK_RETURN_IF_ERROR(links.RecvBackward(&dy));
    PTK_RETURN_IF_ERROR(backward(remaining + i));
    PTK_RETURN_IF_ERROR(links.SendBackward(dx));
  }
  return loss;
}

absl::StatusOr<LossSum> ForwardPipelining(GPTModel* model, Communicator* pipeline, const ModelBatch& batch,
                                          std::vector<float>* logits) {
  const int64_t floats = ActivationFloats(*model, batch);
  StageLinks links(pipeline, floats);
  std::vector<float> x(static_cast<size_t>(floats)), y(x.size());
  PTK_RETURN_IF_ERROR(links.RecvForward(&x));
  PTK_ASSIGN_OR_RETURN(const LossSum l,
                       model->StageForward(batch, 0, std::span<const float>(x.data(), links.first() ? 0 : x.size()),
                                           std::span<float>(y.data(), links.last() ? 0 : y.size()), std::nullopt,
                                           /*train=*/false, 0, logits));
  PTK_RETURN_IF_ERROR(links.SendForward(y));
  return l;
}

}  // namespace ptk
