#include "metrics/scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace rackrun::metrics {

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

absl::StatusOr<RawHttpResponse> RawHttp(int port, const std::string& request, int timeout_ms) {
  const int fd = ConnectLoopback(port);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close early on a bad request; read what it said
    sent += static_cast<size_t>(n);
  }
  std::string raw;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  char buf[65536];
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) {
      close(fd);
      return absl::DeadlineExceededError(
          absl::StrCat("no complete response from 127.0.0.1:", port));
    }
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  RawHttpResponse r;
  const size_t end = raw.find("\r\n\r\n");
  r.headers = raw.substr(0, end);
  if (end != std::string::npos) r.body = raw.substr(end + 4);
  const size_t sp = raw.find(' ');
  if (raw.rfind("HTTP/", 0) == 0 && sp != std::string::npos)
    r.status = std::atoi(raw.c_str() + sp + 1);
  return r;
}

absl::StatusOr<RawHttpResponse> HttpGet(int port, const std::string& path, int timeout_ms) {
  return RawHttp(port, absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"),
                 timeout_ms);
}

namespace {

// Parses `{a="x",b="y"}` at text[*i] (after the name); escapes \\ \" \n.
bool ParseLabels(absl::string_view text, size_t* i, std::map<std::string, std::string>* labels) {
  ++*i;  // '{'
  while (*i < text.size() && text[*i] != '}') {
    const size_t eq = text.find('=', *i);
    if (eq == absl::string_view::npos || eq + 1 >= text.size() || text[eq + 1] != '"') return false;
    std::string key(absl::StripAsciiWhitespace(text.substr(*i, eq - *i)));
    std::string value;
    size_t j = eq + 2;
    for (; j < text.size() && text[j] != '"'; ++j) {
      if (text[j] == '\\' && j + 1 < text.size()) {
        ++j;
        value += text[j] == 'n' ? '\n' : text[j];
      } else {
        value += text[j];
      }
    }
    if (j >= text.size()) return false;
    (*labels)[key] = value;
    *i = j + 1;
    if (*i < text.size() && text[*i] == ',') ++*i;
  }
  if (*i >= text.size()) return false;
  ++*i;  // '}'
  return true;
}

}  // namespace

absl::StatusOr<std::map<std::string, MetricFamily>> ParseExposition(const std::string& text) {
  std::map<std::string, MetricFamily> out;
  std::string current;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (line.empty()) continue;
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ');
      if (parts.size() != 2)
        return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": bad TYPE"));
      current = parts[0];
      out[current].type = parts[1];
      continue;
    }
    if (absl::ConsumePrefix(&line, "# HELP ")) {
      const size_t sp = line.find(' ');
      out[std::string(line.substr(0, sp))].help =
          sp == absl::string_view::npos ? "" : std::string(line.substr(sp + 1));
      continue;
    }
    if (line[0] == '#') continue;
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = std::string(line.substr(0, i));
    if (i < line.size() && line[i] == '{' && !ParseLabels(line, &i, &s.labels)) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": bad labels: ", line));
    }
    std::vector<absl::string_view> rest =
        absl::StrSplit(absl::StripAsciiWhitespace(line.substr(i)), ' ');
    if (rest.empty())
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": no value"));
    if (rest[0] == "+Inf") {
      s.value = HUGE_VAL;
    } else if (rest[0] == "-Inf") {
      s.value = -HUGE_VAL;
    } else if (rest[0] == "NaN") {
      s.value = NAN;
    } else if (!absl::SimpleAtod(rest[0], &s.value)) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": bad value: ", line));
    }
    // A sample belongs to the family whose name prefixes it (histograms' suffixes).
    std::string family = s.name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (out.count(family) == 0 && absl::EndsWith(s.name, suffix)) {
        family = s.name.substr(0, s.name.size() - std::string(suffix).size());
      }
    }
    if (out.count(family) == 0)
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, ": no TYPE for ", s.name));
    out[family].samples.push_back(std::move(s));
  }
  return out;
}

}  // namespace rackrun::metrics
