// ptk-train's log line and its numbers: Megatron's training_log format, the FLOPs formula, the
// NaN check's message, --metrics-file (training.h, training_log.h).
#include "trainer/training_log.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <string_view>
#include <vector>

#include <sys/stat.h>

#include <fmt/core.h>

#include "absl/strings/numbers.h"
#include "common/atomic_file.h"
#include "common/file_io.h"
#include "common/file_paths.h"
#include "common/logging.h"
#include "common/status.h"
#include "trainer/training.h"

namespace ptk {

MetricsFile::~MetricsFile() {
  if (f_) std::fclose(f_);
}
absl::Status MetricsFile::Open(const std::string& path) {
  path_ = path;
  PTK_RETURN_IF_ERROR(MakeDirs(Dirname(path)));
  f_ = std::fopen(path.c_str(), "a");
  if (!f_) return ErrnoToStatus(errno, "open " + path);
  return absl::OkStatus();
}
absl::Status MetricsFile::Append(const std::string& line) {
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    return ErrnoToStatus(errno, "write " + path_);
  return absl::OkStatus();
}
absl::Status MetricsFile::Sync() {
  if (!f_) return absl::OkStatus();
  if (std::fflush(f_) != 0) return ErrnoToStatus(errno, "write " + path_);
  struct stat st;
  if (::fstat(::fileno(f_), &st) == 0 && S_ISREG(st.st_mode) && ::fsync(::fileno(f_)) != 0)
    return ErrnoToStatus(errno, "fsync " + path_);
  return absl::OkStatus();
}
absl::Status MetricsFile::Close() {
  if (!f_) return absl::OkStatus();
  const int rc = std::fclose(f_);
  f_ = nullptr;
  if (rc != 0) return ErrnoToStatus(errno, "close " + path_);
  return absl::OkStatus();
}

absl::Status MadeOnDisk::MakeDirs(const std::string& dir) {
  std::vector<std::string> missing;
  for (std::string p = dir; !p.empty() && p != "." && p != "/" && !PathExists(p); p = Dirname(p)) missing.push_back(p);
  paths_.insert(paths_.end(), missing.rbegin(), missing.rend());
  return ptk::MakeDirs(dir);
}

void MadeOnDisk::Undo() {
  std::error_code ec;
  for (auto it = paths_.rbegin(); it != paths_.rend(); ++it) std::filesystem::remove(*it, ec);
  paths_.clear();
}

absl::Status SaveDirectory::Take(const std::string& dir, const std::string& lock_name, std::chrono::milliseconds wait) {
  std::lock_guard<std::mutex> lock(mu_);
  PTK_RETURN_IF_ERROR(made_.MakeDirs(dir));
  PTK_ASSIGN_OR_RETURN(lock_, OutputLock::Acquire(JoinPath(dir, lock_name), wait));
  return absl::OkStatus();
}

void SaveDirectory::Abandon() {
  std::lock_guard<std::mutex> lock(mu_);
  lock_.reset();  // its file goes before the directory it is in
  if (!kept_) made_.Undo();
  kept_ = true;  // undone once
}

std::function<void(const absl::Status&)> AbandonedOnStop(std::function<void(const absl::Status&)> stop,
                                                         SaveDirectory* dir) {
  if (!stop) return {};
  return [stop = std::move(stop), dir](const absl::Status& st) {
    dir->Abandon();
    stop(st);
  };
}

namespace {

// The iteration of the last complete line of metrics file `path` ({"iteration": N, ...}, read from
// its last 4 KiB); -1 if there is none.
int64_t LastMetricsIteration(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return -1;
  std::string tail(4096, '\0');
  const long size = std::fseek(f, 0, SEEK_END) == 0 ? std::ftell(f) : -1;
  const long from = std::max(0L, size - static_cast<long>(tail.size()));
  tail.resize(size >= 0 && std::fseek(f, from, SEEK_SET) == 0 ? std::fread(tail.data(), 1, tail.size(), f) : 0);
  std::fclose(f);
  const size_t end = tail.rfind('\n');  // a line a kill cut short is no line
  if (end == std::string::npos || end == 0) return -1;
  const size_t begin = tail.rfind('\n', end - 1) == std::string::npos ? 0 : tail.rfind('\n', end - 1) + 1;
  const std::string_view key = "{\"iteration\": ";
  const std::string_view line = std::string_view(tail).substr(begin, end - begin);
  int64_t it = -1;
  if (line.substr(0, key.size()) != key) return -1;
  const std::string_view rest = line.substr(key.size());
  return absl::SimpleAtoi(std::string(rest.substr(0, rest.find_first_not_of("0123456789"))), &it) ? it : -1;
}

// --metrics-file, locked for this run; what an earlier run left there said in *note.
absl::Status OpenMetricsFile(const std::string& path, int64_t iteration, MadeOnDisk* made,
                             std::unique_ptr<OutputLock>* lock_out, MetricsFile* file, std::string* note,
                             std::chrono::milliseconds lock_wait) {
  std::error_code ec;
  const auto type = std::filesystem::status(path, ec).type();
  if (type == std::filesystem::file_type::regular || type == std::filesystem::file_type::not_found) {
    PTK_RETURN_IF_ERROR(made->MakeDirs(Dirname(path)));
    auto lock = OutputLock::Acquire(path, lock_wait);
    if (IsOutputBusy(lock.status()))
      return absl::AbortedError(fmt::format("--metrics-file {}", StatusMessage(lock.status())));
    PTK_RETURN_IF_ERROR(lock.status());
    *lock_out = *std::move(lock);
    const auto size = std::filesystem::file_size(path, ec);
    if (ec) made->Made(path);  // none yet: Open makes it
    if (!ec && size > 0 && iteration == 0)
      *note = fmt::format(
          "--metrics-file {} holds {} bytes of an earlier run; this run starts at iteration 0 and appends its "
          "lines after them",
          path, size);
    // A resumed run's own file reaches its checkpoint: its lines were on disk before the save.
    const int64_t last = !ec && size > 0 && iteration > 0 ? LastMetricsIteration(path) : iteration;
    if (last < iteration)
      *note = fmt::format(
          "--metrics-file {} ends {}, before this run's checkpoint of iteration {}: not this run's lines? this run "
          "appends its lines from iteration {} after them",
          path, last < 0 ? "with no iteration line" : fmt::format("at iteration {}", last), iteration, iteration + 1);
  }
  return file->Open(path);
}

// A fresh run's subdirectory records the checkpoint directory (--save) it writes, so that a run
// resumed from there (--load) finds its curves again.
constexpr const char* kTensorBoardRunRecord = "ptk-run-checkpoints.txt";

int CountEventFiles(const std::string& dir) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    n += e.is_regular_file(ec) && e.path().filename().string().find("tfevents") != std::string::npos;
  return n;
}

std::string AbsolutePath(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::weakly_canonical(std::filesystem::absolute(path, ec), ec);
  return ec ? path : p.lexically_normal().string();
}

// The run-N subdirectory of `dir` (highest N) whose record names checkpoint directory `load`; "" if none.
std::string RunDirOf(const std::string& dir, const std::string& load) {
  if (load.empty()) return "";
  const std::string want = AbsolutePath(load) + "\n";
  std::string found;
  int found_n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    int n = 0;
    if (name.rfind("run-", 0) != 0 || !absl::SimpleAtoi(name.substr(4), &n) || n <= found_n) continue;
    auto record = ReadFileToString(JoinPath(e.path().string(), kTensorBoardRunRecord));
    if (record.ok() && *record == want) {
      found = e.path().string();
      found_n = n;
    }
  }
  return found;
}

// Locks --tensorboard-dir `dir` for this run (the lock kept in *lock) and returns the directory its
// event files go to. A run resumed from a checkpoint (not `fresh`) continues its own curves: in the
// subdirectory that a fresh start of it made (one whose record names its --load, `load`), else in
// `dir`, as Megatron's. A fresh run (from iteration 0) writes in `dir`, unless another run's event
// files are there: then in a new subdirectory run-2, run-3, ... (TensorBoard shows each subdirectory
// of its --logdir as a run of its own), said in *note and recorded with its --save (`save`) so
// that resuming it writes there again.
absl::StatusOr<std::string> ClaimTensorBoardDir(const std::string& dir, bool fresh, const std::string& save,
                                                const std::string& load, MadeOnDisk* made,
                                                std::unique_ptr<OutputLock>* lock_out, std::string* note,
                                                std::chrono::milliseconds lock_wait) {
  PTK_RETURN_IF_ERROR(made->MakeDirs(dir));
  const std::string events = JoinPath(dir, "events");
  auto lock = OutputLock::Acquire(events, lock_wait);
  if (IsOutputBusy(lock.status())) {
    std::string msg(StatusMessage(lock.status()));
    if (msg.rfind(events, 0) == 0) msg = dir + msg.substr(events.size());
    return absl::AbortedError(fmt::format(
        "--tensorboard-dir {}; or give this run its own directory (TensorBoard shows each subdirectory of its "
        "--logdir as a run)",
        msg));
  }
  PTK_RETURN_IF_ERROR(lock.status());
  *lock_out = *std::move(lock);
  if (!fresh) {
    const std::string own = RunDirOf(dir, load);
    return own.empty() ? dir : own;
  }
  const int earlier = CountEventFiles(dir);
  if (earlier == 0) return dir;
  int n = 2;
  while (PathExists(JoinPath(dir, fmt::format("run-{}", n)))) ++n;
  const std::string sub = JoinPath(dir, fmt::format("run-{}", n));
  PTK_RETURN_IF_ERROR(made->MakeDirs(sub));
  if (!save.empty()) {
    made->Made(JoinPath(sub, kTensorBoardRunRecord));
    PTK_RETURN_IF_ERROR(WriteFileAtomic(JoinPath(sub, kTensorBoardRunRecord), AbsolutePath(save) + "\n"));
  }
  *note = fmt::format(
      "--tensorboard-dir {} holds {} event file(s) of another run; this run starts at iteration 0 and writes its "
      "own in {} (TensorBoard shows it as a run of its own)",
      dir, earlier, sub);
  return sub;
}

// OpenRunOutputs' steps, what they made recorded in *made.
absl::Status OpenRunOutputsOrFail(const std::string& tensorboard_dir, const std::string& metrics_path,
                                  const std::string& save, const std::string& load, int64_t iteration, MadeOnDisk* made,
                                  RunOutputs* out, std::chrono::milliseconds lock_wait) {
  std::string tb_dir, metrics = metrics_path, tb_note, metrics_note;
  if (!tensorboard_dir.empty()) {
    PTK_ASSIGN_OR_RETURN(tb_dir, ClaimTensorBoardDir(tensorboard_dir, iteration == 0, save, load, made, &out->tb_lock,
                                                     &tb_note, lock_wait));
    // The metrics.jsonl that defaults to the directory's goes along with the events.
    if (metrics == JoinPath(tensorboard_dir, "metrics.jsonl")) metrics = JoinPath(tb_dir, "metrics.jsonl");
  }
  if (!metrics.empty())
    PTK_RETURN_IF_ERROR(
        OpenMetricsFile(metrics, iteration, made, &out->metrics_lock, &out->metrics, &metrics_note, lock_wait));
  if (!tb_dir.empty()) {
    PTK_ASSIGN_OR_RETURN(out->tb, SummaryWriter::Create(tb_dir));  // a new event file (a resume adds one)
    log::Info("TensorBoard events: {}", out->tb->path());
  }
  for (const std::string* note : {&tb_note, &metrics_note})
    if (!note->empty()) log::Warning("{}", *note);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunOutputs::Sync() {
  if (tb) PTK_RETURN_IF_ERROR(tb->Sync());
  return metrics.Sync();
}

absl::Status OpenRunOutputs(const std::string& tensorboard_dir, const std::string& metrics_path,
                            const std::string& save, const std::string& load, int64_t iteration, bool writer,
                            RunOutputs* out, std::chrono::milliseconds lock_wait) {
  if (!writer) return absl::OkStatus();
  MadeOnDisk made;
  absl::Status st = OpenRunOutputsOrFail(tensorboard_dir, metrics_path, save, load, iteration, &made, out, lock_wait);
  if (st.ok()) return st;
  out->tb.reset();
  (void)out->metrics.Close();
  out->metrics_lock.reset();  // its lock files go before the directories they are in
  out->tb_lock.reset();
  made.Undo();
  return st;
}

std::string NothingToTrainLine(const TrainOptions& o, int64_t iteration, int64_t consumed, int64_t train_iters) {
  return fmt::format(
      "nothing to train: the checkpoint in {} is at iteration {} ({} samples consumed) and {}; give a larger {} to "
      "train further. As Megatron's, the run goes on to its end all the same: a save and the final evaluations",
      o.load, iteration, consumed,
      o.train_iters > 0 ? fmt::format("--train-iters is {}", o.train_iters)
                        : fmt::format("--train-samples {} make {} iterations", o.train_samples, train_iters),
      o.train_iters > 0 ? "--train-iters" : "--train-samples");
}

std::string JsonNumber(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : "null"; }

std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(now - std::chrono::system_clock::from_time_t(t)).count();
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return fmt::format("{}.{:06d}", buf, micros);
}

void LogInterval::Add(const StepResult& r) {
  ++iters_;
  load_balancing_ += r.load_balancing_loss;  // Megatron's track_moe_metrics adds every iteration's, skipped or not
  z_loss_ += r.z_loss;
  seq_load_balancing_ += r.seq_load_balancing_loss;
  global_load_balancing_ += r.global_load_balancing_loss;
  if (mtp_.size() < r.mtp_losses.size()) mtp_.resize(r.mtp_losses.size(), 0.0);  // track_mtp_metrics: likewise
  for (size_t k = 0; k < r.mtp_losses.size(); ++k) mtp_[k] += r.mtp_losses[k];
  if (r.skipped) {
    ++skipped_;
    if (!r.overflow) ++nan_;
  } else {
    ++advanced_;
    loss_ += r.lm_loss();
  }
}

void LogInterval::Pause(Clock::time_point now) {
  if (pauses_++ == 0) paused_at_ = now;
}

void LogInterval::Resume(Clock::time_point now) {
  if (pauses_ > 0 && --pauses_ == 0) paused_seconds_ += std::chrono::duration<double>(now - paused_at_).count();
}

void LogInterval::Fill(const StepResult& r, double flops, int world, bool throughput, LogLineFields* f,
                       Clock::time_point now) const {
  const double secs = std::chrono::duration<double>(now - start_).count() - paused_seconds_;
  const double iters = static_cast<double>(std::max<int64_t>(iters_, 1));
  f->elapsed_ms = secs * 1000.0 / iters;
  if (throughput) f->tflops_per_gpu = flops / (secs / iters * 1e12 * world);
  f->lm_loss = advanced_ > 0 ? loss_ / static_cast<double>(advanced_) : 0.0;
  f->load_balancing_loss = load_balancing_ / static_cast<double>(std::max<int64_t>(advanced_, 1));
  f->z_loss = z_loss_ / static_cast<double>(std::max<int64_t>(advanced_, 1));
  f->seq_load_balancing_loss = seq_load_balancing_ / static_cast<double>(std::max<int64_t>(advanced_, 1));
  f->global_load_balancing_loss = global_load_balancing_ / static_cast<double>(std::max<int64_t>(advanced_, 1));
  f->mtp_losses = mtp_;
  for (double& v : f->mtp_losses) v /= static_cast<double>(std::max<int64_t>(advanced_, 1));
  f->skipped = skipped_;
  f->nan = nan_;
  if (!r.skipped) f->grad_norm = r.grad_norm;
  f->loss_scale = r.next_loss_scale;
  f->num_zeros_in_grad = r.num_zeros_in_grad;
}

void LogInterval::Logged(int64_t iteration, Clock::time_point now) {
  if (Resets(iteration)) {
    iters_ = advanced_ = skipped_ = nan_ = 0;
    loss_ = paused_seconds_ = load_balancing_ = z_loss_ = 0;
    seq_load_balancing_ = global_load_balancing_ = 0;
    mtp_.assign(mtp_.size(), 0.0);
    start_ = now;
  }
  logged_ = true;
}

double FlopsPerIteration(const GPTConfig& c, int64_t gbs) {
  const double b = static_cast<double>(gbs), s = static_cast<double>(c.seq_length),
               l = static_cast<double>(c.num_layers), h = static_cast<double>(c.hidden_size),
               f = static_cast<double>(c.ffn_hidden_size), v = static_cast<double>(c.padded_vocab_size),
               heads = static_cast<double>(c.num_attention_heads), groups = static_cast<double>(c.query_groups());
  // Megatron's num_floating_point_operations: 12 * B * s * l * h^2 * ((1 + groups/heads + s/(2h)) * q/h
  // + ffn/h * (3/2 with SwiGLU) + V/(2 l h)), q = kv_channels * heads the query projection's size.
  const double q_ratio = static_cast<double>(c.head_dim()) * heads / h, gated = c.swiglu ? 1.5 : 1.0;
  if (c.mla()) {  // Megatron's MLA terms in place of the attention's: 6 x (projections + s x core) per token and layer
    const double qr = static_cast<double>(c.q_lora_rank), kvr = static_cast<double>(c.kv_lora_rank),
                 dq = static_cast<double>(c.mla_q_head_dim()), dv = static_cast<double>(c.v_head_dim);
    const double q = c.q_lora_rank > 0 ? qr * (h + heads * dq + 1) : h * heads * dq;
    const double proj = q + kvr * (h + heads * (static_cast<double>(c.qk_head_dim) + dv) + 1) +
                        h * static_cast<double>(c.qk_pos_emb_head_dim) + heads * dv * h;
    const double core = heads * dq / 2 + heads * dv / 2;
    return b * s * l * 6.0 * (proj + s * core) + 12.0 * b * s * l * h * f * gated + 6.0 * b * s * h * v;
  }
  // --attention-output-gate: the QKV projection's gate rows, as many as the query's (Megatron's gate_projection_size).
  const double gate = c.attention_output_gate ? 0.5 : 0.0;
  return 12.0 * b * s * l * h * h *
         ((1.0 + gate + groups / heads + s / (2.0 * h)) * q_ratio + f / h * gated + v / (2.0 * l * h));
}

absl::Status CheckForNanInLossAndGrad(const StepResult& r, int64_t iteration, int rank) {
  const bool loss_bad = !std::isfinite(r.loss_sum), grad_bad = !std::isfinite(r.grad_norm);
  if (!loss_bad && !grad_bad) return absl::OkStatus();
  const double bad = loss_bad ? r.loss_sum : r.grad_norm;
  return absl::AbortedError(
      fmt::format("iteration {} (rank {}): the {} is {} (lm loss {}, grad norm {}); stopping, as Megatron does with "
                  "--check-for-nan-in-loss-and-grad (lower --lr, or resume from the last checkpoint; "
                  "--no-check-for-nan-in-loss-and-grad skips such iterations instead)",
                  iteration, rank, loss_bad ? "loss" : "gradient norm", std::isnan(bad) ? "NaN" : "infinite",
                  std::fabs(r.lm_loss()), std::fabs(r.grad_norm)));
}

std::string FormatLogLine(const LogLineFields& f, const std::string& timestamp) {
  std::string s = fmt::format(" [{}] iteration {:8d}/{:8d} |", timestamp, f.iteration, f.train_iters);
  s += fmt::format(" consumed samples: {:12d} |", f.consumed_samples);
  if (f.skipped_samples > 0) s += fmt::format(" skipped samples: {:12d} |", f.skipped_samples);
  s += fmt::format(" elapsed time per iteration (ms): {:.1f} |", f.elapsed_ms);
  if (f.tflops_per_gpu) s += fmt::format(" throughput per GPU (TFLOP/s/GPU): {:.1f} |", *f.tflops_per_gpu);
  s += fmt::format(" learning rate: {:.6E} |", f.learning_rate);
  s += fmt::format(" global batch size: {:5d} |", f.global_batch_size);
  if (f.lm_loss > 0.0) s += fmt::format(" lm loss: {:.6E} |", f.lm_loss);
  // Megatron's tracker order: the router saves its z-loss before its load-balancing loss.
  if (f.z_loss > 0.0) s += fmt::format(" z_loss: {:.6E} |", f.z_loss);
  if (f.load_balancing_loss > 0.0) s += fmt::format(" load_balancing_loss: {:.6E} |", f.load_balancing_loss);
  if (f.seq_load_balancing_loss > 0.0)
    s += fmt::format(" seq_load_balancing_loss: {:.6E} |", f.seq_load_balancing_loss);
  if (f.global_load_balancing_loss > 0.0)
    s += fmt::format(" global_load_balancing_loss: {:.6E} |", f.global_load_balancing_loss);
  for (size_t k = 0; k < f.mtp_losses.size(); ++k)  // MTPLossLoggingHelper's entries, after the MoE ones
    if (f.mtp_losses[k] > 0.0) s += fmt::format(" mtp_{} loss: {:.6E} |", k + 1, f.mtp_losses[k]);
  s += fmt::format(" loss scale: {:.1f} |", f.loss_scale);
  if (f.grad_norm) s += fmt::format(" grad norm: {:.3f} |", *f.grad_norm);
  if (f.num_zeros_in_grad) s += fmt::format(" num zeros: {:.1f} |", *f.num_zeros_in_grad);
  if (f.params_norm) s += fmt::format(" params norm: {:.3f} |", *f.params_norm);
  s += fmt::format(" number of skipped iterations: {:3d} |", f.skipped);
  s += fmt::format(" number of nan iterations: {:3d} |", f.nan);
  return s;
}

}  // namespace ptk
