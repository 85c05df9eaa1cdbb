#include "planner/trace.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "base/string_view.h"
#include "nlohmann/json.hpp"

namespace rackrun::planner {
namespace {

using nlohmann::json;

constexpr absl::string_view kFields = "microbatch, layer, ranks, experts, loads";

using base::AsAbsl;

absl::Status Bad(std::string_view where, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(where), ": ", AsAbsl(what)));
}

// Reads an integer field in [lo, hi]. Floats ("3.0"), strings and booleans are rejected:
// a trace holds exact counts.
absl::StatusOr<int64_t> IntField(const json& object, std::string_view name, int64_t lo, int64_t hi,
                                 std::string_view where) {
  auto it = object.find(name);
  if (it == object.end()) {
    return Bad(where,
               absl::StrCat("missing field \"", AsAbsl(name), "\"; every line needs ", kFields));
  }
  if (!it->is_number_integer()) {
    return Bad(where, absl::StrCat("field \"", AsAbsl(name), "\" is ", it->type_name(),
                                   ", expected an integer"));
  }
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Bad(where, absl::StrCat("field \"", AsAbsl(name), "\" is too large (at most ", hi, ")"));
  }
  const int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return Bad(where,
               absl::StrCat("field \"", AsAbsl(name), "\" is ", v, ", expected ", lo, "..", hi));
  }
  return v;
}

}  // namespace

absl::StatusOr<TraceEntry> ParseTraceLine(std::string_view line, std::string_view where) {
  json doc;
  try {
    doc = json::parse(line.begin(), line.end());
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number too large for a double ("1e400"; found
    // by tests/fuzz fuzz_trace_line). nlohmann's message starts with
    // "[json.exception.parse_error.101] "; keep the rest.
    std::string_view message = e.what();
    if (const size_t close = message.find("] "); close != std::string_view::npos) {
      message.remove_prefix(close + 2);
    }
    return Bad(where,
               absl::StrCat("bad JSON (", AsAbsl(message), "); each line must be one JSON object"));
  }
  if (!doc.is_object()) {
    return Bad(where, absl::StrCat("line is a JSON ", doc.type_name(),
                                   ", expected an object with fields ", kFields));
  }
  for (const auto& item : doc.items()) {
    const std::string& key = item.key();
    if (key != "microbatch" && key != "layer" && key != "ranks" && key != "experts" &&
        key != "loads") {
      return Bad(where,
                 absl::StrCat("unknown field \"", key, "\"; a trace line has exactly ", kFields));
    }
  }
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  absl::StatusOr<int64_t> microbatch =
      IntField(doc, "microbatch", 0, std::numeric_limits<int64_t>::max(), where);
  if (!microbatch.ok()) return microbatch.status();
  absl::StatusOr<int64_t> layer = IntField(doc, "layer", 0, kIntMax, where);
  if (!layer.ok()) return layer.status();
  absl::StatusOr<int64_t> ranks = IntField(doc, "ranks", 1, kIntMax, where);
  if (!ranks.ok()) return ranks.status();
  absl::StatusOr<int64_t> experts = IntField(doc, "experts", 1, kIntMax, where);
  if (!experts.ok()) return experts.status();
  if (*experts % *ranks != 0) {
    return Bad(where, absl::StrCat("experts (", *experts, ") is not a multiple of ranks (", *ranks,
                                   "); every rank must be home to the same number of experts"));
  }

  auto loads_it = doc.find("loads");
  if (loads_it == doc.end()) {
    return Bad(where, absl::StrCat("missing field \"loads\"; every line needs ", kFields));
  }
  const json& rows = *loads_it;
  if (!rows.is_array()) {
    return Bad(where, absl::StrCat("field \"loads\" is ", rows.type_name(),
                                   ", expected a ranks x experts array of arrays"));
  }
  if (static_cast<int64_t>(rows.size()) != *ranks) {
    return Bad(where, absl::StrCat("loads has ", rows.size(), " rows but ranks is ", *ranks,
                                   "; loads needs one row per source rank"));
  }
  for (size_t src = 0; src < rows.size(); ++src) {
    if (!rows[src].is_array()) {
      return Bad(where, absl::StrCat("loads[", src, "] is ", rows[src].type_name(),
                                     ", expected an array of ", *experts, " counts"));
    }
    if (static_cast<int64_t>(rows[src].size()) != *experts) {
      return Bad(where,
                 absl::StrCat("loads[", src, "] has ", rows[src].size(), " columns but experts is ",
                              *experts, "; each row needs one count per logical expert"));
    }
  }

  TraceEntry entry;
  entry.microbatch = *microbatch;
  entry.layer = static_cast<int>(*layer);
  entry.loads = LoadMatrix(static_cast<int>(*ranks), static_cast<int>(*experts));
  for (int src = 0; src < entry.loads.ranks; ++src) {
    const json& row = rows[static_cast<size_t>(src)];
    for (int e = 0; e < entry.loads.experts; ++e) {
      const json& v = row[static_cast<size_t>(e)];
      const bool integer = v.is_number_integer();
      const bool negative = integer && !v.is_number_unsigned() && v.get<int64_t>() < 0;
      const bool too_large =
          v.is_number_unsigned() &&
          v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      if (!integer || negative || too_large) {
        return Bad(where, absl::StrCat("loads[", src, "][", e, "] is ", v.dump(),
                                       "; token counts must be non-negative integers"));
      }
      entry.loads.at(src, e) = v.get<int64_t>();
    }
  }
  return entry;
}

std::string FormatTraceLine(const TraceEntry& entry) {
  const LoadMatrix& m = entry.loads;
  std::string out =
      absl::StrCat("{\"microbatch\": ", entry.microbatch, ", \"layer\": ", entry.layer,
                   ", \"ranks\": ", m.ranks, ", \"experts\": ", m.experts, ", \"loads\": [");
  out.reserve(out.size() + static_cast<size_t>(m.ranks) * static_cast<size_t>(m.experts) * 5);
  for (int src = 0; src < m.ranks; ++src) {
    out += src == 0 ? "[" : ", [";
    for (int e = 0; e < m.experts; ++e) {
      if (e > 0) out += ',';
      absl::StrAppend(&out, m.at(src, e));
    }
    out += ']';
  }
  out += "]}";
  return out;
}

absl::StatusOr<TraceReader> TraceReader::Open(const std::string& path, size_t max_line_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open the trace file (",
                                            std::strerror(errno),
                                            "); check the path passed to --trace"));
  }
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": is a directory; --trace takes a JSON Lines trace file (docs/design.md 8.3)"));
  }
  return TraceReader(path, fd, max_line_bytes);
}

TraceReader::TraceReader(TraceReader&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      max_line_bytes_(other.max_line_bytes_),
      buffer_(std::move(other.buffer_)),
      begin_(other.begin_),
      end_(other.end_),
      eof_(other.eof_),
      line_number_(other.line_number_),
      ranks_(other.ranks_),
      experts_(other.experts_),
      seen_(std::move(other.seen_)) {}

TraceReader& TraceReader::operator=(TraceReader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    max_line_bytes_ = other.max_line_bytes_;
    buffer_ = std::move(other.buffer_);
    begin_ = other.begin_;
    end_ = other.end_;
    eof_ = other.eof_;
    line_number_ = other.line_number_;
    ranks_ = other.ranks_;
    experts_ = other.experts_;
    seen_ = std::move(other.seen_);
  }
  return *this;
}

TraceReader::~TraceReader() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<bool> TraceReader::ReadLine(std::string& line) {
  constexpr size_t kChunk = size_t{1} << 16;
  line.clear();
  bool any = false;  // a last line without '\n' is still a line
  while (true) {
    if (begin_ == end_) {
      if (eof_) return any;
      buffer_.resize(kChunk);
      ssize_t n;
      do {
        n = ::read(fd_, buffer_.data(), buffer_.size());
      } while (n < 0 && errno == EINTR);
      if (n < 0) {
        return absl::DataLossError(absl::StrCat(path_, ":", line_number_ + 1, ": read error (",
                                                std::strerror(errno), ")"));
      }
      begin_ = 0;
      end_ = static_cast<size_t>(n);
      if (n == 0) {
        eof_ = true;
        return any;
      }
    }
    any = true;
    const char* start = buffer_.data() + begin_;
    const void* newline = std::memchr(start, '\n', end_ - begin_);
    const size_t take = newline != nullptr
                            ? static_cast<size_t>(static_cast<const char*>(newline) - start)
                            : end_ - begin_;
    if (line.size() + take > max_line_bytes_) {
      return Bad(absl::StrCat(path_, ":", line_number_ + 1),
                 absl::StrCat("line is longer than ", max_line_bytes_,
                              " bytes, the limit for one trace entry; split the trace's "
                              "domain or check that the file is JSON Lines"));
    }
    line.append(start, take);
    begin_ += take;
    if (newline != nullptr) {
      ++begin_;  // the '\n'
      return true;
    }
  }
}

absl::StatusOr<std::optional<TraceEntry>> TraceReader::Next() {
  std::string line;
  while (true) {
    absl::StatusOr<bool> read = ReadLine(line);
    if (!read.ok()) return read.status();
    if (!*read) break;
    ++line_number_;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path_, ":", line_number_);
    absl::StatusOr<TraceEntry> entry = ParseTraceLine(line, where);
    if (!entry.ok()) return entry.status();
    if (ranks_ == 0) {
      ranks_ = entry->loads.ranks;
      experts_ = entry->loads.experts;
    } else if (entry->loads.ranks != ranks_ || entry->loads.experts != experts_) {
      return Bad(where, absl::StrCat("ranks/experts are ", entry->loads.ranks, "/",
                                     entry->loads.experts, " but earlier lines have ", ranks_, "/",
                                     experts_, "; one trace describes one domain"));
    }
    if (!seen_.emplace(entry->microbatch, entry->layer).second) {
      return Bad(where, absl::StrCat("microbatch ", entry->microbatch, " layer ", entry->layer,
                                     " appears twice; each (microbatch, layer) has one line"));
    }
    return std::optional<TraceEntry>(*std::move(entry));
  }
  return std::optional<TraceEntry>();
}

absl::StatusOr<std::vector<TraceEntry>> ReadTrace(const std::string& path) {
  absl::StatusOr<TraceReader> reader = TraceReader::Open(path);
  if (!reader.ok()) return reader.status();
  std::vector<TraceEntry> entries;
  while (true) {
    absl::StatusOr<std::optional<TraceEntry>> next = reader->Next();
    if (!next.ok()) return next.status();
    if (!next->has_value()) break;
    entries.push_back(**std::move(next));
  }
  return entries;
}

absl::StatusOr<TraceWriter> TraceWriter::Open(const std::string& path, bool append) {
  absl::StatusOr<int> fd = base::OpenRegularFile(
      path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), base::FileUse::kJob);
  if (!fd.ok()) {
    if (fd.status().code() == absl::StatusCode::kPermissionDenied) return fd.status();
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": cannot open for writing: ", fd.status().message(),
                     "; check the directory exists and is writable"));
  }
  struct stat st {};
  const int64_t size = append && ::fstat(*fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
  return TraceWriter(path, *fd, size);
}

TraceWriter& TraceWriter::operator=(TraceWriter&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    good_ = other.good_;
  }
  return *this;
}

TraceWriter::~TraceWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status TraceWriter::Failed(std::string_view what) {
  const int err = errno;
  // Outputs are whole lines or nothing: drop a partly written line (through the
  // descriptor: the path may lead elsewhere by now).
  if (fd_ >= 0) {
    (void)!::ftruncate(fd_, static_cast<off_t>(good_));
    ::close(std::exchange(fd_, -1));
  }
  return absl::DataLossError(absl::StrCat(path_, ": ", std::string(what), ": ",
                                          err != 0 ? std::strerror(err) : "I/O error"));
}

absl::Status TraceWriter::Append(const TraceEntry& entry) {
  if (fd_ < 0) return absl::DataLossError(absl::StrCat(path_, ": write after a failure"));
  const std::string line = FormatTraceLine(entry) + '\n';
  size_t done = 0;
  while (done < line.size()) {
    errno = 0;
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Failed("write failed");
    done += static_cast<size_t>(n);
  }
  good_ += static_cast<int64_t>(line.size());
  return absl::OkStatus();
}

absl::Status TraceWriter::Close() {
  if (fd_ < 0) return absl::OkStatus();
  errno = 0;
  if (::close(std::exchange(fd_, -1)) != 0)
    return absl::DataLossError(
        absl::StrCat(path_, ": write failed on close: ", std::strerror(errno)));
  return absl::OkStatus();
}

}  // namespace rackrun::planner
