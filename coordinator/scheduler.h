// Scheduler: which queued job starts next, on which workers, as which ranks.
//
// Strict FIFO: the oldest queued job starts when resources.ranks (0 means 1) idle workers
// offering its channel kind (resources.channel, default "gloo") are registered; later
// jobs wait behind it (no overtaking, so a wide job is not starved by narrow ones). A job
// in its restart backoff keeps its place and holds the queue until its time comes.
// Candidates are sorted by (host, launcher_rank, worker id); the first `ranks` are chosen
// and get ranks 0.. in that order, so the same rack gives the same ranks every time.
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
};

// The channel kind a job asks for ("gloo" when empty) and its rank count (>= 1).
std::string ChannelOf(const rackrun::v1::JobSpec& spec);
int RanksOf(const rackrun::v1::JobSpec& spec);

// The jobs of `queue` (FIFO order) that start now at `now_ms`, each on distinct workers.
std::vector<Placement> Schedule(const std::vector<QueuedJob>& queue, std::vector<IdleWorker> idle,
                                int64_t now_ms);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_SCHEDULER_H_
