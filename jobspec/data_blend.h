// The data section's paths: the blends (data.blend, data.validation_blend, written as
// Megatron-LM's --data-path) parsed once, and every data path of a spec with its field name,
// for whoever resolves, absolutises or confines them.
#ifndef RACKRUN_JOBSPEC_DATA_BLEND_H_
#define RACKRUN_JOBSPEC_DATA_BLEND_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rackrun/v1/job_spec.pb.h"

namespace rackrun::jobspec {

struct BlendItem {
  double weight = 1;  // < 0: weigh by the dataset's token count (a blend of paths only)
  std::string path;
};

// [W1, PATH1, W2, PATH2, ...] with every weight a positive finite number, or paths only
// (none of them a number). `field` ("data.blend") names it in errors, which show the form.
absl::StatusOr<std::vector<BlendItem>> ParseBlend(
    const google::protobuf::RepeatedPtrField<std::string>& items, absl::string_view field);

// The training data as a blend: data.blend, or data.train as one dataset of weight 1.
absl::StatusOr<std::vector<BlendItem>> TrainBlendOf(const rackrun::v1::DataSpec& data);
// The validation data the same way; empty when the job has none.
absl::StatusOr<std::vector<BlendItem>> ValidationBlendOf(const rackrun::v1::DataSpec& data);

// Every dataset path of `spec` with its field ("data.train", "data.blend[3]"), in spec
// order; empty fields and blends whose form is wrong contribute nothing (validation reports
// them). jobspec::SpecPathFields adds the outputs.
std::vector<std::pair<std::string, const std::string*>> DataPaths(const rackrun::v1::JobSpec& spec);
std::vector<std::pair<std::string, std::string*>> MutableDataPaths(rackrun::v1::JobSpec& spec);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_DATA_BLEND_H_
