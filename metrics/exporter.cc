#include "metrics/exporter.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rackrun::metrics {

namespace {

constexpr size_t kMaxRequest = 8 << 10;
constexpr int kRequestTimeoutMs = 2000;

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n <= 0) return;  // the client went away or stalled past SO_SNDTIMEO
    done += static_cast<size_t>(n);
  }
}

std::string Response(int status, const char* reason, const std::string& type,
                     const std::string& body, bool head) {
  return absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: ", type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
                      head ? "" : body);
}

}  // namespace

absl::Status SplitHostPort(const std::string& address, const std::string& flag, std::string* host,
                           int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": '", address, "' is not HOST:PORT (e.g. 127.0.0.1:9464; port 0 = any free port)"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']')
    *host = host->substr(1, host->size() - 2);
  if (!absl::SimpleAtoi(address.substr(colon + 1), port) || *port < 0 || *port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": '", address, "' has no port number in [0, 65535] after the last ':'"));
  }
  return absl::OkStatus();
}

bool IsLoopbackHost(const std::string& host) {
  return absl::StartsWith(host, "127.") || host == "::1" || host == "localhost";
}

absl::StatusOr<std::unique_ptr<MetricsExporter>> MetricsExporter::Start(const std::string& listen) {
  std::string host;
  int port = 0;
  if (absl::Status s = SplitHostPort(listen, "--metrics-listen", &host, &port); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: cannot resolve host '", host, "'"));
  }
  std::unique_ptr<MetricsExporter> e(new MetricsExporter());
  int fd = -1;
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 64) != 0) {
      error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot listen on ", listen, ": ", error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  e->port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  e->listen_fd_ = fd;
  if (pipe2(e->wake_, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: pipe: ", std::strerror(errno)));
  }
  e->registry_ = std::make_shared<prometheus::Registry>();
  MetricsExporter* self = e.get();
  e->thread_ = std::thread([self] { self->Serve(); });
  return e;
}

void MetricsExporter::Serve() {
  while (true) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Handle(fd);
    close(fd);
  }
}

void MetricsExporter::Handle(int fd) {
  timeval tv{kRequestTimeoutMs / 1000, (kRequestTimeoutMs % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  // The request line and headers, within the size and time bounds.
  std::string request;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(kRequestTimeoutMs);
  char buf[2048];
  while (request.find("\r\n\r\n") == std::string::npos &&
         request.find("\n\n") == std::string::npos) {
    if (request.size() > kMaxRequest || std::chrono::steady_clock::now() > deadline) {
      WriteAll(
          fd, Response(400, "Bad Request", "text/plain", "request too large or too slow\n", false));
      return;
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  const std::string line = request.substr(0, request.find_first_of("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos || !absl::StartsWith(line.substr(sp2 + 1), "HTTP/1.")) {
    WriteAll(fd, Response(400, "Bad Request", "text/plain", "not an HTTP/1.x request\n", false));
    return;
  }
  const std::string method = line.substr(0, sp1);
  std::string path = line.substr(sp1 + 1, sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  const bool head = method == "HEAD";
  if (method != "GET" && !head) {
    WriteAll(fd, Response(405, "Method Not Allowed", "text/plain", "GET /metrics only\n", false));
    return;
  }
  if (path != "/metrics") {
    WriteAll(fd,
             Response(404, "Not Found", "text/plain", "rackrun metrics are at /metrics\n", head));
    return;
  }
  const std::string body = prometheus::TextSerializer().Serialize(registry_->Collect());
  WriteAll(fd, Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", body, head));
}

MetricsExporter::~MetricsExporter() {
  if (thread_.joinable()) {
    const char byte = 0;
    if (write(wake_[1], &byte, 1) != 1) {
      // The pipe cannot fail to take one byte while Serve runs; nothing else to do.
    }
    thread_.join();
  }
  for (const int fd : {listen_fd_, wake_[0], wake_[1]}) {
    if (fd >= 0) close(fd);
  }
}

}  // namespace rackrun::metrics
