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
// Memory: ValidateJobSpec estimates the bytes one rank needs (EstimateJobMemory, from
// the same shapes the model, AdamW, the MoE layers, the residual streams and the loader
// allocate) and refuses sizes whose products overflow or exceed kMaxJobBytes on any
// machine. Whether a job fits *this* machine is CheckJobMemory's question, asked where
// the job runs (runtime/job_config.h: CheckJobFitsThisMachine).
//
// Its own CMake target (rackrun_spec: protobuf, yaml-cpp, base; no model, BLAS or
// OpenMP), so the coordinator and the CLI validate specs before they travel. The settings
// the model and the trainer are built from live in runtime/job_config.h.
#ifndef RACKRUN_JOBSPEC_SPEC_H_
#define RACKRUN_JOBSPEC_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
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
// stored in checkpoints is explicit.
void ApplySpecDefaults(rackrun::v1::JobSpec& spec);

// Checks required fields, ranges, choices and shape constraints of a defaulted spec
// (C divisible by heads, top_k <= experts, active <= streams, ...) and refuses sizes no
// machine holds (an estimate above kMaxJobBytes per rank, or size products that overflow).
// A missing size (0) is "required"; a negative one says it is negative. model.vocab may
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

// ---- Memory accounting ----

// No job may need more than this per rank (1 PiB): beyond it a spec is refused
// everywhere, before any machine is asked.
inline constexpr int64_t kMaxJobBytes = int64_t{1} << 50;

// What the estimate depends on besides the spec.
struct JobMemoryInputs {
  int ranks = 1;                  // expert-parallel ranks (experts and batch rows split)
  int threads = 1;                // compute threads per rank (per-thread scratch)
  int64_t vocab = 0;              // used when model.vocab is 0 (the token file's vocab)
  int64_t train_tokens = 0;       // token ids in data.train (held in memory as int32)
  int64_t validation_tokens = 0;  // token ids in data.validation
};

// One term of the estimate: bytes, what it is, and the spec fields that size it.
struct MemoryTerm {
  std::string what;    // e.g. "LM-head logits [tokens x vocab]"
  std::string fields;  // e.g. "model.vocab, data.batch_size, model.seq_len"
  int64_t bytes = 0;
};

// Bytes one rank of a job needs, by component. The model's float tensors are counted
// from the shapes they are allocated with (runtime/model.h and its layers): parameters
// and their gradients, AdamW's two moments, one microbatch's activations and backward
// scratch (attention probabilities, MoE dispatch buffers and expert hidden states with
// a balanced expert load, the residual streams' saved state, the LM-head logits), the
// token ids of a batch, replica slots of an expert-parallel run, the token files, and a
// fixed process overhead (code, libraries, thread stacks).
struct JobMemoryEstimate {
  int ranks = 1;
  int64_t parameters = 0;    // trainable weights and buffers of this rank
  int64_t gradients = 0;
  int64_t optimizer = 0;     // AdamW moments (+ the packed dense-gradient buffer, ranks > 1)
  int64_t activations = 0;   // one microbatch: saved forward state + backward scratch
  int64_t batch = 0;         // token ids (inputs, targets, segment starts)
  int64_t expert_slots = 0;  // replica slots (ranks > 1)
  int64_t data = 0;          // token files in memory
  int64_t overhead = 0;      // process: code, libraries, thread stacks
  int64_t total = 0;
  int64_t parameter_count = 0;  // trainable parameters of this rank
  std::vector<MemoryTerm> terms;  // the largest contributors, largest first

  // "9.4 GiB per rank (parameters 2.3 GiB, gradients 2.3 GiB, ...)".
  std::string Describe() const;
};

// The estimate; InvalidArgument naming the fields when a size product overflows 64 bits.
absl::StatusOr<JobMemoryEstimate> EstimateJobMemory(const rackrun::v1::JobSpec& spec,
                                                    const JobMemoryInputs& inputs);

// Memory of the machine this process runs on. Zero = unknown.
struct MachineMemory {
  int64_t total = 0;         // MemTotal
  int64_t available = 0;     // MemAvailable
  int64_t cgroup_limit = 0;  // memory.max (v2) or memory.limit_in_bytes (v1); 0 = none
  int64_t cgroup_usage = 0;  // memory.current / memory.usage_in_bytes
  // What a new job may use: MemAvailable, capped by the cgroup's room when limited.
  int64_t usable() const;
  std::string Describe() const;
};
// Reads /proc/meminfo and this process's cgroup (v2, then v1).
MachineMemory ReadMachineMemory();
// The parsing behind ReadMachineMemory: /proc/meminfo text, the cgroup limit file's text
// ("max" or bytes; empty = none) and its usage file's text.
MachineMemory ParseMachineMemory(std::string_view meminfo, std::string_view cgroup_limit,
                                 std::string_view cgroup_usage);

// OK when `ranks_here` ranks of `estimate` fit `machine.usable()`; otherwise
// ResourceExhausted starting with the fields of the largest term, with the estimate, its
// largest terms, the machine's memory, and what to lower. Unknown machine memory: OK.
absl::Status CheckJobMemory(const JobMemoryEstimate& estimate, int ranks_here,
                            const MachineMemory& machine);

// "1.5 GiB", "12.0 MiB", "640 B".
std::string FormatBytes(int64_t bytes);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_SPEC_H_
