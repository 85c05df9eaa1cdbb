// How every check of a spec reports what is wrong, for the files of this module: an
// InvalidArgument whose message starts with the full field path
// (`model.moe.top_k: ...`), then what is wrong and how to fix it.
#ifndef RACKRUN_JOBSPEC_FIELD_CHECKS_H_
#define RACKRUN_JOBSPEC_FIELD_CHECKS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rackrun::jobspec {

// InvalidArgument "<path>: <message>".
absl::Status FieldError(absl::string_view path, absl::string_view message);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_FIELD_CHECKS_H_
