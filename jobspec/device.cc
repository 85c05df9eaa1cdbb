#include "jobspec/device.h"

#include <charconv>

#include "absl/strings/str_cat.h"
#include "jobspec/field_checks.h"

namespace rackrun::jobspec {
namespace {

// More GPUs than any machine holds (an NVL72 rack shows 72 to no single process).
constexpr int kMaxGpuIndex = 1023;

absl::Status DeviceError(std::string_view text, const std::string& why) {
  return FieldError("resources.device",
                    absl::StrCat("'", std::string(text), "' ", why,
                                 "; use cpu, cuda (the local rank's GPU) or cuda:N (GPU N of "
                                 "the machine, N from 0)"));
}

}  // namespace

std::string DeviceSpec::ToString() const {
  if (kind == Kind::kCpu) return "cpu";
  return index < 0 ? "cuda" : absl::StrCat("cuda:", index);
}

absl::StatusOr<DeviceSpec> ParseDevice(std::string_view text) {
  DeviceSpec d;
  if (text.empty() || text == "cpu") return d;
  if (text == "cuda") {
    d.kind = DeviceSpec::Kind::kCuda;
    return d;
  }
  constexpr std::string_view kPrefix = "cuda:";
  if (!text.starts_with(kPrefix)) return DeviceError(text, "is not a device");
  const std::string_view digits = text.substr(kPrefix.size());
  int index = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size() ||
      digits.front() == '+' || digits.front() == '-') {
    return DeviceError(text, "has no decimal GPU index after 'cuda:'");
  }
  if (index > kMaxGpuIndex) {
    return DeviceError(text, absl::StrCat("names GPU ", index, ", beyond any machine"));
  }
  d.kind = DeviceSpec::Kind::kCuda;
  d.index = index;
  return d;
}

}  // namespace rackrun::jobspec
