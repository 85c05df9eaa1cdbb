#include "tools/rackrun/job_view.h"

#include <algorithm>
#include <ctime>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/json_util.h"
#include "runtime/step_log.h"

namespace rackrun::cli {

std::string StateName(rackrun::v1::JobState state) { return rackrun::v1::JobState_Name(state); }

std::string FailureLine(const rackrun::v1::Failure& f) {
  std::string line = rackrun::v1::FailureKind_Name(f.kind());
  if (f.rank() >= 0) absl::StrAppend(&line, " rank ", f.rank());
  std::string who;
  if (!f.worker_id().empty()) absl::StrAppend(&who, "worker ", f.worker_id());
  if (!f.host().empty()) absl::StrAppend(&who, who.empty() ? "" : ", ", "host ", f.host());
  if (f.pid() > 0) absl::StrAppend(&who, who.empty() ? "" : ", ", "pid ", f.pid());
  if (!who.empty()) absl::StrAppend(&line, " (", who, ")");
  if (!f.phase().empty()) absl::StrAppend(&line, " in ", f.phase());
  absl::StrAppend(&line, " at step ", f.step());
  if (!f.message().empty()) absl::StrAppend(&line, ": ", f.message());
  if (!f.replaced_verdict().empty())
    absl::StrAppend(&line, " (replaces the verdict ", f.replaced_verdict(), ")");
  return line;
}

double MeanOf(const google::protobuf::RepeatedField<double>& values) {
  if (values.empty()) return 0;
  double sum = 0;
  for (double v : values) sum += v;
  return sum / values.size();
}

std::string ProgressLine(const rackrun::v1::StepProgress& p) {
  std::string line = absl::StrFormat("step %d/%d loss %.4f", p.step(), p.total_steps(), p.loss());
  if (p.has_val_loss()) absl::StrAppendFormat(&line, " val %.4f", p.val_loss());
  absl::StrAppendFormat(&line, " %.0f tok/s", p.tokens_per_s());
  if (!p.imbalance_before().empty()) {
    absl::StrAppendFormat(&line, " imbalance %.2f -> %.2f", MeanOf(p.imbalance_before()),
                          MeanOf(p.imbalance_after()));
    absl::StrAppend(&line, " ",
                    runtime::BalancingPhasesText(p.plan_s(), p.plan_exchange_s(), p.fanout_s(),
                                                 p.dispatch_s(), p.reduce_s(), p.step_time_s()));
  }
  absl::StrAppendFormat(&line, " step %.3f s elapsed %.1f s", p.step_time_s(), p.elapsed_s());
  return line;
}

namespace {

// Largest over mean value (1 = even), 0 when empty or all 0.
double MaxOverMean(const google::protobuf::RepeatedField<double>& values) {
  const double mean = MeanOf(values);
  if (values.empty() || mean <= 0) return 0;
  return *std::max_element(values.begin(), values.end()) / mean;
}

}  // namespace

std::vector<std::string> DomainLines(const rackrun::v1::StepProgress& p) {
  std::vector<std::string> lines;
  if (p.domains_size() <= 1) return lines;
  for (const rackrun::v1::DomainProgress& d : p.domains()) {
    std::string line = absl::StrFormat("domain %d: ranks %d-%d, imbalance %.2f -> %.2f", d.domain(),
                                       d.first_rank(), d.first_rank() + d.ranks() - 1,
                                       MeanOf(d.imbalance_before()), MeanOf(d.imbalance_after()));
    int worst = -1;
    for (int l = 0; l < d.imbalance_after_size() && l < d.imbalance_before_size(); ++l) {
      if (worst < 0 || d.imbalance_after(l) > d.imbalance_after(worst)) worst = l;
    }
    if (worst >= 0) {
      absl::StrAppendFormat(&line, " (worst layer %d: %.2f -> %.2f)", worst,
                            d.imbalance_before(worst), d.imbalance_after(worst));
    }
    if (!d.rank_tokens_before().empty()) {
      absl::StrAppendFormat(&line, ", step's tokens per rank max/mean %.2f -> %.2f",
                            MaxOverMean(d.rank_tokens_before()),
                            MaxOverMean(d.rank_tokens_after()));
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

std::string TimeText(int64_t unix_ms) {
  if (unix_ms <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

}  // namespace rackrun::cli
