// Fuzz target for the parsers of untrusted model files: the first byte picks the safetensors
// header parser, the config.json parser, the parser of `--numels @FILE` lists or the torch.save
// reader (zip directory and pickle), the rest is the file. Any exception other than
// InvalidArgument, any crash, leak or undefined behaviour is a finding.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "zeroflat/error.h"
#include "zeroflat/model_source.h"
#include "zeroflat/torch_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int parser = data[0] % 4;
  const std::span<const unsigned char> file(data + 1, size - 1);
  const std::string_view text(reinterpret_cast<const char*>(file.data()), file.size());
  try {
    if (parser == 3) {
      const zeroflat::TorchFile f = zeroflat::parse_torch_file(file, "fuzz");
      // The lookups walk what the reader built.
      for (const zeroflat::TorchTensor& t : f.tensors) (void)f.find(t.path);
      (void)f.find("a/0/b");
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
  }
  return 0;
}
