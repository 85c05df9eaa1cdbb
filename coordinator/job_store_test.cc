#include "coordinator/job_store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>

#include "coordinator/test_util.h"

namespace rackrun::coordinator {
namespace {

using rackrun::v1::Job;
using rackrun::v1::JobEvent;

Job NewJob(const std::string& request_id) {
  Job j;
  j.set_request_id(request_id);
  j.set_name("demo");
  j.set_state(rackrun::v1::QUEUED);
  j.mutable_spec()->set_name("demo");
  j.mutable_spec()->mutable_resources()->set_ranks(2);
  j.set_created_unix_ms(123);
  return j;
}

JobEvent First() {
  JobEvent e;
  e.set_seq(1);
  e.set_state(rackrun::v1::QUEUED);
  return e;
}

TEST(JobStoreTest, PersistsAcrossReopen) {
  testing::ScratchDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  std::string id;
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto r = (*store)->InsertJob(NewJob("req-1"), First());
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->created);
    EXPECT_EQ(r->job.id(), "j-1");
    id = r->job.id();
    Job next = r->job;
    next.set_state(rackrun::v1::RUNNING);
    auto* a = next.add_attempts();
    a->set_number(1);
    a->set_state(rackrun::v1::RUNNING);
    auto* rank = a->add_ranks();
    rank->set_rank(0);
    rank->set_worker_id("w-1");
    rank->set_host("h1");
    rank->set_pid(77);
    next.mutable_first_failure()->set_kind(rackrun::v1::HANG);
    JobEvent e;
    e.set_job_id(id);
    e.set_seq(2);
    e.set_state(rackrun::v1::RUNNING);
    ASSERT_TRUE((*store)->Commit({next, {e}, {}}).ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto all = (*store)->LoadAll();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 1u);
  const StoredJob& sj = (*all)[0];
  EXPECT_EQ(sj.job.id(), id);
  EXPECT_EQ(sj.job.request_id(), "req-1");
  EXPECT_EQ(sj.job.state(), rackrun::v1::RUNNING);
  EXPECT_EQ(sj.job.spec().resources().ranks(), 2);
  ASSERT_EQ(sj.job.attempts_size(), 1);
  EXPECT_EQ(sj.job.attempts(0).ranks(0).pid(), 77);
  EXPECT_EQ(sj.job.first_failure().kind(), rackrun::v1::HANG);
  ASSERT_EQ(sj.events.size(), 2u);
  EXPECT_EQ(sj.events[0].seq(), 1);
  EXPECT_EQ(sj.events[0].job_id(), id);
  EXPECT_EQ(sj.events[1].seq(), 2);
}

TEST(JobStoreTest, RequestIdIsUniqueAcrossReopen) {
  testing::ScratchDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->InsertJob(NewJob("a"), First()).ok());
    ASSERT_TRUE((*store)->InsertJob(NewJob("b"), First()).ok());
  }
  auto store = JobStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto again = (*store)->InsertJob(NewJob("a"), First());
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->job.id(), "j-1");
  auto c = (*store)->InsertJob(NewJob("c"), First());
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->created);
  EXPECT_EQ(c->job.id(), "j-3");
  EXPECT_EQ((*store)->LoadAll()->size(), 3u);
}

TEST(JobStoreTest, EventSeqIsUnique) {
  testing::ScratchDir dir;
  auto store = JobStore::Open(dir.path() + "/coordinator.db");
  ASSERT_TRUE(store.ok());
  auto r = (*store)->InsertJob(NewJob("a"), First());
  ASSERT_TRUE(r.ok());
  JobEvent dup;
  dup.set_job_id(r->job.id());
  dup.set_seq(1);
  dup.set_message("again");
  Job changed = r->job;
  changed.set_message("must not be written");
  EXPECT_EQ((*store)->Commit({changed, {dup}, {}}).code(), absl::StatusCode::kAlreadyExists);
  auto all = (*store)->LoadAll();
  ASSERT_EQ((*all)[0].events.size(), 1u);
  EXPECT_EQ((*all)[0].job.message(), "");  // the failed transaction wrote nothing
}

// A damaged row (a record that does not parse, a state no job has) stops the load with an
// error naming the database file, the job, what is wrong and what to do.
TEST(JobStoreTest, ADamagedRowIsNamedWithTheFileTheJobAndTheWayOut) {
  testing::ScratchDir dir;
  int n = 0;
  for (const auto& [sql, says] : std::vector<std::pair<std::string, std::string>>{
           {"UPDATE jobs SET spec = X'FFFFFFFFFF'", "its spec does not parse"},
           {"UPDATE jobs SET state = 99", "its state 99 is not a job state"},
           {"UPDATE events SET event = X'0A0B0C'", "an event record does not parse"}}) {
    const std::string path = dir.path() + "/coordinator-" + std::to_string(n++) + ".db";
    {
      auto store = JobStore::Open(path);
      ASSERT_TRUE(store.ok()) << store.status();
      ASSERT_TRUE((*store)->InsertJob(NewJob("req-1"), First()).ok());
    }
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK) << sql;
    sqlite3_close(db);
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    absl::StatusOr<std::vector<StoredJob>> all = (*store)->LoadAll();
    ASSERT_FALSE(all.ok()) << sql;
    EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
    const std::string m(all.status().message());
    for (const std::string& part : {path, std::string("job j-1"), says,
                                    std::string("restore the state folder from a backup")}) {
      EXPECT_NE(m.find(part), std::string::npos) << part << " in " << m;
    }
  }
}

TEST(JobStoreTest, WorkerNumbersNeverRepeat) {
  testing::ScratchDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  {
    auto store = JobStore::Open(path);
    EXPECT_EQ(*(*store)->NextWorkerNumber(), 1);
    EXPECT_EQ(*(*store)->NextWorkerNumber(), 2);
  }
  auto store = JobStore::Open(path);
  EXPECT_EQ(*(*store)->NextWorkerNumber(), 3);
}

// A database keeps its identity across reopening; another database (its numbers start at 1
// again) has another.
TEST(JobStoreTest, AStoreKeepsItsIdentityAndAnotherStoreHasAnother) {
  testing::ScratchDir dir;
  const std::string path = dir.path() + "/coordinator.db";
  uint64_t first = 0;
  {
    auto store = JobStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    first = (*store)->store_id();
    EXPECT_NE(first, 0u);
  }
  auto again = JobStore::Open(path);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->store_id(), first);
  auto other = JobStore::Open(dir.path() + "/other.db");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE((*other)->store_id(), 0u);
  EXPECT_NE((*other)->store_id(), first);
}

}  // namespace
}  // namespace rackrun::coordinator
