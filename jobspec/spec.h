// Job specs: YAML or JSON file -> JobSpec (rackrun/v1/job_spec.proto) -> the settings
// the model and the trainer run with.
//
// One path for every spec: the file is parsed by yaml-cpp (JSON is YAML), `--set`
// overrides are applied to that tree, and the tree is mapped onto JobSpec field by field
// through protobuf reflection. Every error is an InvalidArgument whose message starts
// with the full field path (`model.moe.top_k: ...`) and says how to fix it.
//
// Strictness (the same for YAML, JSON and `--set` values): integers are decimal
// (`0100` is 100 as in YAML 1.2's core schema; `0x`/`0o` forms, exponents and `_`
// separators are refused with the decimal to write instead); numbers must be finite;
// a key given twice, a second YAML document, a mapping key that is not a word, NUL
// bytes or invalid UTF-8 are errors naming the field (or the line); nesting deeper than
// yaml-cpp's guard is reported as such, not as a bad file.
//
// Memory: ValidateJobSpec refuses sizes whose products overflow or whose estimate
// (jobspec/job_memory.h) exceeds kMaxJobBytes on any machine.
//
// Its own CMake target (rackrun_jobspec: protobuf, yaml-cpp, base; no model, BLAS or
// OpenMP), so the coordinator and the CLI validate specs before they travel. The settings
// the model and the trainer are built from live in runtime/job_config.h.
#ifndef RACKRUN_JOBSPEC_SPEC_H_
#define RACKRUN_JOBSPEC_SPEC_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/job_spec.pb.h"

namespace rackrun::jobspec {

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
// stored in checkpoints is explicit (spec.restart's: restart_policy.h).
void ApplySpecDefaults(rackrun::v1::JobSpec& spec);

// Checks required fields, ranges, choices and shape constraints of a defaulted spec
// (C divisible by heads, top_k <= experts, active <= streams, ...) and refuses sizes no
// machine holds (an estimate above kMaxJobBytes per rank, or size products that overflow).
// A missing size (0) is "required"; a negative one says it is negative. model.vocab may
// still be 0 (filled in from the token file). The first problem found is returned; the
// sections are checked in the order of JobSpec's fields (validation.cc: one validator per
// section, ValidateModel ... ValidateResources, restart_policy.h: ValidateRestart), then
// the experts' split over the expert-parallel degree (parallelism.expert_parallel, else
// resources.ranks; ExpertParallelLayoutOf when resources.ranks is set) and the job's size
// (job_memory.h).
absl::Status ValidateJobSpec(const rackrun::v1::JobSpec& spec);

// The expert-parallel layout of a job on `ranks` ranks (parallelism.expert_parallel):
// G ranks per domain, D = ranks / G domains. InvalidArgument naming the field and the fix
// when G is negative, does not divide `ranks`, or does not divide model.moe.experts. The
// CLI, the coordinator's Submit (through ValidateJobSpec, when resources.ranks is set) and
// the trainer (with the launched ranks) all ask this.
struct ExpertParallelLayout {
  int ranks = 1;
  int expert_parallel = 1;  // G
  int data_parallel = 1;    // D
};
absl::StatusOr<ExpertParallelLayout> ExpertParallelLayoutOf(const rackrun::v1::JobSpec& spec,
                                                            int ranks);

// The file paths of a spec, by field name: the datasets (data.train, data.validation, the
// paths of data.blend and data.validation_blend as "data.blend[3]": jobspec/data_blend.h),
// checkpoint.dir, logging.json, logging.load_trace. The one list of them: the CLI makes
// these absolute, the coordinator's Submit refuses them relative, a confined worker checks
// them.
std::vector<std::pair<std::string, std::string*>> SpecPathFields(rackrun::v1::JobSpec& spec);
std::vector<std::pair<std::string, const std::string*>> SpecPathFields(
    const rackrun::v1::JobSpec& spec);

// Rewrites every relative path of the spec (SpecPathFields) to an absolute one under
// `base_dir` (the submitting client's working directory): a job submitted to the
// coordinator runs in workers with other working directories, so paths travel absolute
// (and must be readable by every worker, e.g. on a shared file system).
void MakeSpecPathsAbsolute(rackrun::v1::JobSpec& spec, const std::string& base_dir);

// InvalidArgument naming the first field of SpecPathFields that holds a relative path
// (what the coordinator's Submit answers a client that did not make it absolute).
absl::Status CheckSpecPathsAbsolute(const rackrun::v1::JobSpec& spec);

// The spec as JSON with proto field names (for logs and checkpoints).
std::string JobSpecToJson(const rackrun::v1::JobSpec& spec);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_SPEC_H_
