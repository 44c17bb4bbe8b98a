// Fuzz target for the parsers of untrusted model files: the first byte picks the safetensors
// header parser, the config.json parser, the parser of `--numels @FILE` lists, the torch.save
// reader (zip directory and pickle, then every value as the Python binding takes it: the
// allow-list row of each value that names code, each tensor's bytes; then the same bytes as a
// folder's pytorch_model.bin, its tensors read through the index) or a DeepSpeed checkpoint
// folder (the rest of the input split into a module file and one rank's optimizer file, then
// the folder's checks, the resume's plan at new worlds and each rank's reads in it, and every
// target's source); a first byte of 250 or more picks DCP's `.metadata` index (the restricted
// machine with its DCP rows, then every field of the index), 245 to 249 a folder of two
// safetensors files opened with pieces (DCP_SHARDING_INFO placements, the tiling checks, then
// every piece looked up and read as the DCP reader reads it). Any exception other than
// InvalidArgument or Unsupported, any crash, hang, leak or undefined behaviour is a finding.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/torch_file.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/dcp_checkpoint.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/loader.h"
#include "zeroflat/resume.h"

namespace {

// What the binding does with a value, less Python: the row of every value that names code
// (and the enum member's name), the bytes of every tensor.
void walk(const zeroflat::TorchFile& f, const zeroflat::TorchValue& v,
          std::span<const unsigned char> bytes, std::uint64_t& budget) {
  using K = zeroflat::TorchKind;
  if (v.kind == K::kObject || v.kind == K::kEnum || v.kind == K::kGlobal) {
    if (zeroflat::torch_global_of(v) == nullptr) __builtin_trap();  // the reader made it: a row
    (void)v.member();
  }
  if (v.kind == K::kTensor) {
    const zeroflat::TorchTensor& t = f.tensors.at(static_cast<std::size_t>(v.integer));
    budget -= zeroflat::read_torch_tensor(f, t, bytes, budget).size();
  }
  for (const zeroflat::TorchValue& x : v.items) walk(f, x, bytes, budget);
  for (const auto& [key, value] : v.entries) {
    walk(f, key, bytes, budget);
    walk(f, value, bytes, budget);
  }
}

void write(const std::filesystem::path& path, std::span<const unsigned char> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A fresh directory of this process for the folder targets.
const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d = std::filesystem::temp_directory_path() /
                              ("zeroflat-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// Every tensor of `ck` of a dtype the loader converts and at most 4096 elements, read whole
// into fp32 as the loader reads it.
void read_small_tensors(const zeroflat::CheckpointIndex& ck) {
  std::vector<unsigned char> out;
  for (const zeroflat::CheckpointTensor& t : ck.tensors) {
    if (!t.type || t.numel > 4096) continue;
    out.resize(t.numel * 4);
    zeroflat::BoxRead box{t.name, std::vector<std::uint64_t>(t.shape.size(), 0),
                          std::vector<std::uint64_t>(t.shape.begin(), t.shape.end()), out.data(),
                          zeroflat::DType::kFP32};
    (void)zeroflat::read_checkpoint_boxes(ck, std::vector<zeroflat::BoxRead>{box}, 1);
  }
}

// Two safetensors files (the input split as for folder()) opened with pieces; every piece
// looked up by its place and, when small, read whole into its dtype.
void pieces(std::span<const unsigned char> in) {
  if (in.size() < 2) return;
  const std::size_t split =
      std::min<std::size_t>(in.size() - 2, (std::size_t{in[0]} << 8) | in[1]);
  const std::filesystem::path dir = scratch() / "pieces";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  write(dir / "shard-1.safetensors", in.subspan(2, split));
  write(dir / "shard-2.safetensors", in.subspan(2 + split));
  const zeroflat::CheckpointIndex ck = zeroflat::open_checkpoint(dir.string(), {.pieces = true});
  std::vector<zeroflat::PieceRef> refs;
  for (const zeroflat::CheckpointTensor& t : ck.tensors) refs.push_back({t.name, t.piece_offsets});
  const zeroflat::CheckpointIndex got = zeroflat::checkpoint_pieces(ck, refs);
  read_small_tensors(got);
}

// The same bytes as a Hugging Face folder's pytorch_model.bin: the state dict's checks, then every
// small tensor read through the index as the loader reads a safetensors tensor.
void state_dict_folder(std::span<const unsigned char> in) {
  const std::filesystem::path dir = scratch() / "bin";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  write(dir / "pytorch_model.bin", in);
  const zeroflat::CheckpointIndex ck = zeroflat::open_checkpoint(dir.string());
  for (const zeroflat::CheckpointTensor& t : ck.tensors) {
    if (ck.find(t.name) == nullptr) __builtin_trap();  // every entry found by its name
  }
  read_small_tensors(ck);
}

// A folder of one module file and one rank's optimizer file (ZeRO-1/2's names, or ZeRO-3's
// when `zero3`), written fresh for each input.
void folder(std::span<const unsigned char> in) {
  if (in.size() < 3) return;
  const bool zero3 = (in[0] & 1) != 0;
  const std::size_t split = std::min<std::size_t>(in.size() - 3, (std::size_t{in[1]} << 8) | in[2]);
  const std::span<const unsigned char> model = in.subspan(3, split);
  const std::span<const unsigned char> optim = in.subspan(3 + split);
  const std::filesystem::path& dir = scratch();
  std::filesystem::remove(dir / "mp_rank_00_model_states.pt");
  std::filesystem::remove(dir / "zero_pp_rank_0_mp_rank_00_model_states.pt");
  write(dir / (zero3 ? "zero_pp_rank_0_mp_rank_00_model_states.pt" : "mp_rank_00_model_states.pt"),
        model);
  write(dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", optim);
  const zeroflat::DeepSpeedCheckpoint ck = zeroflat::open_deepspeed_checkpoint(dir.string());
  for (std::uint64_t world : {std::uint64_t{1}, std::uint64_t{3}}) {
    zeroflat::ResumeOptions o;
    o.world = world;
    const zeroflat::ResumePlan plan = zeroflat::plan_resume(ck, o);
    for (std::uint64_t rank = 0; rank < world; ++rank) (void)zeroflat::resume_rank(plan, rank);
  }
  std::vector<std::string> names;
  std::vector<std::uint64_t> numels;
  for (const zeroflat::DeepSpeedGroup& g : ck.groups) {
    for (const zeroflat::DeepSpeedParam& p : g.params) {
      names.push_back(p.name);
      numels.push_back(p.numel);
    }
  }
  std::vector<std::string> targets = zeroflat::deepspeed_partitioned_states(ck);
  targets.insert(targets.begin(), "fp32");
  for (const std::string& t : targets) (void)zeroflat::deepspeed_source(ck, t, names, numels);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int parser = data[0] >= 250 ? 5 : data[0] >= 245 ? 6 : data[0] % 5;
  const std::span<const unsigned char> file(data + 1, size - 1);
  const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  try {
    if (parser == 6) {
      pieces(file);
    } else if (parser == 5) {
      const zeroflat::DcpCheckpoint ck = zeroflat::parse_dcp_metadata(file, "fuzz");
      for (const zeroflat::DcpItem& item : ck.items) {
        if (ck.find(item.fqn) == nullptr) __builtin_trap();  // every item found by its name
      }
    } else if (parser == 4) {
      folder(file);
    } else if (parser == 3) {
      const zeroflat::TorchFile f = zeroflat::parse_torch_file(file, "fuzz");
      // The lookups walk what the reader built; the values go as they go to Python.
      for (const zeroflat::TorchTensor& t : f.tensors) (void)f.find(t.path);
      (void)f.find("a/0/b");
      std::uint64_t budget = f.file_bytes + (std::uint64_t{1} << 20);
      walk(f, f.root, file, budget);
      state_dict_folder(file);
    } else if (parser == 2) {
      (void)zeroflat::parse_numels_file_text(text, "fuzz");
    } else if (parser == 1) {
      zeroflat::TransformerConfig c = zeroflat::parse_hf_config(text, "fuzz");
      // Building the tensor list is part of what a config drives; keep it small.
      if (c.num_layers <= 4 && c.num_experts <= 8 && c.hidden_size <= 4096) {
        (void)zeroflat::build_transformer("fuzz", c);
      }
    } else {
      (void)zeroflat::parse_safetensors_header(file, file.size(), "fuzz");
    }
  } catch (const zeroflat::InvalidArgument&) {
    // The expected answer to malformed input.
  } catch (const zeroflat::Unsupported&) {
    // A checkpoint of a kind the resume does not serve (model parallelism, ...).
  }
  return 0;
}
