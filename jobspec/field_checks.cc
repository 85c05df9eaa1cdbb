#include "jobspec/field_checks.h"

#include "absl/strings/str_cat.h"

namespace rackrun::jobspec {

absl::Status FieldError(absl::string_view path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
}

}  // namespace rackrun::jobspec
