#include "jobspec/field_checks.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace rackrun::jobspec {

absl::Status FieldError(absl::string_view path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
}

absl::Status RequirePositive(absl::string_view path, int64_t value, absl::string_view what) {
  if (value > 0) return absl::OkStatus();
  if (value == 0) return FieldError(path, absl::StrCat("required; set ", what));
  return FieldError(path, absl::StrCat("is ", value, "; it must be positive: set ", what));
}

absl::Status AtLeast(absl::string_view path, int64_t value, int64_t min, absl::string_view zero) {
  if (value >= min) return absl::OkStatus();
  return FieldError(path, absl::StrCat("is ", value, "; it must be >= ", min,
                                       zero.empty() ? "" : absl::StrCat(" (", zero, ")")));
}

absl::Status Finite(absl::string_view path, double value) {
  if (std::isfinite(value)) return absl::OkStatus();
  return FieldError(path, absl::StrCat("is ", value, "; write a finite number"));
}

bool OneOf(const std::string& value, std::initializer_list<std::string_view> choices) {
  return std::find(choices.begin(), choices.end(), value) != choices.end();
}

}  // namespace rackrun::jobspec
