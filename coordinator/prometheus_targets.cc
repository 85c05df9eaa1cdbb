#include "coordinator/prometheus_targets.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/file.h"

namespace rackrun::coordinator {

absl::Status PrometheusTargets::Update(const rackrun::v1::ListWorkersResponse& workers) {
  std::vector<std::string> targets;
  for (const rackrun::v1::Worker& w : workers.workers()) {
    if (w.metrics_address().empty() || w.state() == rackrun::v1::LOST ||
        w.state() == rackrun::v1::GONE) {
      continue;
    }
    targets.push_back(w.metrics_address());
  }
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  if (written_ && targets == last_) return absl::OkStatus();
  std::vector<std::string> quoted;
  for (const std::string& t : targets) {
    // Addresses are HOST:PORT from registered workers; refuse anything JSON would need to
    // escape rather than write a broken file.
    if (t.find_first_of("\"\\\n") != std::string::npos) continue;
    quoted.push_back(absl::StrCat("\"", t, "\""));
  }
  const std::string json = absl::StrCat("[{\"targets\": [", absl::StrJoin(quoted, ", "),
                                        "], \"labels\": {\"rackrun_role\": \"worker\"}}]\n");
  if (absl::Status s = base::WriteFileAtomically(path_, json); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--prometheus-targets: ", s.message()));
  }
  written_ = true;
  last_ = std::move(targets);
  return absl::OkStatus();
}

}  // namespace rackrun::coordinator
