#include "coordinator/scheduler.h"

#include <algorithm>
#include <tuple>

namespace rackrun::coordinator {

std::string ChannelOf(const rackrun::v1::JobSpec& spec) {
  return spec.resources().channel().empty() ? "gloo" : spec.resources().channel();
}

int RanksOf(const rackrun::v1::JobSpec& spec) { return std::max(1, spec.resources().ranks()); }

std::vector<Placement> Schedule(const std::vector<QueuedJob>& queue, std::vector<IdleWorker> idle,
                                int64_t now_ms) {
  std::sort(idle.begin(), idle.end(), [](const IdleWorker& a, const IdleWorker& b) {
    return std::tie(a.host, a.launcher_rank, a.worker_id) < std::tie(b.host, b.launcher_rank, b.worker_id);
  });
  std::vector<Placement> out;
  for (const QueuedJob& job : queue) {
    if (job.not_before_ms > now_ms) break;
    const std::string channel = ChannelOf(job.spec);
    const size_t need = static_cast<size_t>(RanksOf(job.spec));
    Placement p{job.job_id, {}};
    std::vector<size_t> taken;
    for (size_t i = 0; i < idle.size() && p.ranks.size() < need; ++i) {
      const auto& c = idle[i].channels;
      if (std::find(c.begin(), c.end(), channel) == c.end()) continue;
      p.ranks.push_back(idle[i]);
      taken.push_back(i);
    }
    if (p.ranks.size() < need) break;
    for (auto it = taken.rbegin(); it != taken.rend(); ++it) idle.erase(idle.begin() + static_cast<long>(*it));
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace rackrun::coordinator
