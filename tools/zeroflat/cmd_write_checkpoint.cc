// `zeroflat write-checkpoint`: a deterministic safetensors checkpoint of a model (the pattern
// `zeroflat run` fills tensors with), sharded as Hugging Face shards, into files it creates
// itself: never through a link, never over a file it did not create.
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/progress.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat::cli {

int subcommand_write_checkpoint(const std::vector<std::string>& argv) {
  Parser p("write-checkpoint", "DIR [--model NAME] [--dtype T] [--shard-size SIZE]",
           "Writes a deterministic safetensors checkpoint of a catalog model or config.json into\n"
           "a new directory, sharded like Hugging Face's (model-0000K-of-0000N.safetensors and\n"
           "model.safetensors.index.json; one model.safetensors when it fits one shard). Tensor\n"
           "i holds the same pattern `zeroflat run` fills it with, so a load of it can be\n"
           "compared with a run, byte for byte. No downloads: tests, benchmarks and rehearsals\n"
           "get real files. Every file is created new: a name in DIR that exists already (a\n"
           "file, or a link, even a dangling one) is refused, never written through, and a\n"
           "failed write removes only the files this run created.");
  add_model_options(p, "tiny-moe");
  p.option("dtype", "T", "the dtype stored: bf16, fp16 or fp32", "the model's own, else bf16");
  p.option("values", "T",
           "the pattern of dtype T, stored converted to --dtype (fp32 files holding bf16 "
           "values load into bf16 buffers exactly as `zeroflat run --dtype bf16` fills them)",
           "--dtype");
  p.option("shard-size", "SIZE",
           "the most tensor bytes per file (a larger tensor gets a file "
           "of its own)",
           "5GB");
  p.flag("quiet", "no progress on stderr");
  p.allow_positionals(1);
  p.epilog(
      "examples:\n"
      "  zeroflat write-checkpoint /tmp/ck --model tiny-moe --shard-size 4MB\n"
      "  zeroflat write-checkpoint /tmp/qwen1 --model qwen3-30b-a3b --layers 1 --experts 16\n"
      "  zeroflat write-checkpoint /tmp/ck32 --model tiny-moe --dtype fp32 --values bf16\n");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  if (args.positionals().empty()) throw UsageError("name the directory to write into");
  const std::string dir = args.positionals().front();
  const ModelSpec model = model_from_args(args, "tiny-moe");
  const DType dtype =
      args.get("dtype") ? parse_dtype(*args.get("dtype")) : model.dtype.value_or(DType::kBF16);
  std::optional<DType> values;
  if (auto v = args.get("values")) values = parse_dtype(*v);
  const std::uint64_t shard = args.get("shard-size")
                                  ? parse_size(*args.get("shard-size"), "--shard-size")
                                  : std::uint64_t{5'000'000'000};
  if (shard == 0) throw InvalidArgument("--shard-size 0: shards must hold something");
  const std::uint64_t total = model.numel() * element_size(dtype);
  // The disk must hold it: checked before the first byte is written.
  const CheckpointIndex planned = pattern_checkpoint_index(model, dtype, dir, shard);
  std::uint64_t file_total = 0;
  for (std::uint64_t b : planned.file_bytes) file_total += b;
  std::error_code ec;
  std::filesystem::path probe_dir = std::filesystem::absolute(dir, ec);
  while (!probe_dir.empty() && !std::filesystem::exists(probe_dir, ec)) {
    probe_dir = probe_dir.parent_path();
  }
  const auto space = std::filesystem::space(probe_dir, ec);
  if (!ec && space.available < file_total) {
    throw InvalidArgument(dir + ": the checkpoint needs " + format_bytes(file_total) + ", and " +
                          format_bytes(space.available) +
                          " is free there (try --layers or "
                          "--experts)");
  }
  // A file-size limit (ulimit -f) would kill the process midway with SIGXFSZ, leaving half a
  // checkpoint behind; ignored, the write fails with EFBIG instead, and the writer removes the
  // files it created.
  std::signal(SIGXFSZ, SIG_IGN);
  Progress progress(!args.has("quiet"));
  progress.begin(
      "write " + format_bytes(total) + " into " + std::to_string(planned.files.size()) + " file(s)",
      total);
  write_pattern_checkpoint(model, dtype, dir, shard, values,
                           [&](std::uint64_t n) { progress.advance(n); });
  progress.end();
  std::printf("wrote %s: %zu tensors of %s, %s in %zu file(s)%s\n", printable(dir, 200).c_str(),
              model.tensors.size(), printable(model.name).c_str(), format_bytes(total).c_str(),
              planned.files.size(),
              planned.files.size() > 1 ? " with model.safetensors.index.json" : "");
  return kExitOk;
}

}  // namespace zeroflat::cli
