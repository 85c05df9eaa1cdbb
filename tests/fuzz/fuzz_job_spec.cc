// Fuzz target: the job spec (jobspec/spec.h ParseJobSpec): YAML or JSON text plus --set
// overrides. Input: the spec text, then optionally a NUL byte followed by overrides, one
// per line ("model.width=64"). A spec that parses must survive its own JSON rendering
// (JobSpecToJson) parsed again, to the same spec.
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_split.h"
#include "google/protobuf/util/message_differencer.h"
#include "jobspec/spec.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string text(input.substr(0, nul));
  std::vector<std::string> overrides;
  if (nul != std::string_view::npos) {
    const std::string rest(input.substr(nul + 1));
    for (absl::string_view line : absl::StrSplit(rest, '\n', absl::SkipEmpty())) {
      overrides.emplace_back(line);
    }
  }
  absl::StatusOr<rackrun::v1::JobSpec> spec =
      rackrun::jobspec::ParseJobSpec(text, overrides, "fuzz.yaml");
  if (!spec.ok()) {
    FUZZ_CHECK(!spec.status().message().empty());
    return 0;
  }
  const std::string json = rackrun::jobspec::JobSpecToJson(*spec);
  absl::StatusOr<rackrun::v1::JobSpec> again = rackrun::jobspec::ParseJobSpec(json, {}, "json");
  if (!again.ok()) {
    std::fprintf(stderr, "re-parse of %s failed: %s\n", json.c_str(),
                 std::string(again.status().message()).c_str());
  }
  FUZZ_CHECK(again.ok());
  FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(*spec, *again));
  return 0;
}
