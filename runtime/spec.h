// Job specs: YAML or JSON file -> JobSpec (rackrun/v1/job_spec.proto) -> the settings
// the model and the trainer run with.
//
// One path for every spec: the file is parsed by yaml-cpp (JSON is YAML), `--set`
// overrides are applied to that tree, and the tree is mapped onto JobSpec field by field
// through protobuf reflection. Every error is an InvalidArgument whose message starts
// with the full field path (`model.moe.top_k: ...`) and says how to fix it.
//
// Its own CMake target (rackrun_spec: protobuf, yaml-cpp, base; no model, BLAS or
// OpenMP), so the coordinator and the CLI validate specs before they travel. The settings
// the model and the trainer are built from live in runtime/job_config.h.
#ifndef RACKRUN_RUNTIME_SPEC_H_
#define RACKRUN_RUNTIME_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/job_spec.pb.h"

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

// Rewrites every relative path of the spec (data.train, data.validation, checkpoint.dir,
// logging.json, logging.load_trace) to an absolute one under `base_dir` (the submitting
// client's working directory): a job submitted to the coordinator runs in workers with
// other working directories, so paths travel absolute (and must be readable by every
// worker, e.g. on a shared file system).
void MakeSpecPathsAbsolute(rackrun::v1::JobSpec& spec, const std::string& base_dir);

// The spec as JSON with proto field names (for logs and checkpoints).
std::string JobSpecToJson(const rackrun::v1::JobSpec& spec);

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_SPEC_H_
