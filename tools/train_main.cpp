// ptk-train: Megatron's pretrain_gpt.py flags, data and log lines, on ptk's fp32 CPU trainer.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <string_view>
#include <thread>

#include <tbb/global_control.h>

#include "common/atomic_file.h"
#include "common/cli.h"
#include "common/cpu_budget.h"
#include "common/file_paths.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/output_lock.h"
#include "common/slurm_env.h"
#include "common/status.h"
#include "indexed_dataset/blended_megatron_dataset_builder.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tools/train_flags.h"
#include "trainer/checkpoint_retention.h"
#include "trainer/comm.h"
#include "trainer/distributed.h"
#include "trainer/parallel_layout.h"
#include "trainer/rendezvous.h"
#include "trainer/run_settings.h"
#include "trainer/training.h"
#include "trainer/training_data.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace {

std::atomic<int> g_exit_signal{0};
extern "C" void OnExitSignal(int sig) { g_exit_signal.store(sig); }

std::string ArgsJson(int argc, char** argv) {
  ptk::JsonWriter w;
  w.BeginArray();
  for (int i = 1; i < argc; ++i) w.Value(argv[i]);
  return w.EndArray().str();
}

// --exit-signal-handler: the handlers first, before anything that takes time (the tokenizer, the
// data, a rendezvous, the CUDA backend's libraries), so that a SIGTERM right after the start saves
// and exits at the first iteration instead of killing the process. A signal the launcher blocked
// is unblocked now that its handler exists (one sent before is pending, and delivered here).
void InstallExitSignalHandlers() {
  struct sigaction sa = {};
  sa.sa_handler = OnExitSignal;
  sigemptyset(&sa.sa_mask);
  sigset_t handled;
  sigemptyset(&handled);
  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) {
    sigaction(sig, &sa, nullptr);
    sigaddset(&handled, sig);
  }
  pthread_sigmask(SIG_UNBLOCK, &handled, nullptr);
}

// What would fail only after the model is built, checked first: --save or --tensorboard-dir a file (or below
// one), --metrics-file a directory (or below a file), --load or --pretrained-checkpoint a file, --save
// holding a Megatron checkpoint, the
// datasets (by the first and last stage, which read them: each a whole .bin/.idx pair), and
// --eval-iters given with no validation split (Megatron's first evaluation fails on it: an assert on
// its missing data iterator). Megatron's default --eval-iters there is a note in *notes: nothing is
// evaluated.
absl::Status CheckRunInputs(const CLI::App& app, const ptk::TrainOptions& o, int stage, int stages,
                            std::vector<std::string>* notes) {
  // The deepest part of `dir` (the flag's `path`, or the folder it goes in) that exists must be a directory.
  auto below_a_file = [](const char* flag, const std::string& path, const std::string& dir,
                         const char* why) -> absl::Status {
    std::string p = dir;
    while (!ptk::PathExists(p) && ptk::Dirname(p) != p) p = ptk::Dirname(p);
    if (path.empty() || !ptk::PathExists(p) || ptk::IsDirectory(p)) return absl::OkStatus();
    return absl::FailedPreconditionError(fmt::format("{} {}: {} is a file, not a directory{}", flag, path, p, why));
  };
  PTK_RETURN_IF_ERROR(below_a_file("--save", o.save, o.save, ": checkpoints are directories"));
  PTK_RETURN_IF_ERROR(below_a_file("--tensorboard-dir", o.tensorboard.dir, o.tensorboard.dir,
                                   ": TensorBoard's event files go in a directory"));
  if (!o.metrics_path.empty() && ptk::IsDirectory(o.metrics_path))
    return absl::FailedPreconditionError(
        fmt::format("--metrics-file {}: a directory, not a file (one JSON line per iteration)", o.metrics_path));
  PTK_RETURN_IF_ERROR(below_a_file("--metrics-file", o.metrics_path, ptk::Dirname(o.metrics_path), ""));
  // --load of a directory without a checkpoint starts anew (as Megatron); of a file, it is a mistake.
  auto a_file = [](const char* flag, const std::string& path) -> absl::Status {
    if (path.empty() || !ptk::PathExists(path) || ptk::IsDirectory(path)) return absl::OkStatus();
    return absl::FailedPreconditionError(
        fmt::format("{} {}: a file, not a checkpoint directory (the directory --save wrote, which holds "
                    "latest_checkpointed_iteration.txt)",
                    flag, path));
  };
  PTK_RETURN_IF_ERROR(ptk::CheckLoadIsACheckpointDirectory(o.load));
  PTK_RETURN_IF_ERROR(a_file("--load", o.load));
  PTK_RETURN_IF_ERROR(ptk::CheckSaveHoldsNoMegatronCheckpoint(o.save));
  // Megatron's own non-persistent checkpoints (a Megatron job's --non-persistent-global-ckpt-dir): their tracker too.
  PTK_RETURN_IF_ERROR(ptk::CheckSaveHoldsNoMegatronCheckpoint(
      o.non_persistent_dir, o.non_persistent_dir == ptk::JoinPath(o.save, ptk::kNonPersistentSubdir)
                                ? "--save's non_persistent directory"
                                : "--non-persistent-global-ckpt-dir"));
  PTK_RETURN_IF_ERROR(a_file("--pretrained-checkpoint", o.pretrained_checkpoint));
  if (o.mock_data || (stage != 0 && stage != stages - 1)) return absl::OkStatus();
  // --split's usage error (exit 2) before the data's.
  PTK_ASSIGN_OR_RETURN(const std::string no_valid, ptk::NoValidationSplit(o.data));
  PTK_RETURN_IF_ERROR(ptk::CheckDataPaths(o.data));
  if (o.eval_iters == 0 || o.eval_interval == 0 || no_valid.empty()) return absl::OkStatus();
  const bool per_split = o.data.data_path.empty();
  const std::string fix = per_split ? "give --valid-data-path" : "give --split a validation part (e.g. 98,2,0)";
  if (app.count("--eval-iters") == 0) {
    notes->push_back(fmt::format(
        "nothing is evaluated: the run has no validation data ({}), where Megatron's first evaluation fails with its "
        "default --eval-iters {}; {}, or --eval-iters 0",
        no_valid, o.eval_iters, fix));
    return absl::OkStatus();
  }
  return ptk::UsageError(
      fmt::format("--eval-iters {}: the run has no validation data ({}), so nothing would be evaluated; {}, or "
                  "--eval-iters 0",
                  o.eval_iters, no_valid, fix));
}

// The flags resolved (notes in *notes), the tokenizer for text samples, Megatron's layout of these
// ranks and every check between settings: all before any rank waits for another.
absl::StatusOr<ptk::TrainPlan> PlanRun(CLI::App& app, ptk::TrainFlags& flags, const ptk::TrainingRanks& ranks,
                                       std::vector<std::string>* notes, ptk::TrainOptions* options,
                                       std::optional<ptk::ParallelLayout>* layout,
                                       std::unique_ptr<ptk::Gpt2Tokenizer>* tokenizer) {
  PTK_RETURN_IF_ERROR(ptk::ApplyCheckpointArgs(app, &flags, notes));
  PTK_ASSIGN_OR_RETURN(*options, ptk::ResolveTrainFlags(flags, notes));
  // --sample-interval: the GPT-2 tokenizer (--vocab-file/--merge-file, or ptk's built-in files)
  // encodes the prompt and decodes the samples; the trainer itself never tokenizes.
  if (options->sample.interval > 0) {
    PTK_ASSIGN_OR_RETURN(*tokenizer, ptk::Gpt2Tokenizer::LoadOrDefault(options->vocab_file, options->merge_file));
    if (options->sample.prompt_text.empty()) {
      options->sample.prompt = {(*tokenizer)->eod()};
    } else {
      ptk::Gpt2Encoder encoder(**tokenizer);
      encoder.Encode(options->sample.prompt_text, &options->sample.prompt);
    }
    const ptk::Gpt2Tokenizer* tok = tokenizer->get();
    options->sample.decode = [tok](std::span<const int32_t> ids) { return tok->Decode(ids); };
  }
  // Megatron's rank order: tensor ranks adjacent, then context, then data, then pipeline stages
  // (WORLD_SIZE = T x C x data ranks x P).
  const int pp = std::max<int>(1, static_cast<int>(options->pipeline_stage_layers.size()));
  const int tp = options->tensor_model_parallel_size, cp = options->context_parallel_size;
  auto made = ptk::ParallelLayout::Create(ranks.world_size, tp, pp, cp, options->expert_model_parallel_size);
  if (!made.ok()) {  // named by the flag and the launch, which the library does not know
    std::string flag = fmt::format("--tensor-model-parallel-size {}", tp);
    if (pp > 1) flag += fmt::format(" x --pipeline-model-parallel-size {}", pp);
    if (cp > 1) flag += fmt::format(" x --context-parallel-size {}", cp);
    const int ep = options->expert_model_parallel_size;
    if (ep > 1) flag += fmt::format(" x --expert-model-parallel-size {}", ep);
    return ptk::UsageError(
        fmt::format("{}: {}; start a multiple of {} ranks ({})", flag, ptk::StatusMessage(made.status()),
                    tp * pp * std::lcm(cp, ep),
                    ranks.source == "single process" ? "this is one process" : "the ranks from " + ranks.source));
  }
  *layout = *std::move(made);
  // The settings' usage errors (exit 2) before the files' errors.
  PTK_ASSIGN_OR_RETURN(ptk::TrainPlan plan, ptk::PlanTraining(*options, (*layout)->data_size()));
  PTK_RETURN_IF_ERROR(CheckRunInputs(app, *options, (*layout)->Coords(ranks.rank).pipeline, pp, notes));
  return plan;
}

ptk::DistributedOptions DistributedOptionsOf(const ptk::TrainOptions& options, const ptk::TrainFlags& flags,
                                             const ptk::TrainingRanks& ranks, std::chrono::milliseconds timeout) {
  ptk::DistributedOptions d;
  d.backend = options.distributed_backend;
  d.backend_given = !flags.distributed_backend.empty();
  d.rank = ranks.rank;
  d.world_size = ranks.world_size;
  d.local_rank = ranks.local_rank;
  d.master_addr = ranks.master_addr;
  d.master_port = ranks.master_port;
  d.torchrun_store_port = ranks.torchrun_store_port;
  d.run_id = ranks.run_id;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME")) d.gloo_iface = iface;
  d.timeout = timeout;
  // NCCL's watchdog aborted a collective and this process did not come back from the GPU: end it,
  // so that the job fails instead of hanging until its time limit.
  d.on_stuck = [](const absl::Status& st) {
    ptk::log::Error("{}; the process did not return from the GPU after the abort: exiting", ptk::StatusMessage(st));
    std::_Exit(1);
  };
  return d;
}

// Another rank reported its own failure while this one was still busy starting (building its
// datasets' indices, loading --load, building the model: ptk::LocalPhaseWatch): RunMain's line
// naming that rank and its reason, what a signal's cleanup removes (this rank's unfinished files,
// its lock files), and RunMain's exit code, now rather than once that work is done.
void ExitOnPeerFailure(const absl::Status& st) {
  std::fflush(stdout);
  ptk::cli::PrintFailure(st);
  ptk::RemoveLiveTemporaries();
  ptk::RemoveLiveLocks();
  std::_Exit(ptk::cli::ExitCodeFor(st));
}

// This rank's communicators: the world's, then the tensor, data (with context parallelism Megatron's
// data × context group), pipeline, embedding and context groups (each a communicator of its own over
// the world's), made in that order by every rank (a middle stage has no embedding group). The ranks
// agree on `settings` over the world first: ranks started with another --tensor-model-parallel-size,
// --pipeline-model-parallel-size or --context-parallel-size would make other groups (each waiting
// for the others until the timeout, "did not join"); they are refused in one line naming the flag.
struct Groups {
  std::unique_ptr<ptk::Communicator> world, tensor, data, pipeline, embedding, context, expert, expert_data;
  ptk::Communicator* DataOrWorld() const { return data ? data.get() : world.get(); }
  void Close() {  // the groups before the world they were made from
    for (auto* c : {&expert_data, &expert, &context, &embedding, &pipeline, &data, &tensor, &world}) c->reset();
  }
};
// Made into *g, so that a failure after the world's communicator was made can still be reported over it.
absl::Status MakeGroups(const ptk::DistributedOptions& d, const ptk::ParallelLayout& layout,
                        const ptk::TrainOptions& options, const ptk::Settings& settings, int rank, Groups* out) {
  Groups& g = *out;
  PTK_ASSIGN_OR_RETURN(g.world, ptk::CreateCommunicator(d));
  PTK_RETURN_IF_ERROR(ptk::CheckRanksAgree(g.world.get(), settings));
  const int tp = layout.tensor_size(), pp = layout.pipeline_size(), cp = layout.context_size();
  if (tp > 1) {
    PTK_ASSIGN_OR_RETURN(g.tensor, g.world->Subgroup(layout.Group(ptk::ParallelGroup::kTensor, rank), "tensor"));
  }
  if (tp > 1 || pp > 1) {
    // Megatron reduces the gradients over data x context ranks (its data-parallel group with context parallel).
    const ptk::ParallelGroup kind = cp > 1 ? ptk::ParallelGroup::kDataContext : ptk::ParallelGroup::kData;
    PTK_ASSIGN_OR_RETURN(g.data, g.world->Subgroup(layout.Group(kind, rank), "data"));
  }
  if (pp > 1) {
    PTK_ASSIGN_OR_RETURN(g.pipeline, g.world->Subgroup(layout.Group(ptk::ParallelGroup::kPipeline, rank), "pipeline"));
    const std::vector<int> emb = layout.Group(ptk::ParallelGroup::kEmbedding, rank);
    // Tied embeddings, or multi-token prediction's copy of the word embeddings on the last stage.
    const bool shared = !options.model.untie_embeddings_and_output_weights || options.model.mtp_num_layers > 0;
    if (shared && !emb.empty()) {
      PTK_ASSIGN_OR_RETURN(g.embedding, g.world->Subgroup(emb, "embedding"));
    }
  }
  if (cp > 1) {
    PTK_ASSIGN_OR_RETURN(g.context, g.world->Subgroup(layout.Group(ptk::ParallelGroup::kContext, rank), "context"));
  }
  if (layout.expert_size() > 1) {  // Megatron's expert-parallel group, then its expert-data-parallel one
    PTK_ASSIGN_OR_RETURN(g.expert, g.world->Subgroup(layout.Group(ptk::ParallelGroup::kExpert, rank), "expert"));
    PTK_ASSIGN_OR_RETURN(g.expert_data,
                         g.world->Subgroup(layout.Group(ptk::ParallelGroup::kExpertData, rank), "expert-data"));
  }
  return absl::OkStatus();
}

// Megatron's start-up lines and ptk's notes, from rank 0. ptk's line of the parallel sizes orders them as
// Megatron's ranks are (tp-cp-ep-dp-pp: tensor, context, data, pipeline).
void PrintStart(const ptk::TrainOptions& options, const ptk::TrainPlan& plan, const ptk::ParallelLayout& layout,
                const ptk::TrainingRanks& ranks, const ptk::Communicator& world,
                const std::vector<std::string>& notes) {
  if (ranks.rank != 0) return;
  const int tp = layout.tensor_size(), pp = layout.pipeline_size();
  std::printf("%s\n", ptk::WorldSizeLine(layout).c_str());
  std::printf("%s\n", ptk::PaddedVocabLine(options.model.vocab_size, options.model.padded_vocab_size).c_str());
  if (tp > 1 || pp > 1)
    std::printf(
        "> initialized tensor model parallel with size %d\n> initialized pipeline model parallel with "
        "size %d\n",
        tp, pp);
  std::fflush(stdout);
  if (world.size() > 1)
    ptk::log::Info("{}{}data parallel: {} ranks{} ({}), {}, rendezvous at {}",
                   tp > 1 ? fmt::format("tensor parallel: {} ranks x ", tp) : "",
                   layout.context_size() > 1 ? fmt::format("context parallel: {} ranks x ", layout.context_size()) : "",
                   layout.data_size(),
                   pp > 1 ? fmt::format(" x pipeline parallel: {} stages{}", pp,
                                        options.pipeline_virtual_size > 1
                                            ? fmt::format(" of {} model chunks (the interleaved schedule)",
                                                          options.pipeline_virtual_size)
                                            : "")
                          : "",
                   ranks.source, world.backend(),
                   ptk::RendezvousAddressWords(ranks.master_addr, ranks.master_port, ranks.torchrun_store_port));
  for (const std::string& n : notes) ptk::log::Info("note: {}", n);
  for (const std::string& w : plan.warnings) ptk::log::Warning("{}", w);
}

// Threads for oneTBB (ptk::ChooseTrainingThreads): --threads, else this process's CPUs (its affinity
// mask capped by its cgroups' CPU quota); ranks sharing a node share its cores unless Slurm bound each
// to its own.
ptk::TrainingThreadsChoice TrainingThreads(const ptk::TrainFlags& flags, const ptk::TrainingRanks& ranks) {
  std::string launcher_cpus_var;
  for (const char* var : {"SLURM_CPUS_PER_TASK", "PTK_THREADS_PER_RANK"})
    if (launcher_cpus_var.empty() && std::getenv(var) != nullptr) launcher_cpus_var = var;
  return ptk::ChooseTrainingThreads(static_cast<int64_t>(flags.threads), ptk::ThisProcessCpuBudget(),
                                    static_cast<int>(std::thread::hardware_concurrency()), launcher_cpus_var, ranks);
}

void PrintDone(const ptk::TrainSummary& s) {
  if (s.skipped_training) {
    ptk::log::Info("done: --skip-train: evaluated the weights of iteration {}{}{}", s.iteration,
                   s.last_validation_loss ? fmt::format(", validation loss {:.6f}", *s.last_validation_loss) : "",
                   s.test_loss ? fmt::format(", test loss {:.6f}", *s.test_loss) : "");
    return;
  }
  if (s.nothing_to_train) {
    ptk::log::Info("done: nothing to train; the run is complete at iteration {} ({} samples consumed){}", s.iteration,
                   s.consumed_train_samples,
                   s.last_validation_loss ? fmt::format(", validation loss {:.6f}", *s.last_validation_loss) : "");
    return;
  }
  ptk::log::Info(
      "done: iteration {}, {} samples consumed{}, last lm loss {:.6f}{}{}", s.iteration, s.consumed_train_samples,
      s.skipped_train_samples > 0 ? fmt::format(" ({} skipped)", s.skipped_train_samples) : "", s.last_lm_loss,
      s.last_validation_loss ? fmt::format(", validation loss {:.6f}", *s.last_validation_loss) : "",
      s.exit_reason.empty() ? "" : " (" + s.exit_reason + ")");
}

// PTK_TRAIN_INCOMPLETE_EXIT=N (1..255): the exit code, on every rank, of a run that stopped before its
// last iteration with a checkpoint saved (--exit-signal-handler, --exit-interval,
// --exit-duration-in-mins) in place of Megatron's 0, so that a launcher that reruns ranks until
// training is complete (k8s/train.sh) need not work out the run's length from its flags. Unset or
// empty: 0 (Megatron's).
absl::StatusOr<int> IncompleteExitCode() {
  const char* v = std::getenv("PTK_TRAIN_INCOMPLETE_EXIT");
  if (v == nullptr || *v == '\0') return 0;
  const std::string_view s(v);
  int code = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), code);
  if (ec != std::errc() || end != s.data() + s.size() || code < 1 || code > 255)
    return ptk::UsageError(fmt::format("environment: PTK_TRAIN_INCOMPLETE_EXIT={}: an exit code from 1 to 255", s));
  return code;
}

// This rank's training once its communicators are made: threads, Megatron's start-up lines, the run.
absl::Status TrainRanks(const ptk::TrainFlags& flags, const ptk::TrainingRanks& ranks,
                        const ptk::ParallelLayout& layout, const ptk::TrainPlan& plan, std::vector<std::string> notes,
                        std::chrono::steady_clock::time_point started, const std::string& args_json,
                        const Groups& groups, ptk::TrainOptions* options, bool* incomplete) {
  const ptk::TrainingThreadsChoice threads = TrainingThreads(flags, ranks);
  if (!threads.reason.empty())
    notes.push_back(
        fmt::format("{} CPU thread{} per rank: {}", threads.threads, threads.threads == 1 ? "" : "s", threads.reason));
  PrintStart(*options, plan, layout, ranks, *groups.world, notes);
  if (!threads.warning.empty() && ranks.rank == 0) ptk::log::Warning("{}", threads.warning);

  // Process-wide settings belong to main: threads for oneTBB and OpenBLAS, signal handlers.
  tbb::global_control tbb_threads(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads.threads));
  // OpenBLAS single-threaded: the CPU ops cut every product into fixed tiles and run them on
  // oneTBB's threads, so the bits do not depend on --threads (OpenBLAS's kernel choice does).
  openblas_set_num_threads(1);
  if (flags.exit_signal_handler) options->exit_signal = &g_exit_signal;  // installed at the start of main
  options->on_peer_failure = ExitOnPeerFailure;
  options->started = started;
  options->comm = groups.DataOrWorld();
  options->world_comm = groups.world.get();
  options->backend.tensor_comm = groups.tensor.get();
  options->context_comm = options->backend.context_comm = groups.context.get();
  options->pipeline_comm = groups.pipeline.get();
  options->backend.expert_comm = groups.expert.get();
  options->backend.expert_data_comm = groups.expert_data.get();
  options->embedding_comm = groups.embedding.get();
  // One process per GPU: the device is the local rank's (CUDA_VISIBLE_DEVICES applies).
  options->backend.device_index = ranks.local_rank;
  options->ranks_on_node = std::max(1, ranks.ranks_on_node);
  options->ranks_on_node_source = ranks.ranks_on_node_source;
  // PTK_CUDA_SYNC_OPS=1: the CUDA model synchronises after every op and names the one that fails.
  if (const char* sync = std::getenv("PTK_CUDA_SYNC_OPS"); sync && std::string_view(sync) == "1")
    options->backend.sync_ops = true;
  options->args_json = args_json;
  PTK_ASSIGN_OR_RETURN(ptk::TrainSummary s, ptk::RunTraining(*options, plan));
  if (ranks.rank == 0) PrintDone(s);
  *incomplete = s.iteration < plan.train_iters;  // not exit_reason: --exit-interval may fire at the last one
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  const auto started = std::chrono::steady_clock::now();  // --exit-duration-in-mins counts from here
  auto app = ptk::cli::MakeApp("ptk-train",
                               "Train Megatron's GPT on Megatron-format data (CUDA: fp32, bf16, fp16; CPU: fp32).");
  ptk::TrainFlags flags;
  ptk::AddTrainFlags(app.get(), &flags);
  if (auto rc = ptk::cli::Parse(*app, argc, argv, ptk::LauncherFlagHints())) return *rc;
  if (flags.dry_run) return ptk::cli::RunMain([&] { return ptk::PrintDryRun(*app, &flags); });
  if (flags.exit_signal_handler) InstallExitSignalHandlers();
  // gloo writes to the other ranks with writev: a rank that wrote to the socket of a rank that had
  // died got SIGPIPE and died with it (exit 141, no message) instead of reporting the failure and
  // naming that rank. PyTorch's ranks run under Python, which ignores SIGPIPE; so does ptk-train (a
  // write to a closed socket or pipe fails with EPIPE instead).
  ::signal(SIGPIPE, SIG_IGN);

  int incomplete_exit = 0;  // PTK_TRAIN_INCOMPLETE_EXIT's code, returned when training stopped early
  bool incomplete = false;
  const int rc = ptk::cli::RunMain([&]() -> absl::Status {
    PTK_ASSIGN_OR_RETURN(incomplete_exit, IncompleteExitCode());
    // A bad RANK / WORLD_SIZE / SLURM_* / MASTER_PORT is a usage error (exit 2) naming it, as a bad flag.
    auto env_ranks = ptk::TrainingRanksFromEnv();
    if (absl::IsInvalidArgument(env_ranks.status()) && !ptk::IsUsageError(env_ranks.status()))
      return ptk::UsageError(fmt::format("environment: {}", ptk::StatusMessage(env_ranks.status())));
    PTK_ASSIGN_OR_RETURN(const ptk::TrainingRanks ranks, std::move(env_ranks));
    std::chrono::milliseconds timeout = ptk::DistributedOptions().timeout;
    if (flags.distributed_timeout_minutes > 0)
      timeout = std::chrono::milliseconds(static_cast<int64_t>(flags.distributed_timeout_minutes * 60000));

    std::vector<std::string> notes;
    ptk::TrainOptions options;
    std::optional<ptk::ParallelLayout> layout;
    std::unique_ptr<ptk::Gpt2Tokenizer> tokenizer;
    absl::StatusOr<ptk::TrainPlan> planned = PlanRun(*app, flags, ranks, &notes, &options, &layout, &tokenizer);
    // A rank whose own checks failed tells the others before it exits (through rank 0's store),
    // so that they end now naming it instead of waiting for it until the timeout.
    if (!planned.ok()) {
      ptk::RendezvousStore::ReportEarlyFailure(ranks.rank, ranks.world_size, ranks.master_addr, ranks.master_port,
                                               timeout, planned.status(), ranks.run_id);
      return planned.status();
    }
    const ptk::TrainPlan plan = *std::move(planned);
    // After the ranks met, a failure of this rank's own (datasets, checkpoint, memory, outputs, a
    // step) is told to the others before its connections close, so that every rank ends now naming
    // it (ptk::ReportRankFailure), not only this one while the others wait or guess.
    Groups groups;
    const ptk::Settings settings = ptk::RunSettings(options, plan.global_batch_size);
    ptk::DistributedOptions distributed = DistributedOptionsOf(options, flags, ranks, timeout);
    distributed.settings = ptk::AgreedSettingsText(settings);  // without a run id, what tells jobs apart
    absl::Status st = MakeGroups(distributed, *layout, options, settings, ranks.rank, &groups);
    if (st.ok())
      st = TrainRanks(flags, ranks, *layout, plan, notes, started, ArgsJson(argc, argv), groups, &options, &incomplete);
    // A rank that ends well says so first: its leaving is no death to a rank still starting (LocalPhaseWatch).
    if (st.ok() && groups.world && groups.world->failure_store()) groups.world->failure_store()->MarkFinished();
    if (!st.ok() && groups.world) {
      std::function<void()> serve_the_others = ptk::ReportRankFailure(groups.world.get(), st);
      groups.Close();  // this rank's pairs close: the others' collectives with it end at once
      if (serve_the_others) serve_the_others();
    }
    return st;
  });
  return rc == 0 && incomplete ? incomplete_exit : rc;
}
