// ptk-convert: ptk checkpoints <-> Hugging Face GPT-2 directories, with the flags of Megatron's
// tools/checkpoint/convert.py (--model-type, --loader, --saver, --load-dir, --save-dir).
#include <cstdio>

#include "common/cli.h"
#include "common/json_writer.h"
#include "common/logging.h"
#include "common/status.h"
#include "interop/hf_gpt2.h"

int main(int argc, char** argv) {
  auto app = ptk::cli::MakeApp(
      "ptk-convert",
      "Convert a ptk checkpoint to a Hugging Face GPT-2 directory (--loader ptk --saver hf) or back (--loader hf "
      "--saver ptk).");
  ptk::ConvertOptions o;
  std::string model_type = "GPT";
  int64_t target_tp = 1, target_pp = 1, max_queue_size = 50;
  app->add_option("--model-type", model_type, "GPT (the only model ptk has)")->check(CLI::IsMember({"GPT"}));
  app->add_option("--loader", o.loader, "What --load-dir holds: ptk (a ptk-train --save directory) or hf")
      ->required()
      ->check(CLI::IsMember({"ptk", "hf"}));
  app->add_option("--saver", o.saver, "What to write to --save-dir: hf or ptk")
      ->required()
      ->check(CLI::IsMember({"hf", "ptk"}));
  app->add_option("--load-dir", o.load_dir, "The checkpoint directory (its latest iteration) or HF directory to read")
      ->required();
  app->add_option("--save-dir", o.save_dir, "The HF directory or ptk checkpoint directory to write")->required();
  app->add_option("--true-vocab-size", o.true_vocab_size,
                  "ptk -> hf: the tokenizer's vocabulary size (default: the one the training run recorded)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  app->add_option("--vocab-file", o.vocab_file, "ptk -> hf: the vocab.json to ship (default: ptk's GPT-2 file)");
  app->add_option("--merge-file", o.merge_file, "ptk -> hf: the merges.txt to ship (default: ptk's GPT-2 file)");
  app->add_flag("--force", o.force,
                "ptk -> hf: replace a --save-dir that holds files an export does not write (they are removed)");
  app->add_option("--make-vocab-size-divisible-by", o.make_vocab_size_divisible_by,
                  "hf -> ptk: pad the vocabulary to a multiple of this, as ptk-train will (128)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  app->add_option("--target-tensor-parallel-size", target_tp, "Must be 1: ptk checkpoints are one file")
      ->check(CLI::Range(1, 1));
  app->add_option("--target-pipeline-parallel-size", target_pp, "Must be 1: ptk checkpoints are one file")
      ->check(CLI::Range(1, 1));
  app->add_option("--max-queue-size", max_queue_size, "Accepted for compatibility (no queue: one process)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 31));
  if (auto rc = ptk::cli::Parse(*app, argc, argv)) return *rc;

  return ptk::cli::RunMain([&]() -> absl::Status {
    ptk::JsonWriter args;
    args.BeginArray();
    for (int i = 1; i < argc; ++i) args.Value(argv[i]);
    o.args_json = args.EndArray().str();
    PTK_ASSIGN_OR_RETURN(ptk::ConvertSummary s, ptk::RunConvert(o));
    for (const std::string& n : s.notes) ptk::log::Info("note: {}", n);
    const auto& c = s.config;
    ptk::log::Info(
        "converted {} (iteration {}) -> {}: {} layers, hidden {}, {} heads, ffn {}, {} positions, vocabulary {}{}, "
        "{} parameters",
        s.source, s.iteration, s.destination, c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_hidden_size,
        c.max_position_embeddings, c.vocab_size, c.untie_embeddings_and_output_weights ? ", untied output layer" : "",
        s.num_params);
    if (!s.train_flags.empty())
      ptk::log::Info("continue training with: ptk-train {} --seq-length N (N <= {}) --load {} --finetune ...",
                     s.train_flags, c.max_position_embeddings, o.save_dir);
    return absl::OkStatus();
  });
}
