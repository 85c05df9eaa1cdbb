// rackrun export / import: a checkpoint's weights as safetensors + config.json, and back
// (runtime/weights_export.h).
#include <cstdio>
#include <optional>
#include <string>

#include "flags/flags.h"
#include "runtime/weights_export.h"
#include "tools/rackrun/command.h"

namespace rackrun::cli {

int ExportCommand(const Args& args) {
  std::string checkpoint, output, format = "safetensors";
  flags::FlagSet flag_set("rackrun export", "CKPT --format safetensors --output DIR");
  flag_set.Describe(
      "Writes the model weights of checkpoint CKPT (a checkpoint file, or a folder: its newest)\n"
      "as DIR/model.safetensors (float32, little-endian, named as the model's parameters) and\n"
      "DIR/config.json (architecture, tokenizer, the exact model and job spec), for PyTorch,\n"
      "NumPy, JAX or the safetensors package. AdamW's moments are not exported.\n");
  flag_set.Epilogue(
      "example:\n  rackrun export out/tiny-moe/checkpoints --format safetensors --output "
      "out/export\n"
      "  python3 -c \"from safetensors.numpy import load_file; print(load_file('out/export/"
      "model.safetensors').keys())\"\n");
  flag_set.Positional("CKPT", &checkpoint, "checkpoint file or folder");
  flag_set.String("--format", &format, "FORMAT", "safetensors (the only one)");
  flag_set.String("--output", &output, "DIR", "folder for model.safetensors and config.json");
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  if (format != "safetensors")
    return flag_set.Fail("--format", "'" + format + "': use safetensors");
  if (output.empty()) return flag_set.Fail("--output", "missing; give the folder to write");
  absl::StatusOr<runtime::ExportedWeights> r = runtime::ExportSafetensors(checkpoint, output);
  if (!r.ok()) return flag_set.Fail(r.status(), 1);
  std::printf("exported step %lld of %s: %lld tensors, %lld parameters\n  %s\n  %s\n",
              static_cast<long long>(r->step), r->checkpoint.c_str(),
              static_cast<long long>(r->tensors), static_cast<long long>(r->parameters),
              r->safetensors.c_str(), r->config.c_str());
  return 0;
}

int ImportCommand(const Args& args) {
  std::string dir, output;
  int64_t step = 0;
  flags::FlagSet flag_set("rackrun import", "DIR --output CKPT_DIR [--step N]");
  flag_set.Describe(
      "Makes a checkpoint from DIR/model.safetensors and DIR/config.json (as `rackrun export`\n"
      "writes them) in CKPT_DIR, for `rackrun train SPEC --resume CKPT_DIR` with the same\n"
      "model spec: the weights, fresh AdamW moments, the data's tokenizer; the data stream\n"
      "starts from its beginning.\n");
  flag_set.Positional("DIR", &dir, "folder holding model.safetensors and config.json");
  flag_set.String("--output", &output, "CKPT_DIR", "checkpoint folder to write into");
  flag_set.Int("--step", &step, "N", "the step the checkpoint says it is at").Range(0);
  if (std::optional<int> exit = flag_set.ParseCommandLine(args)) return *exit;
  if (output.empty()) return flag_set.Fail("--output", "missing; give the checkpoint folder");
  absl::StatusOr<std::string> path = runtime::ImportSafetensors(dir, output, step);
  if (!path.ok()) return flag_set.Fail(path.status(), 1);
  std::printf("wrote %s\n", path->c_str());
  return 0;
}

}  // namespace rackrun::cli
