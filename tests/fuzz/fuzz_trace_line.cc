// Fuzz target: one load-trace line (planner/trace.h ParseTraceLine). A line that parses
// must format back to a line that parses to the same entry.
#include <string>
#include <string_view>

#include "planner/trace.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<rackrun::planner::TraceEntry> entry =
      rackrun::planner::ParseTraceLine(line, "fuzz:1");
  if (!entry.ok()) {
    FUZZ_CHECK(entry.status().message().substr(0, 7) == "fuzz:1:");
    return 0;
  }
  const std::string again = rackrun::planner::FormatTraceLine(*entry);
  absl::StatusOr<rackrun::planner::TraceEntry> reparsed =
      rackrun::planner::ParseTraceLine(again, "fuzz:2");
  FUZZ_CHECK(reparsed.ok());
  FUZZ_CHECK(*reparsed == *entry);
  return 0;
}
