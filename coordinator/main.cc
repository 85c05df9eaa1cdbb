// rackrun-coordinator: the rack coordinator daemon. See server.h; flags below
// (rackrun-coordinator --help).
#include <signal.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/process_limits.h"
#include "base/signals.h"
#include "coordinator/server.h"
#include "flags/flags.h"

namespace {

// Below this open-file limit the coordinator warns at start.
constexpr int64_t kFewOpenFiles = 4096;

void WarnIfFewOpenFiles(const absl::StatusOr<int64_t>& open_files) {
  if (open_files.ok() && *open_files >= kFewOpenFiles) return;
  const std::string limit =
      open_files.ok() ? absl::StrCat(*open_files) : std::string(open_files.status().message());
  std::fprintf(stderr,
               "rackrun-coordinator: warning: open-file limit %s: every worker, client and "
               "dashboard connection takes one; raise it (systemd: LimitNOFILE=65536; shell: "
               "ulimit -n)\n",
               limit.c_str());
}

void DeclareTlsFlags(rackrun::flags::FlagSet& flags, rackrun::coordinator::ServerOptions& o,
                     bool* renew_certs);
void DeclareObservabilityFlags(rackrun::flags::FlagSet& flags,
                               rackrun::coordinator::ServerOptions& o);

// The flags, bound to `o` (whose values are the defaults the help shows).
void DeclareFlags(rackrun::flags::FlagSet& flags, rackrun::coordinator::ServerOptions& o,
                  bool* renew_certs) {
  flags.Describe(
      "The rack coordinator: job queue and job state (SQLite in --state-dir), worker\n"
      "membership and failure detection, job assignment and restarts, the per-job rendezvous,\n"
      "UltraEP planning in coordinator mode, Prometheus metrics and the dashboard. Runs until\n"
      "SIGTERM or SIGINT.\n");
  flags.String("--listen", &o.listen, "HOST:PORT", "address to serve on; port 0 = any free port");
  flags
      .String("--state-dir", &o.state_dir, "DIR",
              "job database, role tokens, automatic CA and certificates, join tokens")
      .Default("~/.rackrun");
  flags
      .String("--token-file", &o.token_file, "FILE",
              "the admin token (every role; STATE_DIR/token-user, token-worker and "
              "token-readonly hold one role each)")
      .Default("STATE_DIR/token, created at first start, mode 0600");
  flags.Section("timeouts (milliseconds)");
  const auto ms = [&](const char* name, int64_t* out, const char* help) {
    flags.Int(name, out, "MS", help).Range(0);
  };
  ms("--heartbeat-interval-ms", &o.rack.workers.heartbeat_interval_ms,
     "how often workers heartbeat (told to them at registration)");
  ms("--heartbeat-timeout-ms", &o.rack.workers.heartbeat_timeout_ms,
     "a worker silent this long is LOST; must exceed --heartbeat-interval-ms");
  ms("--hang-timeout-ms", &o.rack.workers.hang_timeout_ms,
     "a rank longer than this in one phase, or its peers in a collective waiting for it, is "
     "HANG");
  ms("--start-timeout-ms", &o.rack.workers.start_timeout_ms,
     "the same for phase starting: model, data, checks");
  ms("--report-grace-ms", &o.rack.jobs.report_grace_ms,
     "a rank's own failure report this soon after a HANG verdict naming it replaces the "
     "verdict");
  ms("--reattach-grace-ms", &o.rack.jobs.reattach_grace_ms,
     "after a coordinator restart, how long a running job's workers have to re-register "
     "before the missing ranks count as lost");
  ms("--channel-timeout-ms", &o.rack.channel_timeout_ms,
     "bound on a job's data-channel waits and rendezvous");
  ms("--handshake-timeout-ms", &o.handshake_timeout_ms,
     "a connection that has not finished its TLS handshake (plaintext: sent its first HTTP/2 "
     "bytes) this long after connecting is closed");
  flags.Int("--serving-delay-ms", &o.serving_delay_ms, "MS", "tests: hold health at NOT_SERVING")
      .Range(0)
      .Hidden();
  flags.Section("limits (calls that hold a server thread while they wait, workers, memory)");
  flags
      .Int("--max-watch-streams", &o.limits.watch_streams, "N",
           "watch streams (rackrun watch, submit --watch) open at once; more are refused")
      .Range(1);
  flags
      .Int("--max-rack-waits", &o.limits.rack_waits, "N",
           "workers' rendezvous waits and plan streams open at once; more are refused")
      .Range(1);
  flags
      .Int("--max-ended-jobs-in-memory", &o.rack.jobs.max_ended_in_memory, "N",
           "ended jobs kept in memory, the last to end; older ones stay in the database and "
           "are read from it when asked for")
      .Range(0);
  flags
      .Int("--max-workers", &o.rack.workers.max_live, "N",
           "live workers registered at once (each holds an assignment stream); more are "
           "refused")
      .Range(1);
  DeclareTlsFlags(flags, o, renew_certs);
  DeclareObservabilityFlags(flags, o);
}

void DeclareTlsFlags(rackrun::flags::FlagSet& flags, rackrun::coordinator::ServerOptions& o,
                     bool* renew_certs) {
  flags.Section(
      "TLS (default: on, except on a loopback --listen)",
      "  Without --tls-cert the coordinator makes its own CA and server certificate in\n"
      "  STATE_DIR (ca.crt, server.crt, mode 0600) and writes join tokens there\n"
      "  (join-token-worker, join-token-user, join-token-readonly, join-token): a worker or\n"
      "  user given one checks the server against the CA it pins; nothing else to copy.\n");
  flags
      .Custom("--tls", "auto|on|off", "auto: TLS unless --listen is a loopback address",
              [&o](std::string_view v) {
                if (v == "auto") {
                  o.tls = rackrun::coordinator::TlsMode::kAuto;
                } else if (v == "on") {
                  o.tls = rackrun::coordinator::TlsMode::kOn;
                } else if (v == "off") {
                  o.tls = rackrun::coordinator::TlsMode::kOff;
                } else {
                  return absl::InvalidArgumentError(
                      absl::StrCat("'", std::string(v), "' is not auto, on or off"));
                }
                return absl::OkStatus();
              })
      .Default("auto");
  flags.Switch("--insecure", &o.insecure,
               "serve plaintext on a non-loopback address (tokens in clear text; warned)");
  flags.Strings("--tls-san", &o.tls_sans, "NAME",
                "another DNS name or IP address for the automatic server certificate (repeatable; "
                "it always names --listen's host and this host's name)");
  flags.Switch("--renew-certs", renew_certs,
               "re-issue the automatic server certificate (and the CA when it expires within 30 "
               "days) for --listen and --tls-san, then exit; restart the coordinator after");
  flags.String("--tls-cert", &o.tls_cert, "FILE",
               "your own server certificate (PEM, chain) instead of the automatic one; needs "
               "--tls-key");
  flags.String("--tls-key", &o.tls_key, "FILE", "its private key (PEM)");
  flags.String("--tls-client-ca", &o.tls_client_ca, "FILE",
               "require client certificates signed by FILE");
}

void DeclareObservabilityFlags(rackrun::flags::FlagSet& flags,
                               rackrun::coordinator::ServerOptions& o) {
  flags.Section("observability");
  flags
      .String("--metrics-listen", &o.observability.metrics_listen, "HOST:PORT",
              "Prometheus endpoint, GET /metrics, e.g. 0.0.0.0:9464")
      .Default("off");
  flags
      .String("--dashboard-listen", &o.observability.dashboard_listen, "HOST:PORT",
              "built-in live dashboard, loopback only, e.g. 127.0.0.1:8080")
      .Default("off");
  flags
      .String("--dashboard-assets", &o.observability.dashboard_assets, "DIR",
              "the dashboard's page and uPlot")
      .Default("the source tree's metrics/dashboard");
  flags.Switch("--dashboard-allow-remote", &o.observability.dashboard_allow_remote,
               "let --dashboard-listen take a non-loopback address (then open it as "
               "/?token=TOKEN, any role's token, e.g. STATE_DIR/token-readonly)");
  flags.String("--prometheus-targets", &o.prometheus_targets, "FILE",
               "keep FILE a Prometheus file_sd list of the live workers' metrics endpoints "
               "(their --metrics-listen, bound port included)");
}

// --renew-certs: the renewal command. The role tokens must exist (the join tokens carry
// them), so it runs on a state folder the coordinator has used.
int RenewCertificates(rackrun::coordinator::ServerOptions o) {
  using namespace rackrun::coordinator;
  if (!o.tls_cert.empty() || o.tls == TlsMode::kOff || o.insecure) {
    std::fprintf(stderr,
                 "rackrun-coordinator: --renew-certs renews the automatic certificates; with "
                 "--tls-cert, --tls=off or --insecure there are none to renew\n");
    return 2;
  }
  o.tls = TlsMode::kOn;
  const std::string admin = o.token_file.empty() ? o.state_dir + "/token" : o.token_file;
  absl::StatusOr<RoleTokens> tokens =
      LoadOrCreateRoleTokens(o.state_dir, admin, o.token_file.empty());
  absl::StatusOr<TlsSetup> tls =
      tokens.ok() ? SetUpTls(o, *tokens, /*renew=*/true) : tokens.status();
  if (!tls.ok()) {
    std::fprintf(stderr, "rackrun-coordinator: --renew-certs: %s\n",
                 std::string(tls.status().message()).c_str());
    return 1;
  }
  for (const std::string& n : tls->notes) std::printf("rackrun-coordinator: %s\n", n.c_str());
  for (const TlsSetup::Expiry& e : tls->expiries) {
    std::printf("rackrun-coordinator: %s now expires on %s\n", e.what.c_str(),
                absl::FormatTime("%Y-%m-%d %H:%M UTC", e.expires, absl::UTCTimeZone()).c_str());
  }
  std::printf(
      "rackrun-coordinator: join tokens in %s/join-token-*; restart the coordinator to serve the "
      "new certificate\n",
      o.state_dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  rackrun::base::IgnoreSigpipe();
  // Every worker, client and dashboard connection takes a descriptor.
  const absl::StatusOr<int64_t> open_files = rackrun::base::RaiseOpenFileLimit();
  using rackrun::coordinator::ServerOptions;
  ServerOptions o;
  const char* home = std::getenv("HOME");
  o.state_dir = absl::StrCat(home != nullptr ? home : ".", "/.rackrun");
  rackrun::flags::FlagSet flags("rackrun-coordinator", "[options]");
  bool renew_certs = false;
  DeclareFlags(flags, o, &renew_certs);
  if (std::optional<int> exit = flags.ParseCommandLine(argc, argv)) return *exit;
  if (renew_certs) return RenewCertificates(o);
  if (o.rack.workers.heartbeat_timeout_ms <= o.rack.workers.heartbeat_interval_ms) {
    return flags.Fail(
        "--heartbeat-timeout-ms",
        absl::StrCat(o.rack.workers.heartbeat_timeout_ms, " must exceed --heartbeat-interval-ms (",
                     o.rack.workers.heartbeat_interval_ms, ")"));
  }

  // Signals are taken by sigwait, not by handlers, so block them in every thread. The
  // waiting thread starts before the server does: a signal during the start (a slow state
  // folder, a replay) ends the process at once instead of waiting for the start to finish
  // (the database survives that as it survives kill -9); once serving, it shuts down.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::mutex signal_mu;
  std::condition_variable signal_cv;
  bool serving = false;
  int sig = 0;
  std::thread([&signals, &signal_mu, &signal_cv, &serving, &sig] {
    int got = 0;
    sigwait(&signals, &got);
    std::lock_guard<std::mutex> lock(signal_mu);
    if (!serving) {
      std::fprintf(stderr, "rackrun-coordinator: %s while starting; exiting\n",
                   got == SIGTERM ? "SIGTERM" : "SIGINT");
      std::_Exit(128 + got);
    }
    sig = got;
    signal_cv.notify_all();
  }).detach();

  auto server = rackrun::coordinator::CoordinatorServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "rackrun-coordinator: %s\n",
                 std::string(server.status().message()).c_str());
    return 1;
  }
  const std::string host = o.listen.substr(0, o.listen.rfind(':'));
  const rackrun::coordinator::TlsSetup& tls = (*server)->tls();
  for (const std::string& n : tls.notes) std::printf("rackrun-coordinator: %s\n", n.c_str());
  if (tls.insecure_remote) {
    std::fprintf(stderr,
                 "rackrun-coordinator: WARNING: --insecure: plaintext on %s; every token and job "
                 "crosses the network in clear text. Drop --insecure to serve TLS.\n",
                 o.listen.c_str());
  }
  for (const std::string& w :
       rackrun::coordinator::ExpiryWarnings(tls, absl::Now(), o.cert_warn_ahead)) {
    std::fprintf(stderr, "rackrun-coordinator: warning: %s\n", w.c_str());
  }
  WarnIfFewOpenFiles(open_files);
  std::printf("rackrun-coordinator: listening on %s:%d, state %s, token file %s (%s)\n",
              host.c_str(), (*server)->port(), o.state_dir.c_str(), (*server)->token_file().c_str(),
              tls.summary.c_str());
  if (!tls.ca_sha256.empty()) {
    std::printf(
        "rackrun-coordinator: join tokens: %s/join-token-worker (workers), join-token-user "
        "(users), join-token-readonly\n",
        o.state_dir.c_str());
  }
  if ((*server)->metrics_port() > 0) {
    const std::string& m = o.observability.metrics_listen;
    std::printf("rackrun-coordinator: metrics on http://%s:%d/metrics\n",
                m.substr(0, m.rfind(':')).c_str(), (*server)->metrics_port());
  }
  if ((*server)->dashboard_port() > 0) {
    const std::string& d = o.observability.dashboard_listen;
    std::printf("rackrun-coordinator: dashboard on http://%s:%d/\n",
                d.substr(0, d.rfind(':')).c_str(), (*server)->dashboard_port());
  }
  std::fflush(stdout);
  {
    std::unique_lock<std::mutex> lock(signal_mu);
    serving = true;
    signal_cv.wait(lock, [&sig] { return sig != 0; });
  }
  std::printf("rackrun-coordinator: %s, shutting down\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  (*server)->Shutdown();
  return 0;
}
