#include "runtime/step_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/file.h"

namespace rackrun::runtime {
namespace {

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.9g", v);
}

std::string JsonArray(const std::vector<double>& values) {
  std::vector<std::string> parts;
  for (const double v : values) parts.push_back(JsonNumber(v));
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

}  // namespace

std::string StepRecord::ToJson() const {
  std::vector<std::string> loads;
  for (const double l : expert_load_max_over_mean) loads.push_back(JsonNumber(l));
  return absl::StrCat(
      "{\"step\": ", step, ", \"loss\": ", JsonNumber(loss),
      ", \"val_loss\": ", val_loss ? JsonNumber(*val_loss) : "null",
      ", \"tokens_per_s\": ", JsonNumber(tokens_per_s), ", \"lr\": ", JsonNumber(lr),
      ", \"grad_norm\": ", JsonNumber(grad_norm), ", \"elapsed_s\": ", JsonNumber(elapsed_s),
      ", \"aux_loss\": ", JsonNumber(aux_loss), ", \"expert_load_max_over_mean\": [",
      absl::StrJoin(loads, ", "), "]",
      ranks > 1
          ? absl::StrCat(
                ", \"ranks\": ", ranks,
                ", \"rank_imbalance_before\": ", JsonArray(rank_imbalance_before),
                ", \"rank_imbalance_after\": ", JsonArray(rank_imbalance_after),
                ", \"replicas\": ", JsonNumber(replicas), ", \"plan_s\": ", JsonNumber(plan_s),
                ", \"plan_exchange_s\": ", JsonNumber(plan_exchange_s), ", \"fanout_s\": ",
                JsonNumber(fanout_s), ", \"dispatch_s\": ", JsonNumber(dispatch_s),
                ", \"replica_reduce_s\": ", JsonNumber(reduce_s),
                ", \"step_s\": ", JsonNumber(step_s), ", \"balancing_share\": ",
                JsonNumber(BalancingShare(plan_s, plan_exchange_s, fanout_s, reduce_s, step_s)),
                ", \"dense_allreduce_s\": ", JsonNumber(dense_allreduce_s),
                ", \"expert_allreduce_s\": ", JsonNumber(expert_allreduce_s),
                ", \"domain_stats_s\": ", JsonNumber(domain_stats_s), DomainsJson())
          : std::string(),
      "}");
}

std::string StepRecord::DomainsJson() const {
  if (domains.empty()) return std::string();
  std::vector<std::string> parts;
  for (const Domain& d : domains) {
    parts.push_back(absl::StrCat("{\"imbalance_before\": ", JsonArray(d.imbalance_before),
                                 ", \"imbalance_after\": ", JsonArray(d.imbalance_after),
                                 ", \"rank_tokens_before\": ", JsonArray(d.rank_tokens_before),
                                 ", \"rank_tokens_after\": ", JsonArray(d.rank_tokens_after), "}"));
  }
  return absl::StrCat(", \"expert_parallel\": ", expert_parallel, ", \"domains\": [",
                      absl::StrJoin(parts, ", "), "]");
}

double BalancingShare(double plan_s, double plan_exchange_s, double fanout_s, double reduce_s,
                      double step_s) {
  if (step_s <= 0) return 0;
  return (std::max(0.0, plan_s - plan_exchange_s) + fanout_s + reduce_s) / step_s;
}

std::string BalancingPhasesText(double plan_s, double plan_exchange_s, double fanout_s,
                                double dispatch_s, double reduce_s, double step_s) {
  return absl::StrFormat("plan(exch)/fan/a2a/red ms %.1f(%.1f)/%.1f/%.1f/%.1f bal %.1f%%",
                         1e3 * plan_s, 1e3 * plan_exchange_s, 1e3 * fanout_s, 1e3 * dispatch_s,
                         1e3 * reduce_s,
                         100 * BalancingShare(plan_s, plan_exchange_s, fanout_s, reduce_s, step_s));
}

std::string StepRecord::ToLogLine(int64_t steps) const {
  std::vector<std::string> loads;
  for (const double l : expert_load_max_over_mean) loads.push_back(absl::StrFormat("%.2f", l));
  std::string balance;
  if (ranks > 1) {
    std::vector<std::string> layers;
    for (size_t i = 0; i < rank_imbalance_before.size(); ++i) {
      layers.push_back(
          absl::StrFormat("%.2f>%.2f", rank_imbalance_before[i], rank_imbalance_after[i]));
    }
    balance = absl::StrCat(
        "  ranks ", absl::StrJoin(layers, "/"), "  ",
        BalancingPhasesText(plan_s, plan_exchange_s, fanout_s, dispatch_s, reduce_s, step_s));
  }
  return absl::StrFormat(
      "step %*d/%d  loss %.4f  val %s  tok/s %7.0f  lr %.2e  gnorm %6.3f  load %s%s  %6.1fs",
      static_cast<int>(std::to_string(steps).size()), step, steps, loss,
      val_loss ? absl::StrFormat("%.4f", *val_loss) : std::string("  -   "), tokens_per_s, lr,
      grad_norm, absl::StrJoin(loads, "/"), balance, elapsed_s);
}

absl::StatusOr<std::unique_ptr<StepLog>> StepLog::Create(
    int64_t log_interval, int64_t total_steps, const std::string& json_path, bool append,
    std::function<void(const StepRecord&)> on_record) {
  std::unique_ptr<StepLog> log(new StepLog());
  log->interval_ = std::max<int64_t>(1, log_interval);
  log->total_steps_ = total_steps;
  log->json_path_ = json_path;
  log->on_record_ = std::move(on_record);
  if (!json_path.empty()) {
    // A job file: never a FIFO or device, confined on a worker with --allowed-roots.
    absl::StatusOr<int> fd = base::OpenRegularFile(
        json_path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), base::FileUse::kJob);
    if (!fd.ok()) {
      return absl::Status(fd.status().code() == absl::StatusCode::kPermissionDenied
                              ? absl::StatusCode::kPermissionDenied
                              : absl::StatusCode::kInvalidArgument,
                          absl::StrCat("logging.json: ", fd.status().message()));
    }
    log->json_ = ::fdopen(*fd, append ? "a" : "w");
    if (log->json_ == nullptr) {
      ::close(*fd);
      return absl::InternalError(
          absl::StrCat("logging.json: fdopen '", json_path, "': ", std::strerror(errno)));
    }
    if (append && std::fseek(log->json_, 0, SEEK_END) == 0) {
      log->good_bytes_ = std::max(0L, std::ftell(log->json_));
    }
  }
  return log;
}

StepLog::~StepLog() { (void)Close(); }

void StepLog::OnStep(const StepRecord& record) {
  window_seconds_ += record.step_s;
  window_tokens_ += record.tokens;
  const bool last = record.step == total_steps_;
  if (!(last || record.val_loss.has_value() || record.step % interval_ == 0)) return;
  StepRecord r = record;
  r.tokens_per_s = window_seconds_ > 0 ? static_cast<double>(window_tokens_) / window_seconds_ : 0;
  window_seconds_ = 0;
  window_tokens_ = 0;
  if (on_record_) on_record_(r);
  if (json_ != nullptr && error_.ok()) {
    const std::string line = r.ToJson() + "\n";
    errno = 0;
    if (std::fwrite(line.data(), 1, line.size(), json_) != line.size() || std::fflush(json_) != 0) {
      error_ = absl::InternalError(absl::StrCat("logging.json: cannot write '", json_path_,
                                                "': ", std::strerror(errno != 0 ? errno : EIO)));
      // Whole records or nothing: drop the part of this record that reached the file
      // (after fclose, which may push out more of it), through the descriptor: the path
      // may lead elsewhere by now.
      const int fd = ::dup(::fileno(json_));
      std::fclose(json_);
      json_ = nullptr;
      if (fd >= 0) {
        (void)!::ftruncate(fd, static_cast<off_t>(good_bytes_));
        ::close(fd);
      }
    } else {
      good_bytes_ += static_cast<long>(line.size());
    }
  }
}

absl::Status StepLog::Close() {
  if (json_ != nullptr) {
    if (std::fclose(json_) != 0 && error_.ok()) {
      error_ = absl::InternalError(
          absl::StrCat("logging.json: cannot close '", json_path_, "': ", std::strerror(errno)));
    }
    json_ = nullptr;
  }
  return error_;
}

}  // namespace rackrun::runtime
