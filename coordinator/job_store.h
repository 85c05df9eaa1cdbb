// JobStore: the coordinator's durable state in one SQLite database (WAL journal,
// synchronous=FULL): jobs, their attempts, their events, and a counter for worker ids.
//
// Durability: every method that changes data runs one transaction and returns only after
// it committed. synchronous=FULL makes the commit fsync the WAL, so an acknowledged
// mutation survives a kill -9 of the process *and* a power loss (NORMAL+WAL would survive
// kill -9 only; the cost is one fsync per commit, small next to an RPC round trip).
// Submit idempotency is enforced by the database (request_id UNIQUE), not by memory.
//
// Thread safety: all methods are thread-safe (one connection behind a mutex).
#ifndef RACKRUN_COORDINATOR_JOB_STORE_H_
#define RACKRUN_COORDINATOR_JOB_STORE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/sync.h"
#include "rackrun/v1/job_service.pb.h"

struct sqlite3;

namespace rackrun::coordinator {

// One job as persisted: the record (with attempts) and its events in seq order.
struct StoredJob {
  rackrun::v1::Job job;
  std::vector<rackrun::v1::JobEvent> events;
};

// What one acknowledged change writes, atomically.
struct JobMutation {
  rackrun::v1::Job job;  // the whole record after the change (attempts included)
  std::vector<rackrun::v1::JobEvent> events;  // appended (seq must continue the job's)
  std::vector<int64_t> dropped;               // seqs of the job's events removed
};

class JobStore {
 public:
  // Opens or creates the database at `path` (creating tables). Internal on SQLite errors.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  struct InsertResult {
    rackrun::v1::Job job;  // with its id
    bool created = false;  // false: request_id existed; `job` is the stored one
  };
  // Inserts `job` (id empty, request_id set) with the id "j-<n>" and the event `first`
  // (seq 1; its job_id is filled in). When a job with the same request_id exists, nothing
  // is written and that job is returned.
  absl::StatusOr<InsertResult> InsertJob(const rackrun::v1::Job& job,
                                         const rackrun::v1::JobEvent& first);

  // Writes the job's record (state, times, message, first failure, attempts) and appends
  // the events, in one transaction. NotFound when the job does not exist;
  // AlreadyExists when an event's seq is taken (gaps are the caller's contract).
  absl::Status Commit(const JobMutation& mutation);

  // Every job (in creation order) with its attempts and events; with max_ended >= 0 only
  // the jobs that have not ended and the max_ended that ended last (the coordinator's
  // start: older ended jobs are read when asked for, LoadJob).
  absl::StatusOr<std::vector<StoredJob>> LoadAll(int max_ended = -1);

  // One job with its attempts and events; NotFound when there is none with this number.
  absl::StatusOr<StoredJob> LoadJob(int64_t num);
  // One job's record with its attempts, without its events; NotFound as LoadJob.
  absl::StatusOr<rackrun::v1::Job> LoadRecord(int64_t num);

  // The numbers of the jobs below `before`, newest first, at most `limit`, only those in
  // `state` unless it is JOB_STATE_UNSPECIFIED (a page of JobService.ListJobs).
  absl::StatusOr<std::vector<int64_t>> ListJobNumbers(int64_t before, rackrun::v1::JobState state,
                                                      int limit);

  // A number never returned before by this database (worker ids "w-<n>").
  absl::StatusOr<int64_t> NextWorkerNumber();

  // This database's identity: random and nonzero, made with the database and kept in it.
  // Job and worker numbers start again in another database; the workers send it with
  // their ids and reports so that a coordinator tells its own from another store's.
  uint64_t store_id() const { return store_id_; }

 private:
  explicit JobStore(sqlite3* db) : db_(db) {}
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteJob(const rackrun::v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteEvent(const rackrun::v1::JobEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<rackrun::v1::Job> ReadJobByRequest(const std::string& request_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<rackrun::v1::Job> ReadJob(int64_t num) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StoredJob> ReadStoredJob(int64_t num) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Error(const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DataLoss naming the database file, job `num`, `what` is wrong with it, and what to do.
  absl::Status Damaged(int64_t num, absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
  uint64_t store_id_ = 0;  // set by Open, constant after
};

// "j-12" -> 12; -1 when `id` is not a job id.
int64_t JobNumber(const std::string& id);

}  // namespace rackrun::coordinator

#endif  // RACKRUN_COORDINATOR_JOB_STORE_H_
