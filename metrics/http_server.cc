#include "metrics/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace rackrun::metrics {

namespace {

using Clock = std::chrono::steady_clock;

// After the response, the connection's read side is drained for at most this long before it
// is closed, so that a request body the server never read does not turn the close into a
// reset that discards the response on its way to the client.
constexpr int kLingerMs = 1000;
// Connections accepted per poll round: a flood of connects still lets the round go on to
// the connections already open.
constexpr int kAcceptsPerRound = 64;
// How long the listener is left alone after accept found no descriptor free.
constexpr int kAcceptPauseMs = 100;

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    default:
      return status < 400 ? "OK" : "Error";
  }
}

std::string Format(const HttpResponse& r, bool head) {
  return absl::StrCat(
      "HTTP/1.1 ", r.status, " ", Reason(r.status), "\r\nContent-Type: ", r.content_type,
      "\r\nContent-Length: ", r.body.size(),
      "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
      "Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'; "
      "img-src 'self' data:\r\n"
      "Connection: close\r\n\r\n",
      head ? "" : r.body);
}

std::string Error(int status, const std::string& text) {
  return Format(HttpResponse{status, "text/plain; charset=utf-8", text + "\n"}, false);
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The end of the request head in `in` (one past its blank line), or npos; `from`: where the
// search may start (bytes before it were searched already).
size_t HeadEnd(const std::string& in, size_t from) {
  from = from > 3 ? from - 3 : 0;
  const size_t crlf = in.find("\r\n\r\n", from);
  const size_t lf = in.find("\n\n", from);
  if (crlf == std::string::npos && lf == std::string::npos) return std::string::npos;
  return crlf < lf ? crlf + 4 : lf + 2;
}

int MsUntil(Clock::time_point t, Clock::time_point now) {
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - now).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

}  // namespace

struct HttpServer::Connection {
  enum class Phase { kReading, kWriting, kDraining };
  int fd = -1;
  Phase phase = Phase::kReading;
  Clock::time_point deadline;
  std::string in, out;
  size_t sent = 0;
};

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

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const Options& options,
                                                              HttpHandler handler) {
  std::string host;
  int port = 0;
  if (absl::Status s = SplitHostPort(options.listen, options.flag, &host, &port); !s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.flag, ": cannot resolve host '", host, "'"));
  }
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->options_ = options;
  s->options_.max_connections = std::max(1, options.max_connections);
  s->handler_ = std::move(handler);
  int fd = -1;
  std::string error = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      error = std::strerror(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat(options.flag, ": cannot listen on ", options.listen, ": ", error));
  }
  s->listen_fd_ = fd;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  s->port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  if (pipe2(s->wake_, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat(options.flag, ": pipe: ", std::strerror(errno)));
  }
  HttpServer* self = s.get();
  s->thread_ = std::thread([self] { self->Serve(); });
  return s;
}

HttpServer::~HttpServer() {
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

std::string HttpServer::Respond(const std::string& head) {
  const std::string line = head.substr(0, head.find_first_of("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  if (sp2 == std::string::npos || !absl::StartsWith(line.substr(sp2 + 1), "HTTP/1.")) {
    return Error(400, "not an HTTP/1.x request line (METHOD /path HTTP/1.1)");
  }
  const std::string method = line.substr(0, sp1);
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) return Error(405, "read-only: GET and HEAD only");
  std::string target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  // Absolute form (a proxy's "GET http://host:port/path"): the path from it.
  for (const char* scheme : {"http://", "https://"}) {
    if (absl::StartsWith(target, scheme)) {
      const size_t slash = target.find('/', std::strlen(scheme));
      target = slash == std::string::npos ? "/" : target.substr(slash);
    }
  }
  if (target.empty() || target[0] != '/') return Error(400, "the request target is not a path");
  const size_t q = target.find('?');
  const std::string path = PercentDecode(target.substr(0, q));
  const std::string query = q == std::string::npos ? "" : target.substr(q + 1);
  HttpResponse r;
  try {
    r = handler_(path, query);
  } catch (const std::exception& e) {
    r = HttpResponse{500, "text/plain; charset=utf-8",
                     absl::StrCat("internal error: ", e.what(), "\n")};
  }
  return Format(r, head_only);
}

void HttpServer::StartWriting(Connection& c, std::string response) {
  c.out = std::move(response);
  c.sent = 0;
  c.in.clear();
  c.in.shrink_to_fit();
  c.phase = Connection::Phase::kWriting;
  c.deadline = Clock::now() + std::chrono::milliseconds(options_.response_timeout_ms);
}

void HttpServer::Expire(Clock::time_point now) {
  for (std::unique_ptr<Connection>& c : conns_) {
    if (now < c->deadline) continue;
    if (c->phase == Connection::Phase::kReading) {
      // A 408 if the socket takes it at once; the connection goes either way.
      const std::string r = Error(408, absl::StrCat("the request line and headers did not arrive "
                                                    "within ",
                                                    options_.request_timeout_ms, " ms"));
      (void)send(c->fd, r.data(), r.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    close(c->fd);
    c->fd = -1;
  }
}

void HttpServer::WriteSome(Connection& c, Clock::time_point now) {
  const ssize_t n =
      send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (n <= 0) {
    close(c.fd);
    c.fd = -1;
    return;
  }
  c.sent += static_cast<size_t>(n);
  if (c.sent == c.out.size()) {
    shutdown(c.fd, SHUT_WR);
    c.out.clear();
    c.out.shrink_to_fit();
    c.phase = Connection::Phase::kDraining;
    c.deadline = now + std::chrono::milliseconds(kLingerMs);
  }
}

void HttpServer::ReadSome(Connection& c) {
  char buf[16384];
  while (true) {
    const ssize_t n = recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // closed by the client (or reset): nothing to answer
      close(c.fd);
      c.fd = -1;
      return;
    }
    if (c.phase == Connection::Phase::kDraining) continue;
    const size_t before = c.in.size();
    c.in.append(buf, static_cast<size_t>(n));
    const size_t end = HeadEnd(c.in, before);
    if (end != std::string::npos && end <= options_.max_request_bytes) {
      StartWriting(c, Respond(c.in.substr(0, end)));
      return;
    }
    if (c.in.size() > options_.max_request_bytes) {
      StartWriting(c, Error(400, absl::StrCat("request line and headers over ",
                                              options_.max_request_bytes, " bytes")));
      return;
    }
  }
}

void HttpServer::Accept(Clock::time_point now) {
  for (int a = 0; a < kAcceptsPerRound; ++a) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      // EAGAIN: none left. Out of descriptors (EMFILE, ENFILE): the pending connection stays
      // queued and the listener stays readable, so stop polling it for a while instead of
      // spinning; connections that end meanwhile free descriptors.
      if (errno == EMFILE || errno == ENFILE) {
        accept_paused_until_ = now + std::chrono::milliseconds(kAcceptPauseMs);
      }
      return;
    }
    if (static_cast<int>(conns_.size()) >= options_.max_connections) {
      // Full: the connection that has waited longest for its request goes (conns_ keeps
      // accept order: connections are appended and erased in place).
      const auto oldest =
          std::find_if(conns_.begin(), conns_.end(), [](const std::unique_ptr<Connection>& c) {
            return c->phase == Connection::Phase::kReading;
          });
      if (oldest == conns_.end()) {  // every slot is answering: refuse this one
        close(fd);
        continue;
      }
      close((*oldest)->fd);
      conns_.erase(oldest);
    }
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->deadline = now + std::chrono::milliseconds(options_.request_timeout_ms);
    conns_.push_back(std::move(c));
  }
}

void HttpServer::Serve() {
  const auto sweep = [this] {
    std::erase_if(conns_, [](const std::unique_ptr<Connection>& c) { return c->fd < 0; });
    open_.store(static_cast<int>(conns_.size()), std::memory_order_relaxed);
  };
  std::vector<pollfd> fds;
  while (true) {
    Clock::time_point now = Clock::now();
    Expire(now);
    sweep();
    const bool accepting = now >= accept_paused_until_;
    fds.assign(
        {{listen_fd_, static_cast<short>(accepting ? POLLIN : 0), 0}, {wake_[0], POLLIN, 0}});
    int timeout = accepting ? -1 : MsUntil(accept_paused_until_, now);
    for (const std::unique_ptr<Connection>& c : conns_) {
      const bool writing = c->phase == Connection::Phase::kWriting;
      fds.push_back({c->fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
      const int ms = MsUntil(c->deadline, now);
      timeout = timeout < 0 ? ms : std::min(timeout, ms);
    }
    if (poll(fds.data(), fds.size(), timeout) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;
    now = Clock::now();
    for (size_t i = 0; i < conns_.size(); ++i) {
      if (fds[i + 2].revents == 0) continue;
      Connection& c = *conns_[i];
      if (c.phase == Connection::Phase::kWriting) {
        WriteSome(c, now);
      } else {
        ReadSome(c);
      }
    }
    sweep();
    if ((fds[0].revents & POLLIN) != 0) Accept(now);
    open_.store(static_cast<int>(conns_.size()), std::memory_order_relaxed);
  }
  for (std::unique_ptr<Connection>& c : conns_) close(c->fd);
  conns_.clear();
  open_.store(0, std::memory_order_relaxed);
}

std::string HttpServer::QueryValue(const std::string& query, const std::string& key) {
  for (absl::string_view part : absl::StrSplit(query, '&')) {
    const size_t eq = part.find('=');
    if (eq != absl::string_view::npos && part.substr(0, eq) == key)
      return std::string(part.substr(eq + 1));
  }
  return "";
}

std::string HttpServer::PercentDecode(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && HexDigit(s[i + 1]) >= 0 && HexDigit(s[i + 2]) >= 0) {
      out += static_cast<char>(HexDigit(s[i + 1]) * 16 + HexDigit(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace rackrun::metrics
