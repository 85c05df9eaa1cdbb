#include "coordinator/scheduler.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/channel_names.h"
#include "jobspec/device.h"
#include "jobspec/job_memory.h"
#include "jobspec/spec.h"

namespace rackrun::coordinator {

std::string ChannelOf(const rackrun::v1::JobSpec& spec) {
  return std::string(comm::ChannelOrDefault(spec.resources().channel()));
}

int RanksOf(const rackrun::v1::JobSpec& spec) { return std::max(1, spec.resources().ranks()); }

int ExpertParallelOf(const rackrun::v1::JobSpec& spec) {
  const int ranks = RanksOf(spec);
  absl::StatusOr<jobspec::ExpertParallelLayout> layout =
      jobspec::ExpertParallelLayoutOf(spec, ranks);
  return layout.ok() ? layout->expert_parallel : ranks;
}

bool NeedsGpu(const rackrun::v1::JobSpec& spec) {
  absl::StatusOr<jobspec::DeviceSpec> device = jobspec::ParseDevice(spec.resources().device());
  return device.ok() && device->is_cuda();
}

int64_t GpuStateBytes(const rackrun::v1::JobSpec& spec) {
  absl::StatusOr<jobspec::JobMemoryEstimate> e =
      jobspec::EstimateJobMemory(spec, {.ranks = RanksOf(spec)});
  return e.ok() ? jobspec::DeviceStateBytes(*e) : 0;
}

namespace {

// Why a GPU job waits: `need` workers with a GPU offering `channel`; `idle` idle workers
// offer the channel, `gpus` of them with a GPU that holds `state` bytes, `small` with one
// that does not; `busy` GPU workers run other jobs.
std::string NoGpuReason(const rackrun::v1::JobSpec& spec, int need, const std::string& channel,
                        int idle, int gpus, int small, int64_t state, int busy) {
  return absl::StrCat(
      "not placed: resources.device: ", spec.resources().device(), " needs ", need, " idle worker",
      need == 1 ? "" : "s", " with a GPU offering channel ", channel, "; idle now: ", idle,
      " worker", idle == 1 ? "" : "s", ", ", gpus == 0 ? "none" : absl::StrCat(gpus), " with a GPU",
      small == 0 ? ""
                 : absl::StrCat(" of at least ", jobspec::FormatBytes(state),
                                " (a rank's parameters, gradients and AdamW moments), ", small,
                                " with a smaller one"),
      busy == 0 ? " ("
                : absl::StrCat("; busy now: ", busy,
                               " with a GPU (it starts when enough of them are idle, or "),
      "start rackrun-worker --device cuda:N on a GPU machine, or use resources.device: cpu)");
}

std::string LabelName(const std::string& rack) { return rack.empty() ? "(unlabeled)" : rack; }

// The candidates of one job by label, each group in (host, launcher_rank, id) order (the
// order of `idle`); indexes into `idle`.
using Groups = std::map<std::string, std::vector<size_t>>;

// Places `domains` domains of `g` ranks from `groups` (taken candidates are removed);
// false when the groups hold fewer than domains x g candidates. `ranks` gets the chosen
// indexes in rank order, `note` the domains that mix labels.
bool PlaceDomains(Groups groups, int domains, size_t g, std::vector<size_t>* ranks,
                  std::string* note) {
  size_t free = 0;
  for (const auto& [label, members] : groups) free += members.size();
  if (free < static_cast<size_t>(domains) * g) return false;
  const auto take = [&groups, ranks](const std::string& label, size_t n) {
    std::vector<size_t>& members = groups[label];
    ranks->insert(ranks->end(), members.begin(), members.begin() + static_cast<long>(n));
    members.erase(members.begin(), members.begin() + static_cast<long>(n));
  };
  // Best fit: the group with the fewest free candidates that still holds g (the first
  // label on ties); groups.end() when none does.
  const auto best_fit = [&groups, g] {
    auto best = groups.end();
    for (auto it = groups.begin(); it != groups.end(); ++it) {
      if (it->second.size() >= g &&
          (best == groups.end() || it->second.size() < best->second.size()))
        best = it;
    }
    return best;
  };
  int placed = 0;
  for (; placed < domains; ++placed) {
    const auto best = best_fit();
    if (best == groups.end()) break;
    take(best->first, g);
  }
  std::vector<std::string> mixed;
  for (int d = placed; d < domains; ++d) {
    std::vector<std::string> free_per_label, used;
    for (const auto& [label, members] : groups) {
      if (!members.empty())
        free_per_label.push_back(absl::StrCat(LabelName(label), ": ", members.size()));
    }
    size_t need = g;
    while (need > 0) {
      // The group with the most free candidates (free >= need, so one is not empty).
      auto largest = groups.begin();
      for (auto it = groups.begin(); it != groups.end(); ++it) {
        if (it->second.size() > largest->second.size()) largest = it;
      }
      const size_t n = std::min(need, largest->second.size());
      used.push_back(LabelName(largest->first));
      take(largest->first, n);
      need -= n;
    }
    mixed.push_back(absl::StrCat(
        "domain ", d, " spans racks ", absl::StrJoin(used, ", "), " (no rack label had ", g,
        " free workers; free: ", absl::StrJoin(free_per_label, ", "), ")"));
  }
  if (!mixed.empty()) {
    *note = absl::StrCat("placement: ", absl::StrJoin(mixed, "; "),
                         "; its expert-parallel traffic crosses racks");
  }
  return true;
}

}  // namespace

std::vector<Placement> Schedule(const std::vector<QueuedJob>& queue, std::vector<IdleWorker> idle,
                                int64_t now_ms, Unplaced* unplaced, int busy_gpu_workers) {
  if (unplaced != nullptr) *unplaced = Unplaced();
  std::sort(idle.begin(), idle.end(), [](const IdleWorker& a, const IdleWorker& b) {
    return std::tie(a.host, a.launcher_rank, a.worker_id) <
           std::tie(b.host, b.launcher_rank, b.worker_id);
  });
  std::vector<Placement> out;
  for (const QueuedJob& job : queue) {
    if (job.not_before_ms > now_ms) break;
    const std::string channel = ChannelOf(job.spec);
    const int need = RanksOf(job.spec);
    const int g = ExpertParallelOf(job.spec);
    const bool gpu = NeedsGpu(job.spec);
    const int64_t state = gpu ? GpuStateBytes(job.spec) : 0;
    Groups groups;
    int offering = 0;  // idle workers offering the channel, GPU or not
    int small = 0;     // of them, with a GPU that cannot hold `state`
    for (size_t i = 0; i < idle.size(); ++i) {
      const auto& c = idle[i].channels;
      if (std::find(c.begin(), c.end(), channel) == c.end()) continue;
      ++offering;
      if (gpu && idle[i].gpu && idle[i].gpu_bytes > 0 && idle[i].gpu_bytes < state) {
        ++small;
        continue;
      }
      if (!gpu || idle[i].gpu) groups[idle[i].rack].push_back(i);
    }
    int candidates = 0;
    for (const auto& [label, members] : groups) candidates += static_cast<int>(members.size());
    Placement p{job.job_id, {}, g, {}};
    std::vector<size_t> taken;
    if (!PlaceDomains(std::move(groups), need / g, static_cast<size_t>(g), &taken, &p.note)) {
      if (gpu && unplaced != nullptr) {
        *unplaced = {job.job_id, NoGpuReason(job.spec, need, channel, offering, candidates, small,
                                             state, busy_gpu_workers)};
      }
      break;
    }
    for (const size_t i : taken) p.ranks.push_back(idle[i]);
    std::sort(taken.begin(), taken.end());
    for (auto it = taken.rbegin(); it != taken.rend(); ++it)
      idle.erase(idle.begin() + static_cast<long>(*it));
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace rackrun::coordinator
