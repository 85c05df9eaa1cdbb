// SetUpTls (the loopback rule, --tls, --insecure, join-token files) without a network, and
// a real CoordinatorServer with --tls=on reached through a join token: the pinned CA fetch
// (right and wrong pins) and calls over the verified channel.
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <utility>

#include "absl/strings/ascii.h"
#include "base/file.h"
#include "coordinator/server.h"
#include "coordinator/test_util.h"
#include "rackrun/v1/job_service.grpc.pb.h"
#include "rpc/channel.h"
#include "rpc/health_check.h"
#include "rpc/join_token.h"

namespace rackrun::coordinator {
namespace {

using ::testing::HasSubstr;

ServerOptions Options(const std::string& dir, const std::string& listen) {
  ServerOptions o;
  o.state_dir = dir;
  o.listen = listen;
  return o;
}

const RoleTokens kTokens{"admin-t", "user-t", "worker-t", "readonly-t"};

bool Exists(const std::string& path) { return std::filesystem::exists(path); }

TEST(TlsSetupTest, TlsByDefaultOffLoopbackPlaintextOnLoopback) {
  testing::ScratchDir dir;
  // A network address: TLS with the automatic CA; the certificate names it; join tokens.
  auto remote = SetUpTls(Options(dir.path(), "10.1.2.3:7070"), kTokens, false);
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_TRUE(remote->tls);
  EXPECT_FALSE(remote->insecure_remote);
  EXPECT_THAT(remote->summary, HasSubstr("10.1.2.3"));
  EXPECT_EQ(remote->ca_sha256,
            *rpc::CertificateSha256(*base::ReadWholeFile(dir.path() + "/ca.crt")));
  const std::string join = *base::ReadWholeFile(dir.path() + "/join-token-worker");
  EXPECT_EQ(join, rpc::FormatJoinToken(remote->ca_sha256, "worker-t") + "\n");
  struct stat st;
  ASSERT_EQ(stat((dir.path() + "/join-token-user").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  // Loopback: plaintext, and no join tokens left behind to pin a CA that is not served.
  auto local = SetUpTls(Options(dir.path(), "127.0.0.1:7070"), kTokens, false);
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_FALSE(local->tls);
  EXPECT_FALSE(local->insecure_remote);
  EXPECT_FALSE(Exists(dir.path() + "/join-token-worker"));

  // --tls=on on loopback: TLS (what the process tests use).
  ServerOptions on = Options(dir.path(), "127.0.0.1:7070");
  on.tls = TlsMode::kOn;
  auto forced = SetUpTls(on, kTokens, false);
  ASSERT_TRUE(forced.ok()) << forced.status();
  EXPECT_TRUE(forced->tls);
  EXPECT_EQ(forced->ca_sha256, remote->ca_sha256);  // the same CA, a re-issued certificate
  EXPECT_TRUE(Exists(dir.path() + "/join-token-worker"));
}

TEST(TlsSetupTest, PlaintextOffLoopbackNeedsInsecureAndContradictionsAreRefused) {
  testing::ScratchDir dir;
  ServerOptions off = Options(dir.path(), "0.0.0.0:7070");
  off.tls = TlsMode::kOff;
  auto refused = SetUpTls(off, kTokens, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--tls=off"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("add --insecure"));

  ServerOptions insecure = Options(dir.path(), "0.0.0.0:7070");
  insecure.insecure = true;
  auto allowed = SetUpTls(insecure, kTokens, false);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_FALSE(allowed->tls);
  EXPECT_TRUE(allowed->insecure_remote);
  EXPECT_FALSE(Exists(dir.path() + "/ca.crt"));

  insecure.tls = TlsMode::kOn;
  EXPECT_THAT(std::string(SetUpTls(insecure, kTokens, false).status().message()),
              HasSubstr("contradict"));
  ServerOptions both = Options(dir.path(), "127.0.0.1:7070");
  both.tls = TlsMode::kOff;
  both.tls_cert = "/x.crt";
  both.tls_key = "/x.key";
  EXPECT_THAT(std::string(SetUpTls(both, kTokens, false).status().message()),
              HasSubstr("--tls-cert"));
  EXPECT_THAT(
      std::string(SetUpTls(Options(dir.path(), "nonsense"), kTokens, false).status().message()),
      HasSubstr("--listen"));
}

// The coordinator's own certificate expiring within the window is warned about, naming
// the renewal command.
TEST(TlsSetupTest, ExpiryWarningsNameTheRenewalCommand) {
  testing::ScratchDir dir;
  ServerOptions on = Options(dir.path(), "127.0.0.1:7070");
  on.tls = TlsMode::kOn;
  auto setup = SetUpTls(on, kTokens, false);
  ASSERT_TRUE(setup.ok()) << setup.status();
  EXPECT_TRUE(ExpiryWarnings(*setup, absl::Now(), absl::Hours(24 * 30)).empty());
  const std::vector<std::string> w =
      ExpiryWarnings(*setup, absl::Now() + absl::Hours(24 * 350), absl::Hours(24 * 30));
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0], HasSubstr("server certificate expires on"));
  EXPECT_THAT(w[0], HasSubstr("--renew-certs"));
}

// A coordinator with TLS on (its automatic CA) on a free loopback port, state in DIR/state.
struct TlsServer {
  ServerOptions options;
  std::unique_ptr<CoordinatorServer> server;
  std::string address;
};
absl::StatusOr<TlsServer> StartTlsServer(const std::string& dir) {
  TlsServer t;
  t.options = Options(dir + "/state", "127.0.0.1:0");
  t.options.tls = TlsMode::kOn;
  absl::StatusOr<std::unique_ptr<CoordinatorServer>> server = CoordinatorServer::Start(t.options);
  if (!server.ok()) return server.status();
  t.server = *std::move(server);
  t.address = "127.0.0.1:" + std::to_string(t.server->port());
  return t;
}

// The CLI's and the worker's path: the join token of `file` (in the state folder) as
// RACKRUN_TOKEN, nothing else.
absl::StatusOr<rpc::CoordinatorClientChannel> OpenWithJoinToken(const TlsServer& t,
                                                                const std::string& file) {
  const std::string join = std::string(
      absl::StripAsciiWhitespace(*base::ReadWholeFile(t.options.state_dir + "/" + file)));
  setenv("RACKRUN_TOKEN", join.c_str(), 1);
  auto open = rpc::OpenCoordinatorChannel(t.address, "", {});
  unsetenv("RACKRUN_TOKEN");
  return open;
}

TEST(TlsServerTest, AJoinTokenPinsTheCaAndAWrongPinIsRefused) {
  testing::ScratchDir dir;
  absl::StatusOr<TlsServer> t = StartTlsServer(dir.path());
  ASSERT_TRUE(t.ok()) << t.status();
  const std::string& address = t->address;
  const std::string ca = *base::ReadWholeFile(t->options.state_dir + "/ca.crt");

  auto fetched = rpc::FetchPinnedCa(address, t->server->tls().ca_sha256, std::chrono::seconds(5));
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_EQ(*rpc::CertificateSha256(*fetched), t->server->tls().ca_sha256);
  EXPECT_EQ(*fetched, ca);
  auto wrong = rpc::FetchPinnedCa(address, std::string(64, '0'), std::chrono::seconds(5));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("another coordinator"));

  auto open = OpenWithJoinToken(*t, "join-token-readonly");
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(rpc::CheckHealth(open->channel, std::chrono::seconds(5)), 1);
  auto stub = rackrun::v1::JobService::NewStub(open->channel);
  grpc::ClientContext list_ctx;
  list_ctx.AddMetadata("authorization", "Bearer " + open->token.token);
  rackrun::v1::ListJobsResponse listed;
  EXPECT_TRUE(stub->List(&list_ctx, rackrun::v1::ListJobsRequest(), &listed).ok());
  grpc::ClientContext cancel_ctx;
  cancel_ctx.AddMetadata("authorization", "Bearer " + open->token.token);
  rackrun::v1::CancelJobRequest cancel;
  cancel.set_job_id("j-1");
  rackrun::v1::Job job;
  const grpc::Status denied = stub->Cancel(&cancel_ctx, cancel, &job);
  EXPECT_EQ(denied.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(denied.error_message(), HasSubstr("JobService.Cancel needs the user role"));
  EXPECT_THAT(denied.error_message(), HasSubstr("read-only"));

  // A join token pinning another CA gets no channel.
  setenv("RACKRUN_TOKEN", rpc::FormatJoinToken(std::string(64, '0'), "x").c_str(), 1);
  auto pinned_wrong = rpc::OpenCoordinatorChannel(address, "", {});
  unsetenv("RACKRUN_TOKEN");
  ASSERT_FALSE(pinned_wrong.ok());
  EXPECT_THAT(std::string(pinned_wrong.status().message()),
              HasSubstr("join token from RACKRUN_TOKEN"));
  t->server->Shutdown();
}

// A call is refused at its headers when its token is missing or wrong (TokenGate): a peer
// without a token can no longer hold calls open by never sending their message (each held
// ~12 KB of the coordinator). A call with a token that sends no message still waits for it
// (until its deadline); the health service still answers without a token.
TEST(TlsServerTest, ACallWithoutAValidTokenIsRefusedAtItsHeaders) {
  testing::ScratchDir dir;
  absl::StatusOr<TlsServer> t = StartTlsServer(dir.path());
  ASSERT_TRUE(t.ok()) << t.status();
  auto open = OpenWithJoinToken(*t, "join-token-worker");
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(rpc::CheckHealth(open->channel, std::chrono::seconds(5)), 1);  // no token needed

  grpc::GenericStub generic(open->channel);
  // Sends the headers of a Register call (with `header` as its authorization, if any) and
  // never its message; the status and how long it took to come.
  const auto headers_only = [&](const std::string& header) {
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
    if (!header.empty()) ctx.AddMetadata("authorization", header);
    const auto start = std::chrono::steady_clock::now();
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        generic.PrepareCall(&ctx, "/rackrun.v1.RackControl/Register", &cq);
    grpc::Status status;
    call->StartCall(reinterpret_cast<void*>(1));
    call->Finish(&status, reinterpret_cast<void*>(2));
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(2)) {
    }
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
    return std::make_pair(status, std::chrono::steady_clock::now() - start);
  };
  const auto [none, none_took] = headers_only("");
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAUTHENTICATED) << none.error_message();
  EXPECT_THAT(none.error_message(), HasSubstr("missing the cluster token"));
  EXPECT_LT(none_took, std::chrono::milliseconds(1000));
  const auto [wrong, wrong_took] = headers_only("Bearer 0000");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAUTHENTICATED) << wrong.error_message();
  EXPECT_THAT(wrong.error_message(), HasSubstr("wrong cluster token"));
  EXPECT_LT(wrong_took, std::chrono::milliseconds(1000));
  // The right token passes the gate and the call waits for its message.
  const auto [right, right_took] = headers_only("Bearer " + open->token.token);
  EXPECT_EQ(right.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << right.error_message();
  EXPECT_GE(right_took, std::chrono::milliseconds(1000));
  t->server->Shutdown();
}

}  // namespace
}  // namespace rackrun::coordinator
