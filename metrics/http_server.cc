#include "metrics/http_server.h"

#include <civetweb.h>

#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "metrics/exporter.h"

namespace rackrun::metrics {

namespace {

const char* Reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 503:
      return "Service Unavailable";
    default:
      return status < 400 ? "OK" : "Error";
  }
}

void Send(mg_connection* conn, const HttpResponse& r, bool head) {
  const std::string headers =
      absl::StrCat("HTTP/1.1 ", r.status, " ", Reason(r.status),
                   "\r\nContent-Type: ", r.content_type, "\r\nContent-Length: ", r.body.size(),
                   "\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n"
                   "Content-Security-Policy: default-src 'self'; style-src 'self' 'unsafe-inline'; "
                   "img-src 'self' data:\r\n"
                   "Connection: close\r\n\r\n");
  mg_write(conn, headers.data(), headers.size());
  if (!head && !r.body.empty()) mg_write(conn, r.body.data(), r.body.size());
}

}  // namespace

int HttpServer::Dispatch(mg_connection* conn, void* self) {
  const mg_request_info* ri = mg_get_request_info(conn);
  auto* server = static_cast<HttpServer*>(self);
  const std::string method = ri->request_method != nullptr ? ri->request_method : "";
  const bool head = method == "HEAD";
  HttpResponse r;
  if (method != "GET" && !head) {
    r.status = 405;
    r.body = "read-only: GET and HEAD only\n";
  } else {
    const std::string path = ri->local_uri != nullptr ? ri->local_uri : "/";
    const std::string query = ri->query_string != nullptr ? ri->query_string : "";
    try {
      r = server->handler_(path, query);
    } catch (const std::exception& e) {
      r = HttpResponse{500, "text/plain; charset=utf-8",
                       absl::StrCat("internal error: ", e.what(), "\n")};
    }
  }
  Send(conn, r, head);
  return r.status;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const Options& options,
                                                              HttpHandler handler) {
  std::string host;
  int port = 0;
  if (absl::Status s = SplitHostPort(options.listen, options.flag, &host, &port); !s.ok()) return s;
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->handler_ = std::move(handler);
  const std::string ports = host.find(':') != std::string::npos
                                ? absl::StrCat("[", host, "]:", port)
                                : absl::StrCat(host, ":", port);
  const std::string threads = absl::StrCat(options.threads < 1 ? 1 : options.threads);
  const char* civet_options[] = {"listening_ports",
                                 ports.c_str(),
                                 "num_threads",
                                 threads.c_str(),
                                 "request_timeout_ms",
                                 "10000",
                                 "enable_keep_alive",
                                 "no",
                                 "max_request_size",
                                 "16384",
                                 nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  s->ctx_ = mg_start(&callbacks, nullptr, civet_options);
  if (s->ctx_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(options.flag, ": cannot listen on ", options.listen,
                                               " (address in use, or not local)"));
  }
  mg_set_request_handler(s->ctx_, "/", &HttpServer::Dispatch, s.get());
  mg_server_port sp[4];
  const int n = mg_get_server_ports(s->ctx_, 4, sp);
  if (n < 1)
    return absl::UnavailableError(
        absl::StrCat(options.flag, ": no port bound for ", options.listen));
  s->port_ = sp[0].port;
  return s;
}

HttpServer::~HttpServer() {
  if (ctx_ != nullptr) mg_stop(ctx_);
}

std::string HttpServer::QueryValue(const std::string& query, const std::string& key) {
  for (absl::string_view part : absl::StrSplit(query, '&')) {
    const size_t eq = part.find('=');
    if (eq != absl::string_view::npos && part.substr(0, eq) == key)
      return std::string(part.substr(eq + 1));
  }
  return "";
}

}  // namespace rackrun::metrics
