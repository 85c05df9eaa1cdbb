// Checkpoints others can read: a checkpoint's model weights as a safetensors file plus a
// config.json naming the architecture (docs/design.md section 8), and back.
//
// Export (`rackrun export CKPT --format safetensors --output DIR`) writes
//   DIR/model.safetensors  every parameter and buffer of the model, float32, little-endian,
//                          named as in the checkpoint (the model's Parameters() names:
//                          embed, blocks.<i>.attn.{norm,wqkv,wo}, blocks.<i>.moe.{norm,router,
//                          experts.w13,experts.w2,shared.*,router_bias}, residual.*,
//                          final_norm, lm_head), shaped as the model holds them (experts
//                          whole: [experts, ...]); metadata format "pt" and the step;
//   DIR/config.json        architecture "rackrun-moe": vocab_size, width, blocks, heads,
//                          seq_len, experts, top_k, expert_hidden, shared expert, residual
//                          mode, streams, active, fixed, rope_theta, the tokenizer the data was
//                          made with, the step, the tensor names in file order, and the exact
//                          model spec (model_spec) and job spec (job_spec) for import.
// AdamW's moments stay in the checkpoint.
// Import (`rackrun import DIR --output CKPT_DIR`) makes a checkpoint that Trainer::Resume
// accepts for a job with the same model spec: the weights, fresh AdamW moments, the
// tokenizer; no data position (a resumed run starts the data stream from its beginning).
#ifndef RACKRUN_RUNTIME_WEIGHTS_EXPORT_H_
#define RACKRUN_RUNTIME_WEIGHTS_EXPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace rackrun::runtime {

struct ExportedWeights {
  std::string checkpoint;  // the checkpoint file read
  std::string safetensors;
  std::string config;
  int64_t tensors = 0;
  int64_t parameters = 0;  // floats
  int64_t step = 0;
};

// `checkpoint` is a checkpoint file or folder (its newest). Errors name the file.
absl::StatusOr<ExportedWeights> ExportSafetensors(const std::string& checkpoint,
                                                  const std::string& out_dir);

// Reads DIR/model.safetensors and DIR/config.json (as ExportSafetensors wrote them; every
// tensor the model has must be there, float32, of its shape) and writes a checkpoint of
// `step` into `checkpoint_dir`; returns its path.
absl::StatusOr<std::string> ImportSafetensors(const std::string& dir,
                                              const std::string& checkpoint_dir, int64_t step);

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_WEIGHTS_EXPORT_H_
