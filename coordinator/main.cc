// rackrun-coordinator: the rack coordinator daemon. See server.h; flags below.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/server.h"

namespace {

constexpr const char* kUsage =
    "usage: rackrun-coordinator [--listen HOST:PORT] [--state-dir DIR] [--token-file FILE]\n"
    "         [--heartbeat-interval-ms N] [--heartbeat-timeout-ms N] [--hang-timeout-ms N]\n"
    "         [--start-timeout-ms N] [--report-grace-ms N] [--reattach-grace-ms N]\n"
    "         [--channel-timeout-ms N]\n"
    "         [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]\n"
    "         [--metrics-listen HOST:PORT] [--dashboard-listen HOST:PORT] [--dashboard-assets DIR]\n"
    "         [--dashboard-allow-remote] [--prometheus-targets FILE]\n"
    "  --listen          address to serve on (default 127.0.0.1:7070; port 0 = any free port)\n"
    "  --state-dir       job database and token (default ~/.rackrun)\n"
    "  --hang-timeout-ms   a rank longer than this in one phase, or its peers in a collective\n"
    "                    waiting for it, is HANG (default 60000)\n"
    "  --start-timeout-ms  the same for phase starting: model, data, checks (default 600000)\n"
    "  --report-grace-ms   a rank's own failure report this soon after a HANG verdict naming it\n"
    "                    replaces the verdict (default 30000)\n"
    "  --token-file      cluster token (default STATE_DIR/token, created at first start, mode 0600)\n"
    "  --metrics-listen  Prometheus endpoint, GET /metrics (default off; e.g. 0.0.0.0:9464)\n"
    "  --dashboard-listen  built-in live dashboard (default off; loopback only, e.g. 127.0.0.1:8080)\n"
    "  --dashboard-assets  its page and uPlot (default the source tree's metrics/dashboard)\n"
    "  --dashboard-allow-remote  let --dashboard-listen take a non-loopback address (no token asked)\n"
    "  --prometheus-targets FILE  keep FILE a Prometheus file_sd list of the live workers' metrics\n"
    "                    endpoints (their --metrics-listen, bound port included)\n";

int Fail(const std::string& message) {
  std::fprintf(stderr, "rackrun-coordinator: %s\n%s", message.c_str(), kUsage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using rackrun::coordinator::ServerOptions;
  ServerOptions o;
  const char* home = std::getenv("HOME");
  o.state_dir = absl::StrCat(home != nullptr ? home : ".", "/.rackrun");
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    if (flag == "-h" || flag == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (flag == "--dashboard-allow-remote") {
      o.observability.dashboard_allow_remote = true;
      continue;
    }
    if (const size_t eq = flag.find('='); eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return Fail(absl::StrCat(flag, ": needs a value"));
    }
    int64_t* number = nullptr;
    if (flag == "--listen") {
      o.listen = value;
    } else if (flag == "--state-dir") {
      o.state_dir = value;
    } else if (flag == "--token-file") {
      o.token_file = value;
    } else if (flag == "--metrics-listen") {
      o.observability.metrics_listen = value;
    } else if (flag == "--prometheus-targets") {
      o.prometheus_targets = value;
    } else if (flag == "--dashboard-listen") {
      o.observability.dashboard_listen = value;
    } else if (flag == "--dashboard-assets") {
      o.observability.dashboard_assets = value;
    } else if (flag == "--tls-cert") {
      o.tls_cert = value;
    } else if (flag == "--tls-key") {
      o.tls_key = value;
    } else if (flag == "--tls-client-ca") {
      o.tls_client_ca = value;
    } else if (flag == "--heartbeat-interval-ms") {
      number = &o.rack.workers.heartbeat_interval_ms;
    } else if (flag == "--heartbeat-timeout-ms") {
      number = &o.rack.workers.heartbeat_timeout_ms;
    } else if (flag == "--hang-timeout-ms") {
      number = &o.rack.workers.hang_timeout_ms;
    } else if (flag == "--start-timeout-ms") {
      number = &o.rack.workers.start_timeout_ms;
    } else if (flag == "--report-grace-ms") {
      number = &o.rack.jobs.report_grace_ms;
    } else if (flag == "--reattach-grace-ms") {
      number = &o.rack.jobs.reattach_grace_ms;
    } else if (flag == "--channel-timeout-ms") {
      number = &o.rack.channel_timeout_ms;
    } else if (flag == "--serving-delay-ms") {  // tests: hold health at NOT_SERVING
      number = &o.serving_delay_ms;
    } else {
      return Fail(absl::StrCat("unknown flag '", flag, "'"));
    }
    if (number != nullptr && (!absl::SimpleAtoi(value, number) || *number < 0)) {
      return Fail(absl::StrCat(flag, ": '", value, "' is not a non-negative number of milliseconds"));
    }
  }
  if (o.rack.workers.heartbeat_timeout_ms <= o.rack.workers.heartbeat_interval_ms) {
    return Fail("--heartbeat-timeout-ms: must exceed --heartbeat-interval-ms");
  }

  // Signals are taken by sigwait below, not by handlers, so block them in every thread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = rackrun::coordinator::CoordinatorServer::Start(o);
  if (!server.ok()) {
    std::fprintf(stderr, "rackrun-coordinator: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  const std::string host = o.listen.substr(0, o.listen.rfind(':'));
  std::printf("rackrun-coordinator: listening on %s:%d, state %s, token file %s%s\n", host.c_str(),
              (*server)->port(), o.state_dir.c_str(), (*server)->token_file().c_str(),
              o.tls_cert.empty() ? " (insecure: no TLS)" : " (TLS)");
  if ((*server)->metrics_port() > 0) {
    const std::string& m = o.observability.metrics_listen;
    std::printf("rackrun-coordinator: metrics on http://%s:%d/metrics\n", m.substr(0, m.rfind(':')).c_str(),
                (*server)->metrics_port());
  }
  if ((*server)->dashboard_port() > 0) {
    const std::string& d = o.observability.dashboard_listen;
    std::printf("rackrun-coordinator: dashboard on http://%s:%d/\n", d.substr(0, d.rfind(':')).c_str(),
                (*server)->dashboard_port());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  std::printf("rackrun-coordinator: %s, shutting down\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  std::fflush(stdout);
  (*server)->Shutdown();
  return 0;
}
