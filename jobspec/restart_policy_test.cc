#include "jobspec/restart_policy.h"

#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/spec.h"

namespace rackrun::jobspec {
namespace {

using ::testing::HasSubstr;

TEST(RestartPolicyTest, DefaultsRestartWhatTheJobDidNotCause) {
  absl::StatusOr<RestartPolicy> p = RestartPolicyOf(rackrun::v1::JobSpec());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->max_attempts, 1);
  EXPECT_EQ(p->backoff_s, 1.0);
  EXPECT_TRUE(p->Restarts(rackrun::v1::WORKER_LOST));
  EXPECT_TRUE(p->Restarts(rackrun::v1::HANG));
  EXPECT_TRUE(p->Restarts(rackrun::v1::WORKER_CANCELLED));
  EXPECT_FALSE(p->Restarts(rackrun::v1::ERROR));
  EXPECT_FALSE(RestartPolicy().Restarts(rackrun::v1::WORKER_LOST));
}

TEST(RestartPolicyTest, TheSpecsListReplacesTheDefaults) {
  rackrun::v1::JobSpec spec;
  spec.mutable_restart()->set_max_attempts(3);
  spec.mutable_restart()->add_on("error");
  spec.mutable_restart()->set_backoff_s(2);
  absl::StatusOr<RestartPolicy> p = RestartPolicyOf(spec);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->max_attempts, 3);
  EXPECT_TRUE(p->Restarts(rackrun::v1::ERROR));
  EXPECT_FALSE(p->Restarts(rackrun::v1::WORKER_LOST));
  EXPECT_EQ(p->BackoffMs(2), 2000);
  EXPECT_EQ(p->BackoffMs(3), 4000);      // doubling
  EXPECT_EQ(p->BackoffMs(40), 3600000);  // at most an hour
}

// The coordinator's policy and the spec's validation refuse the same specs, with the same
// message.
TEST(RestartPolicyTest, InvalidSpecsAreRefusedAlike) {
  constexpr char kSpec[] =
      "model: {width: 128, blocks: 4, heads: 4, seq_len: 128, moe: {experts: 16}}\n"
      "data: {train: train.tokens}\ntraining: {steps: 10}\n";
  for (const auto& [field, value, message] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"on", "crash",
            "restart.on: unknown failure kind 'crash'; choose from worker_lost, hang, "
            "error, worker_cancelled"},
           {"max_attempts", "-1", "restart.max_attempts: is -1; it must be >= 1"},
           {"backoff_s", "-0.5", "restart.backoff_s: must be a finite number of seconds >= 0"}}) {
    rackrun::v1::JobSpec spec;
    rackrun::v1::RestartSpec& r = *spec.mutable_restart();
    if (field == "on") r.add_on(value);
    if (field == "max_attempts") r.set_max_attempts(std::stoi(value));
    if (field == "backoff_s") r.set_backoff_s(std::stod(value));
    absl::StatusOr<RestartPolicy> p = RestartPolicyOf(spec);
    ASSERT_FALSE(p.ok()) << field;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(p.status().message()), HasSubstr(message));
    absl::StatusOr<rackrun::v1::JobSpec> parsed =
        ParseJobSpec(kSpec, {"restart." + field + "=" + value});
    ASSERT_FALSE(parsed.ok()) << field;
    EXPECT_EQ(parsed.status().message(), "<string>: " + std::string(p.status().message()));
  }
}

TEST(RestartPolicyTest, FailureKindNamesAreTheWordsOfRestartOn) {
  for (rackrun::v1::FailureKind kind : {rackrun::v1::WORKER_LOST, rackrun::v1::HANG,
                                        rackrun::v1::ERROR, rackrun::v1::WORKER_CANCELLED}) {
    EXPECT_EQ(FailureKindOf(FailureKindName(kind)), kind);
  }
  EXPECT_EQ(FailureKindName(rackrun::v1::WORKER_LOST), "worker_lost");
  EXPECT_EQ(FailureKindName(rackrun::v1::FAILURE_KIND_UNSPECIFIED), "unspecified");
  EXPECT_FALSE(FailureKindOf("crash").has_value());
}

}  // namespace
}  // namespace rackrun::jobspec
