// Job specs: YAML or JSON file -> JobSpec (rackrun/v1/job_spec.proto) -> the settings
// the model and the trainer run with.
//
// One path for every spec: the file is parsed by yaml-cpp (JSON is YAML), `--set`
// overrides are applied to that tree, and the tree is mapped onto JobSpec field by field
// through protobuf reflection. Every error is an InvalidArgument whose message starts
// with the full field path (`model.moe.top_k: ...`) and says how to fix it.
#ifndef RACKRUN_RUNTIME_SPEC_H_
#define RACKRUN_RUNTIME_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/model.h"
#include "runtime/optimizer.h"

namespace rackrun::runtime {

// Parses `text` (YAML or JSON) onto a JobSpec, applying `overrides` ("a.b=c", later ones
// win) first. Fills defaults (ApplySpecDefaults) and validates (ValidateJobSpec).
// `origin` names the text in error messages (a file name or "<string>").
absl::StatusOr<rackrun::v1::JobSpec> ParseJobSpec(const std::string& text,
                                                  const std::vector<std::string>& overrides,
                                                  const std::string& origin = "<string>");

// Reads `path` and parses it as above. A missing file is an InvalidArgument naming it.
// Relative data paths that exist relative to the spec file's folder are rewritten to
// that location; otherwise they stay relative to the working directory.
absl::StatusOr<rackrun::v1::JobSpec> LoadJobSpec(const std::string& path,
                                                 const std::vector<std::string>& overrides);

// Replaces "use the default" zeros with the documented defaults, so the spec printed and
// stored in checkpoints is explicit.
void ApplySpecDefaults(rackrun::v1::JobSpec& spec);

// Checks required fields, ranges, choices and shape constraints of a defaulted spec
// (C divisible by heads, top_k <= experts, active <= streams, ...). model.vocab may
// still be 0 (filled in from the token file).
absl::Status ValidateJobSpec(const rackrun::v1::JobSpec& spec);

// The spec as JSON with proto field names (for logs and checkpoints).
std::string JobSpecToJson(const rackrun::v1::JobSpec& spec);

// Settings of the training loop, resolved from a defaulted JobSpec.
struct TrainConfig {
  std::string name;
  std::string train_path;
  std::string validation_path;  // empty: no validation
  int batch_size = 0;
  int seq_len = 0;
  int64_t steps = 0;
  uint64_t seed = 0;
  int microbatches = 1;
  LearningRateSchedule schedule;
  AdamWConfig adamw;
  double grad_clip = 0;  // 0 = off
  int64_t eval_interval = 0;
  int eval_batches = 0;
  std::string checkpoint_dir;  // empty: no checkpoints
  int64_t checkpoint_interval = 0;
  int checkpoint_keep = 2;
  int64_t log_interval = 10;
  std::string log_json;  // empty: none
  std::string load_trace;  // empty: none
  int threads = 0;       // 0: all cores
};

TrainConfig TrainConfigFromSpec(const rackrun::v1::JobSpec& spec);

// The model's configuration from a defaulted JobSpec (vocab as in the spec; the trainer
// fills a 0 from the token file).
ModelConfig ModelConfigFromSpec(const rackrun::v1::JobSpec& spec);

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_SPEC_H_
