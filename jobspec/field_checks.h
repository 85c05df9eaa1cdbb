// How every check of a spec reports what is wrong, for the files of this module: an
// InvalidArgument whose message starts with the full field path
// (`model.moe.top_k: ...`), then what is wrong and how to fix it; and the range checks
// the section validators share (OK, or that error).
#ifndef RACKRUN_JOBSPEC_FIELD_CHECKS_H_
#define RACKRUN_JOBSPEC_FIELD_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace rackrun::jobspec {

// InvalidArgument "<path>: <message>".
absl::Status FieldError(absl::string_view path, absl::string_view message);

// A size the job cannot run without: 0 means "not given" ("required; set <what>"), a
// negative value is wrong.
absl::Status RequirePositive(absl::string_view path, int64_t value, absl::string_view what);

// value >= min, where `zero` explains what 0 (the default) means, if anything.
absl::Status AtLeast(absl::string_view path, int64_t value, int64_t min, absl::string_view zero);

// A finite number (not NaN or infinite).
absl::Status Finite(absl::string_view path, double value);

// Whether `value` is one of `choices`.
bool OneOf(const std::string& value, std::initializer_list<std::string_view> choices);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_FIELD_CHECKS_H_
