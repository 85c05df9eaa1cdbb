// What a job trains and validates on: the spec's data section (data.train or data.blend,
// data.validation or data.validation_blend) opened as loaders (data/loader.h), with the
// model's vocabulary settled against the data's before anything else is built.
#ifndef RACKRUN_RUNTIME_JOB_DATA_H_
#define RACKRUN_RUNTIME_JOB_DATA_H_

#include <memory>

#include "absl/status/statusor.h"
#include "data/loader.h"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/job_config.h"

namespace rackrun::runtime {

struct JobData {
  std::unique_ptr<data::Loader> train;
  std::unique_ptr<data::Loader> validation;  // null: no validation data
};

// Opens the loaders (the training one shuffled from `seed`, the validation one in order).
// `vocab` is model.vocab: 0 becomes the training data's vocabulary; a vocabulary smaller
// than the data's, training and validation data from different tokenizers, or data that
// records no vocabulary with model.vocab 0, are InvalidArgument errors naming both sides.
absl::StatusOr<JobData> OpenJobData(const rackrun::v1::JobSpec& spec, const TrainConfig& config,
                                    uint64_t seed, int* vocab);

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_JOB_DATA_H_
