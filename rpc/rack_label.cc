#include "rpc/rack_label.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace rackrun::rpc {

absl::Status CheckRackLabel(const std::string& label) {
  if (static_cast<int>(label.size()) > kMaxRackLabelLength) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the rack label is ", label.size(), " characters long; use at most ", kMaxRackLabelLength));
  }
  for (const char c : label) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("the rack label '", label,
                       "' may hold only letters, digits, '.', '_' and '-' (e.g. rack-a)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace rackrun::rpc
