#include "coordinator/job_store.h"

#include <sqlite3.h>

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rackrun::coordinator {
namespace {

using rackrun::v1::Attempt;
using rackrun::v1::Job;
using rackrun::v1::JobEvent;

// A prepared statement that finalizes itself.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr); }
  ~Stmt() { sqlite3_finalize(s_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return s_; }
  void Int(int i, int64_t v) { sqlite3_bind_int64(s_, i, v); }
  void Text(int i, const std::string& v) {
    sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  void Blob(int i, const std::string& v) {
    sqlite3_bind_blob(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
  }
  int Step() { return sqlite3_step(s_); }
  void Reset() { sqlite3_reset(s_); }
  int64_t ColInt(int i) { return sqlite3_column_int64(s_, i); }
  std::string ColBytes(int i) {
    const void* p = sqlite3_column_blob(s_, i);
    const int n = sqlite3_column_bytes(s_, i);
    return p == nullptr ? std::string() : std::string(static_cast<const char*>(p), n);
  }

 private:
  sqlite3_stmt* s_ = nullptr;
  int rc_ = SQLITE_ERROR;
};

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  num INTEGER PRIMARY KEY AUTOINCREMENT,
  request_id TEXT NOT NULL UNIQUE,
  name TEXT NOT NULL,
  state INTEGER NOT NULL,
  spec BLOB NOT NULL,            -- serialized rackrun.v1.JobSpec
  created_ms INTEGER NOT NULL,
  started_ms INTEGER NOT NULL,
  finished_ms INTEGER NOT NULL,
  message TEXT NOT NULL,
  first_failure BLOB,            -- serialized rackrun.v1.Failure, NULL when none
  restarts INTEGER NOT NULL,
  last_progress BLOB             -- serialized rackrun.v1.StepProgress
);
CREATE TABLE IF NOT EXISTS attempts (
  job_num INTEGER NOT NULL REFERENCES jobs(num),
  number INTEGER NOT NULL,
  state INTEGER NOT NULL,
  start_step INTEGER NOT NULL,
  started_ms INTEGER NOT NULL,
  finished_ms INTEGER NOT NULL,
  attempt BLOB NOT NULL,         -- serialized rackrun.v1.Attempt: ranks (worker, host, pid), failure
  PRIMARY KEY (job_num, number)
);
CREATE TABLE IF NOT EXISTS events (
  job_num INTEGER NOT NULL REFERENCES jobs(num),
  seq INTEGER NOT NULL,
  event BLOB NOT NULL,           -- serialized rackrun.v1.JobEvent
  PRIMARY KEY (job_num, seq)
);
CREATE TABLE IF NOT EXISTS meta (
  key TEXT PRIMARY KEY,
  value INTEGER NOT NULL
);
)sql";

std::string Serialize(const google::protobuf::MessageLite& m) {
  std::string s;
  m.SerializeToString(&s);
  return s;
}

}  // namespace

int64_t JobNumber(const std::string& id) {
  int64_t n = 0;
  if (!absl::StartsWith(id, "j-") || !absl::SimpleAtoi(id.substr(2), &n) || n <= 0) return -1;
  return n;
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db,
                      SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                      nullptr) != SQLITE_OK) {
    std::string msg = db != nullptr ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return absl::InternalError(absl::StrCat("cannot open the job database ", path, ": ", msg));
  }
  sqlite3_busy_timeout(db, 5000);
  std::unique_ptr<JobStore> store(new JobStore(db));
  Lock lock(store->mu_);
  for (const char* sql : {"PRAGMA journal_mode=WAL;", "PRAGMA synchronous=FULL;",
                          "PRAGMA foreign_keys=ON;", kSchema}) {
    if (absl::Status s = store->Exec(sql); !s.ok()) {
      return absl::InternalError(absl::StrCat(path, ": ", s.message()));
    }
  }
  // SQLite's random() draws from the operating system's randomness; | 1 keeps it nonzero.
  if (absl::Status s = store->Exec(
          "INSERT INTO meta (key, value) VALUES ('store_id', random() | 1) ON CONFLICT (key) DO "
          "NOTHING;");
      !s.ok()) {
    return absl::InternalError(absl::StrCat(path, ": ", s.message()));
  }
  Stmt id(store->db_, "SELECT value FROM meta WHERE key = 'store_id'");
  if (!id.ok() || id.Step() != SQLITE_ROW) {
    return absl::InternalError(
        absl::StrCat(path, ": ", store->Error("read the store id").message()));
  }
  store->store_id_ = static_cast<uint64_t>(id.ColInt(0));
  return store;
}

JobStore::~JobStore() {
  Lock lock(mu_);
  sqlite3_close(db_);
}

absl::Status JobStore::Error(const char* what) {
  return absl::InternalError(absl::StrCat("job database: ", what, ": ", sqlite3_errmsg(db_)));
}

absl::Status JobStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err != nullptr ? err : "unknown error";
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat("job database: ", msg));
  }
  return absl::OkStatus();
}

absl::Status JobStore::WriteJob(const Job& job) {
  const int64_t num = JobNumber(job.id());
  Stmt u(db_,
         "UPDATE jobs SET name=?, state=?, spec=?, created_ms=?, started_ms=?, finished_ms=?, "
         "message=?, first_failure=?, restarts=?, last_progress=? WHERE num=?");
  if (!u.ok()) return Error("prepare update");
  u.Text(1, job.name());
  u.Int(2, job.state());
  u.Blob(3, Serialize(job.spec()));
  u.Int(4, job.created_unix_ms());
  u.Int(5, job.started_unix_ms());
  u.Int(6, job.finished_unix_ms());
  u.Text(7, job.message());
  if (job.has_first_failure()) u.Blob(8, Serialize(job.first_failure()));
  u.Int(9, job.restarts());
  if (job.has_last_progress()) u.Blob(10, Serialize(job.last_progress()));
  u.Int(11, num);
  if (u.Step() != SQLITE_DONE) return Error("update job");
  if (sqlite3_changes(db_) != 1) return absl::NotFoundError(absl::StrCat("no job ", job.id()));
  for (const Attempt& a : job.attempts()) {
    Stmt w(db_,
           "INSERT INTO attempts (job_num, number, state, start_step, started_ms, finished_ms, "
           "attempt) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_num, number) DO UPDATE SET "
           "state=excluded.state, start_step=excluded.start_step, "
           "started_ms=excluded.started_ms, finished_ms=excluded.finished_ms, "
           "attempt=excluded.attempt");
    if (!w.ok()) return Error("prepare attempt");
    w.Int(1, num);
    w.Int(2, a.number());
    w.Int(3, a.state());
    w.Int(4, a.start_step());
    w.Int(5, a.started_unix_ms());
    w.Int(6, a.finished_unix_ms());
    w.Blob(7, Serialize(a));
    if (w.Step() != SQLITE_DONE) return Error("write attempt");
  }
  return absl::OkStatus();
}

absl::Status JobStore::WriteEvent(const JobEvent& event) {
  Stmt s(db_, "INSERT INTO events (job_num, seq, event) VALUES (?, ?, ?)");
  if (!s.ok()) return Error("prepare event");
  s.Int(1, JobNumber(event.job_id()));
  s.Int(2, event.seq());
  s.Blob(3, Serialize(event));
  const int rc = s.Step();
  if (rc == SQLITE_CONSTRAINT) {
    return absl::AlreadyExistsError(
        absl::StrCat("event ", event.seq(), " of job ", event.job_id(), " exists"));
  }
  if (rc != SQLITE_DONE) return Error("append event");
  return absl::OkStatus();
}

absl::Status JobStore::Damaged(int64_t num, absl::string_view what) {
  const char* file = sqlite3_db_filename(db_, "main");
  const std::string path = file != nullptr && *file != '\0' ? file : "the job database";
  return absl::DataLossError(
      absl::StrCat(path, ": job j-", num, ": ", what,
                   "; the database is damaged: restore the state folder from a backup, or move ",
                   path, " aside to start with no jobs (its jobs are then forgotten)"));
}

absl::StatusOr<Job> JobStore::ReadJob(int64_t num) {
  Stmt s(db_,
         "SELECT num, request_id, name, state, spec, created_ms, started_ms, finished_ms, "
         "message, first_failure, restarts, last_progress FROM jobs WHERE num=?");
  if (!s.ok()) return Error("prepare read");
  s.Int(1, num);
  if (s.Step() != SQLITE_ROW) return absl::NotFoundError(absl::StrCat("no job j-", num));
  Job job;
  job.set_id(absl::StrCat("j-", s.ColInt(0)));
  job.set_request_id(s.ColBytes(1));
  job.set_name(s.ColBytes(2));
  job.set_state(static_cast<rackrun::v1::JobState>(s.ColInt(3)));
  if (!rackrun::v1::JobState_IsValid(static_cast<int>(s.ColInt(3))) ||
      s.ColInt(3) == rackrun::v1::JOB_STATE_UNSPECIFIED) {
    return Damaged(num, absl::StrCat("its state ", s.ColInt(3), " is not a job state"));
  }
  if (!job.mutable_spec()->ParseFromString(s.ColBytes(4)))
    return Damaged(num, "its spec does not parse");
  job.set_created_unix_ms(s.ColInt(5));
  job.set_started_unix_ms(s.ColInt(6));
  job.set_finished_unix_ms(s.ColInt(7));
  job.set_message(s.ColBytes(8));
  if (sqlite3_column_type(s.get(), 9) != SQLITE_NULL &&
      !job.mutable_first_failure()->ParseFromString(s.ColBytes(9))) {
    return Damaged(num, "its first failure does not parse");
  }
  job.set_restarts(s.ColInt(10));
  if (sqlite3_column_type(s.get(), 11) != SQLITE_NULL &&
      !job.mutable_last_progress()->ParseFromString(s.ColBytes(11))) {
    return Damaged(num, "its last progress does not parse");
  }
  Stmt a(db_, "SELECT attempt FROM attempts WHERE job_num=? ORDER BY number");
  if (!a.ok()) return Error("prepare attempts");
  a.Int(1, num);
  int rc;
  while ((rc = a.Step()) == SQLITE_ROW) {
    if (!job.add_attempts()->ParseFromString(a.ColBytes(0)))
      return Damaged(num, "an attempt record does not parse");
  }
  if (rc != SQLITE_DONE) return Error("read attempts");
  return job;
}

absl::StatusOr<Job> JobStore::ReadJobByRequest(const std::string& request_id) {
  Stmt s(db_, "SELECT num FROM jobs WHERE request_id=?");
  if (!s.ok()) return Error("prepare lookup");
  s.Text(1, request_id);
  if (s.Step() != SQLITE_ROW) return absl::NotFoundError("no job with this request_id");
  return ReadJob(s.ColInt(0));
}

absl::StatusOr<JobStore::InsertResult> JobStore::InsertJob(const Job& job, const JobEvent& first) {
  Lock lock(mu_);
  if (absl::Status s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  auto fail = [&](absl::Status s) {
    (void)Exec("ROLLBACK");
    return s;
  };
  Stmt ins(db_,
           "INSERT INTO jobs (request_id, name, state, spec, created_ms, started_ms, "
           "finished_ms, message, restarts) VALUES (?, '', 0, x'', 0, 0, 0, '', 0) "
           "ON CONFLICT (request_id) DO NOTHING");
  if (!ins.ok()) return fail(Error("prepare insert"));
  ins.Text(1, job.request_id());
  if (ins.Step() != SQLITE_DONE) return fail(Error("insert job"));
  InsertResult result;
  if (sqlite3_changes(db_) == 0) {
    absl::StatusOr<Job> existing = ReadJobByRequest(job.request_id());
    if (!existing.ok()) return fail(existing.status());
    (void)Exec("ROLLBACK");
    result.job = *std::move(existing);
    result.created = false;
    return result;
  }
  result.job = job;
  result.job.set_id(absl::StrCat("j-", sqlite3_last_insert_rowid(db_)));
  result.created = true;
  JobEvent event = first;
  event.set_job_id(result.job.id());
  if (absl::Status s = WriteJob(result.job); !s.ok()) return fail(s);
  if (absl::Status s = WriteEvent(event); !s.ok()) return fail(s);
  if (absl::Status s = Exec("COMMIT"); !s.ok()) return fail(s);
  return result;
}

absl::Status JobStore::Commit(const JobMutation& m) {
  Lock lock(mu_);
  if (JobNumber(m.job.id()) < 0) return absl::NotFoundError(absl::StrCat("no job ", m.job.id()));
  if (absl::Status s = Exec("BEGIN IMMEDIATE"); !s.ok()) return s;
  absl::Status s = WriteJob(m.job);
  for (size_t i = 0; s.ok() && i < m.events.size(); ++i) s = WriteEvent(m.events[i]);
  if (s.ok() && !m.dropped.empty()) {
    Stmt d(db_, "DELETE FROM events WHERE job_num=? AND seq=?");
    if (!d.ok()) s = Error("prepare event removal");
    for (size_t i = 0; s.ok() && i < m.dropped.size(); ++i) {
      d.Reset();
      d.Int(1, JobNumber(m.job.id()));
      d.Int(2, m.dropped[i]);
      if (d.Step() != SQLITE_DONE) s = Error("remove event");
    }
  }
  if (s.ok()) s = Exec("COMMIT");
  if (!s.ok()) (void)Exec("ROLLBACK");
  return s;
}

absl::StatusOr<StoredJob> JobStore::ReadStoredJob(int64_t num) {
  absl::StatusOr<Job> job = ReadJob(num);
  if (!job.ok()) return job.status();
  StoredJob sj;
  sj.job = *std::move(job);
  Stmt e(db_, "SELECT event FROM events WHERE job_num=? ORDER BY seq");
  if (!e.ok()) return Error("prepare events");
  e.Int(1, num);
  int rc;
  while ((rc = e.Step()) == SQLITE_ROW) {
    JobEvent ev;
    if (!ev.ParseFromString(e.ColBytes(0))) return Damaged(num, "an event record does not parse");
    sj.events.push_back(std::move(ev));
  }
  if (rc != SQLITE_DONE) return Error("read events");
  return sj;
}

absl::StatusOr<std::vector<StoredJob>> JobStore::LoadAll(int max_ended) {
  Lock lock(mu_);
  std::vector<int64_t> nums;
  {
    // The jobs that have not ended, and the newest `max_ended` that have (all when < 0).
    Stmt s(db_,
           "SELECT num FROM jobs WHERE state NOT IN (?1, ?2, ?3) OR num IN (SELECT num FROM jobs "
           "WHERE state IN (?1, ?2, ?3) ORDER BY finished_ms DESC, num DESC LIMIT ?4) "
           "ORDER BY num");
    if (!s.ok()) return Error("prepare list");
    s.Int(1, rackrun::v1::SUCCEEDED);
    s.Int(2, rackrun::v1::FAILED);
    s.Int(3, rackrun::v1::CANCELLED);
    s.Int(4, max_ended);
    int rc;
    while ((rc = s.Step()) == SQLITE_ROW) nums.push_back(s.ColInt(0));
    if (rc != SQLITE_DONE) return Error("list jobs");
  }
  std::vector<StoredJob> jobs;
  for (int64_t num : nums) {
    absl::StatusOr<StoredJob> sj = ReadStoredJob(num);
    if (!sj.ok()) return sj.status();
    jobs.push_back(*std::move(sj));
  }
  return jobs;
}

absl::StatusOr<StoredJob> JobStore::LoadJob(int64_t num) {
  Lock lock(mu_);
  return ReadStoredJob(num);
}

absl::StatusOr<std::vector<int64_t>> JobStore::ListJobNumbers(int64_t before,
                                                              rackrun::v1::JobState state,
                                                              int limit) {
  Lock lock(mu_);
  Stmt s(db_,
         "SELECT num FROM jobs WHERE num < ?1 AND (?2 = 0 OR state = ?2) ORDER BY num DESC "
         "LIMIT ?3");
  if (!s.ok()) return Error("prepare list");
  s.Int(1, before);
  s.Int(2, state);
  s.Int(3, limit);
  std::vector<int64_t> nums;
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW) nums.push_back(s.ColInt(0));
  if (rc != SQLITE_DONE) return Error("list jobs");
  return nums;
}

absl::StatusOr<Job> JobStore::LoadRecord(int64_t num) {
  Lock lock(mu_);
  return ReadJob(num);
}

absl::StatusOr<int64_t> JobStore::NextWorkerNumber() {
  Lock lock(mu_);
  Stmt s(db_,
         "INSERT INTO meta (key, value) VALUES ('next_worker', 1) ON CONFLICT (key) DO UPDATE "
         "SET value = value + 1 RETURNING value");
  if (!s.ok()) return Error("prepare worker counter");
  if (s.Step() != SQLITE_ROW) return Error("worker counter");
  return s.ColInt(0);
}

}  // namespace rackrun::coordinator
