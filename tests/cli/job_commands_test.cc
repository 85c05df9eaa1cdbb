// End-to-end tests of the job commands (submit, status, list, cancel, watch, workers)
// against a real rackrun-coordinator on 127.0.0.1 with a scratch state folder, run as a
// user would. No workers: jobs stay QUEUED until cancelled (the runs to SUCCEEDED are
// the daemon tests with workers).

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/process.h"
#include "tests/support/shell.h"

namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;
using Result = ::rackrun::testing::ShellResult;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

using ::rackrun::testing::Child;
using ::rackrun::testing::FreePort;
using ::rackrun::testing::WaitForText;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

class JobCommandsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::rackrun::testing::ScratchDir("cli_jobs_");
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "spec.yaml") << "name: cli-test\n"
                                         "model: {width: 32, blocks: 1, heads: 2, seq_len: 16,\n"
                                         "        moe: {experts: 4, top_k: 2}}\n"
                                         "data: {train: train.tokens, batch_size: 2}\n"
                                         "training: {steps: 5}\n";
    StartCoordinator(0);
  }

  void TearDown() override {
    if (coordinator_ != nullptr) {
      coordinator_->Signal(SIGTERM);
      EXPECT_EQ(coordinator_->Wait(std::chrono::seconds(10)), 0);
      coordinator_.reset();
    }
  }

  // Starts the coordinator on `port` (0: any free one) with the test's state folder.
  void StartCoordinator(int port) {
    // A new file per start: a restart must not read the banner of the previous process.
    const fs::path banner = dir_ / ("coordinator" + std::to_string(starts_++) + ".txt");
    coordinator_ =
        std::make_unique<Child>(std::vector<std::string>{RACKRUN_COORDINATOR_BINARY, "--listen",
                                                         "127.0.0.1:" + std::to_string(port),
                                                         "--state-dir", (dir_ / "state").string()},
                                banner);
    std::string text;
    std::smatch m = WaitForText(banner, std::regex("listening on 127\\.0\\.0\\.1:([0-9]+)"), &text);
    ASSERT_FALSE(m.empty()) << "no banner: " << text;
    address_ = "127.0.0.1:" + m[1].str();
  }

  // The environment a user on this machine has: the coordinator's address and token file.
  std::string Env() const {
    return "env -u RACKRUN_TOKEN RACKRUN_COORDINATOR=" + address_ +
           " RACKRUN_TOKEN_FILE=" + (dir_ / "state" / "token").string() + " ";
  }

  // Runs `rackrun ARGS` in the test's folder with `env` (Env() by default).
  Result Run(const std::string& args, const std::string& env = "") {
    return ::rackrun::testing::Shell(
        "cd " + dir_.string() + " && " + (env.empty() ? Env() : env) + RACKRUN_BINARY + " " + args,
        dir_ / "stdout.txt", dir_ / "stderr.txt");
  }

  // Submits the test spec; the job id.
  std::string Submit(const std::string& extra = "") {
    Result r = Run("submit spec.yaml " + extra);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_THAT(r.out, ::testing::MatchesRegex("[^\n ]+\n")) << "stdout is the job id alone";
    return r.out.substr(0, r.out.find('\n'));
  }

  // The ids `rackrun list --json ARGS` prints.
  std::vector<std::string> ListIds(const std::string& args = "") {
    Result r = Run("list --json " + args);
    EXPECT_EQ(r.code, 0) << r.err;
    json doc = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(doc.is_discarded()) << r.out;
    std::vector<std::string> ids;
    for (const json& j : doc.value("jobs", json::array())) ids.push_back(j.value("id", ""));
    return ids;
  }

  static void ExpectOneLine(const Result& r) {
    EXPECT_EQ(Count(r.err, "\n"), 1) << "one line expected:\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr("rackrun: "));
  }

  fs::path dir_;
  std::string address_;
  std::unique_ptr<Child> coordinator_;
  int starts_ = 0;
};

TEST_F(JobCommandsTest, SubmitStatusListCancel) {
  const std::string id = Submit();
  ASSERT_FALSE(id.empty());

  Result status = Run("status " + id);
  ASSERT_EQ(status.code, 0) << status.err;
  EXPECT_THAT(status.out, HasSubstr(id));
  EXPECT_THAT(status.out, HasSubstr("QUEUED"));

  // The spec's relative data path travelled absolute (against the submit's directory).
  Result as_json = Run("status --json " + id);
  ASSERT_EQ(as_json.code, 0) << as_json.err;
  json job = json::parse(as_json.out, nullptr, false);
  ASSERT_FALSE(job.is_discarded()) << as_json.out;
  EXPECT_EQ(job["id"], id);
  EXPECT_EQ(job["state"], "QUEUED");
  EXPECT_EQ(job["spec"]["data"]["train"], (dir_ / "train.tokens").string());

  const std::string second = Submit();
  EXPECT_NE(second, id);
  EXPECT_EQ(ListIds(), (std::vector<std::string>{second, id}));  // newest first
  EXPECT_EQ(ListIds("--limit 1"), (std::vector<std::string>{second}));
  Result table = Run("list");
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr(id));
  EXPECT_THAT(table.out, HasSubstr("QUEUED"));

  Result cancel = Run("cancel " + id + " --reason 'cli test'");
  ASSERT_EQ(cancel.code, 0) << cancel.err;
  EXPECT_THAT(cancel.out, HasSubstr("CANCELLED"));
  EXPECT_EQ(ListIds("--state cancelled"), (std::vector<std::string>{id}));
  EXPECT_EQ(ListIds("--state queued"), (std::vector<std::string>{second}));

  Result again = Run("cancel " + id);
  EXPECT_EQ(again.code, 1);
  ExpectOneLine(again);

  Result missing = Run("status no-such-job");
  EXPECT_EQ(missing.code, 1);
  ExpectOneLine(missing);
  EXPECT_THAT(missing.err, HasSubstr("no-such-job"));

  Result workers = Run("workers --json");
  EXPECT_EQ(workers.code, 0) << workers.err;
}

TEST_F(JobCommandsTest, BadSpecFailsLocallyNamingTheField) {
  // The address is not even a coordinator: the spec must fail before any call.
  Result r = Run("submit spec.yaml --set model.moe.top_k=99 --coordinator 127.0.0.1:" +
                 std::to_string(FreePort()));
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("model.moe.top_k"));
  EXPECT_THAT(r.err, Not(HasSubstr("cannot reach")));
  EXPECT_TRUE(ListIds().empty());
}

TEST_F(JobCommandsTest, RetriedSubmitWithTheSameRequestIdReturnsTheSameJob) {
  const std::string id = Submit("--request-id cli-retry-1");
  Result again = Run("submit spec.yaml --request-id cli-retry-1");
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(again.out, id + "\n");
  EXPECT_THAT(again.err, HasSubstr("already submitted"));
  EXPECT_EQ(ListIds(), (std::vector<std::string>{id}));
}

TEST_F(JobCommandsTest, WrongTokenIsOneLineAndChangesNothing) {
  const std::string env = "env RACKRUN_TOKEN=not-the-token RACKRUN_COORDINATOR=" + address_ + " ";
  Result list = Run("list", env);
  EXPECT_NE(list.code, 0);
  ExpectOneLine(list);
  EXPECT_THAT(list.err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(list.err, HasSubstr("RACKRUN_TOKEN"));

  Result submit = Run("submit spec.yaml", env);
  EXPECT_NE(submit.code, 0);
  ExpectOneLine(submit);
  EXPECT_THAT(submit.err, HasSubstr("UNAUTHENTICATED"));
  EXPECT_TRUE(ListIds().empty());

  Result no_file =
      Run("list", "env -u RACKRUN_TOKEN RACKRUN_TOKEN_FILE=" + (dir_ / "absent").string() + " ");
  EXPECT_NE(no_file.code, 0);
  ExpectOneLine(no_file);
  EXPECT_THAT(no_file.err, HasSubstr((dir_ / "absent").string()));
}

TEST_F(JobCommandsTest, UnreachableCoordinatorIsOneLine) {
  const std::string dead = "127.0.0.1:" + std::to_string(FreePort());
  Result status = Run("status j-1 --coordinator " + dead);
  EXPECT_EQ(status.code, 1);
  ExpectOneLine(status);
  EXPECT_THAT(status.err, HasSubstr("cannot reach the coordinator at " + dead));
  EXPECT_THAT(status.err, HasSubstr("--coordinator"));

  Result bad = Run("list --coordinator no-port-here");
  EXPECT_NE(bad.code, 0);
  ExpectOneLine(bad);
  EXPECT_THAT(bad.err, HasSubstr("no-port-here"));

  // Submit retries (bounded) with one request id, then says how to retry safely.
  Result submit = Run("submit spec.yaml --retry-for 1 --coordinator " + dead);
  EXPECT_EQ(submit.code, 1);
  EXPECT_THAT(submit.err, HasSubstr("cannot reach the coordinator at " + dead));
  EXPECT_THAT(submit.err, HasSubstr("--request-id"));
}

TEST_F(JobCommandsTest, WatchExitsWithTheOutcome) {
  const std::string id = Submit();
  ASSERT_EQ(Run("cancel " + id).code, 0);
  Result watch = Run("watch " + id);
  EXPECT_EQ(watch.code, 2) << watch.err;  // CANCELLED
  EXPECT_THAT(watch.out, HasSubstr("job " + id + ": QUEUED\n"));
  EXPECT_THAT(watch.out, HasSubstr("job " + id + ": CANCELLED\n"));

  Result missing = Run("watch no-such-job");
  EXPECT_EQ(missing.code, 3);
  ExpectOneLine(missing);
}

TEST_F(JobCommandsTest, WatchSurvivesACoordinatorRestartWithoutLosingOrRepeatingEvents) {
  const std::string id = Submit();
  const fs::path out = dir_ / "watch.txt";
  const std::string port = address_.substr(address_.rfind(':') + 1);
  Child watch(
      {"/usr/bin/env", "-u", "RACKRUN_TOKEN", "RACKRUN_COORDINATOR=" + address_,
       "RACKRUN_TOKEN_FILE=" + (dir_ / "state" / "token").string(), RACKRUN_BINARY, "watch", id},
      out);
  std::string text;
  ASSERT_FALSE(WaitForText(out, std::regex("QUEUED"), &text).empty()) << text;

  coordinator_->Signal(SIGKILL);
  coordinator_->Wait(std::chrono::seconds(10));
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(std::stoi(port)));
  Result cancel = Run("cancel " + id);
  ASSERT_EQ(cancel.code, 0) << cancel.err;

  EXPECT_EQ(watch.Wait(std::chrono::seconds(30)), 2);
  text = ::rackrun::testing::Slurp(out);
  EXPECT_EQ(Count(text, ": QUEUED\n"), 1) << text;
  EXPECT_EQ(Count(text, ": CANCELLED\n"), 1) << text;
  EXPECT_THAT(text, HasSubstr("reconnected")) << text;
}

}  // namespace
