// Scheduler: which queued job starts next, on which workers, as which ranks.
//
// Strict FIFO: the oldest queued job starts when resources.ranks (0 means 1) idle workers
// offering its channel kind (resources.channel, default ucx: comm/channel_names.h) are
// registered; later jobs wait behind it (no overtaking, so a wide job is not starved by
// narrow ones). A job in its restart backoff keeps its place and holds the queue until its
// time comes.
//
// Placement by rack label: a job of R ranks runs D = R / G expert-parallel domains of G
// ranks (parallelism.expert_parallel; domain d = ranks d*G .. d*G+G-1). The candidates are
// grouped by their rack label (IdleWorker::rack; unlabeled workers form one group, as one
// unnamed rack). Domains are packed onto labels, domain 0 first: each takes the group with
// the fewest free candidates that still holds G (best fit; ties by label), so big groups
// stay whole for later domains and jobs. A domain that no group can hold alone is placed
// last, on the groups with the most free candidates first (the fewest labels mixed), and
// Placement::note says which domain spans which labels and why. Inside a group candidates
// are taken in (host, launcher_rank, worker id) order and get the domain's ranks in that
// order, so the same rack gives the same ranks every time; with no labels at all this is
// one group and the ranks are the first R candidates in that order.
//
// Devices: a job with resources.device cuda (or cuda:N) is placed only on workers that
// registered a GPU (IdleWorker::gpu; the worker's --device decides which of its GPUs runs
// it) whose memory holds a rank's parameters, gradients and AdamW moments (GpuStateBytes;
// a GPU that reported no size counts as large enough): on a smaller one the worker's own
// check would refuse the attempt. A cpu job may run on any worker, GPU workers included.
// When the oldest job cannot be placed for want of GPU workers, Unplaced says so (the
// job's message and events show it).
//
// Pure function of its inputs; thread-compatible.
#ifndef RACKRUN_COORDINATOR_SCHEDULER_H_
#define RACKRUN_COORDINATOR_SCHEDULER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/jobs.h"
#include "coordinator/workers.h"

namespace rackrun::coordinator {

struct Placement {
  std::string job_id;
  std::vector<IdleWorker> ranks;  // rank i at index i
  int expert_parallel = 1;        // G: rank i is in domain i / G
  // Empty when every domain sits on workers of one label; otherwise one line naming each
  // domain that mixes labels and the free workers per label (for the job's events).
  std::string note;
};

// The channel kind a job asks for (comm::kDefaultChannel when empty) and its rank count
// (>= 1).
std::string ChannelOf(const rackrun::v1::JobSpec& spec);
int RanksOf(const rackrun::v1::JobSpec& spec);
// Its ranks per expert-parallel domain (parallelism.expert_parallel, 0 = all ranks); a
// spec whose layout does not tile its ranks (refused at Submit) counts as one domain.
int ExpertParallelOf(const rackrun::v1::JobSpec& spec);

// Whether the job runs on a GPU (resources.device cuda or cuda:N; a spec whose device does
// not parse, refused at Submit, counts as cpu).
bool NeedsGpu(const rackrun::v1::JobSpec& spec);
// What one of its ranks keeps on its GPU from the start: parameters, gradients and AdamW
// moments (jobspec::DeviceStateBytes, the vocabulary counted when the spec names it); 0 when
// the spec gives no estimate.
int64_t GpuStateBytes(const rackrun::v1::JobSpec& spec);

// The job that holds the queue for a reason its submitter can act on: today a
// resources.device: cuda job without enough idle workers with a GPU. `reason` is one line
// naming resources.device, what the job needs and what is idle.
struct Unplaced {
  std::string job_id;
  std::string reason;
};

// The jobs of `queue` (FIFO order) that start now at `now_ms`, each on distinct workers.
// `unplaced` (optional) gets the job that holds the queue for want of GPU workers, or is
// cleared; its reason counts `busy_gpu_workers` (GPU workers running other jobs: the job
// may only be waiting for them) when there are any.
std::vector<Placement> Schedule(const std::vector<QueuedJob>& queue, std::vector<IdleWorker> idle,
                                int64_t now_ms, Unplaced* unplaced = nullptr,
                                int busy_gpu_workers = 0);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_SCHEDULER_H_
