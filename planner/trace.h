// Load traces: the exact post-gating loads of a run, one (microbatch, layer) at a time, in
// the JSON Lines format of docs/design.md section 8.3:
//
//   {"microbatch": 0, "layer": 3, "ranks": 64, "experts": 256, "loads": [[...], ...]}
//
// where loads[src][e] is the token count from source rank src to logical expert e (ranks
// rows of experts non-negative integers). Expert e's master lives on rank
// e / (experts / ranks), so experts must be a multiple of ranks.
#ifndef RACKRUN_PLANNER_TRACE_H_
#define RACKRUN_PLANNER_TRACE_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "planner/plan.h"

namespace rackrun::planner {

// One line of a trace.
struct TraceEntry {
  int64_t microbatch = 0;
  int layer = 0;
  LoadMatrix loads;

  friend bool operator==(const TraceEntry& a, const TraceEntry& b) {
    return a.microbatch == b.microbatch && a.layer == b.layer && a.loads.ranks == b.loads.ranks &&
           a.loads.experts == b.loads.experts && a.loads.counts == b.loads.counts;
  }
};

// Parses one trace line on its own. `where` prefixes every error ("FILE:LINE").
// InvalidArgument "WHERE: what is wrong; what to do" for bad JSON, a missing, unknown or
// wrongly typed field, negative or non-integer values, ranks/experts not positive, experts
// not a multiple of ranks, or a loads matrix that is not ranks x experts.
absl::StatusOr<TraceEntry> ParseTraceLine(std::string_view line, std::string_view where);

// Serialises one entry as a single line (no trailing newline) that ParseTraceLine reads
// back to an equal entry.
std::string FormatTraceLine(const TraceEntry& entry);

// Longest trace line a reader accepts: 16 MiB, room for a 1024 x 1024 loads matrix of
// 15-digit counts. Longer lines are refused as "FILE:LINE: line is longer than ..." after
// reading at most this many bytes of them, so memory stays bounded: the line plus its
// parsed JSON (at most 8 Mi values); `rackrun plan` peaks at ~530 MB RSS on a line of
// exactly this size, and at ~33 MB refusing a 100 MB line (was 2.2 GB).
inline constexpr size_t kMaxTraceLineBytes = size_t{16} << 20;

// Streams a trace file line by line (memory holds one line and one entry at a time).
// Blank lines are skipped. Besides ParseTraceLine's checks, every line must have the same
// ranks and experts as the first, no (microbatch, layer) may appear twice, and no line may
// be longer than `max_line_bytes`. Not thread-safe.
class TraceReader {
 public:
  // NotFound when the file cannot be opened; InvalidArgument when it is a directory.
  static absl::StatusOr<TraceReader> Open(const std::string& path,
                                          size_t max_line_bytes = kMaxTraceLineBytes);
  TraceReader(TraceReader&& other) noexcept;
  TraceReader& operator=(TraceReader&& other) noexcept;
  TraceReader(const TraceReader&) = delete;
  TraceReader& operator=(const TraceReader&) = delete;
  ~TraceReader();

  // The next entry, std::nullopt at the end of the file, InvalidArgument naming
  // "FILE:LINE" for a bad or too long line, or DataLoss naming the file and errno for a
  // read error. After an error the reader should not be used again.
  absl::StatusOr<std::optional<TraceEntry>> Next();

  // 1-based number of the last line read.
  int64_t line_number() const { return line_number_; }
  const std::string& path() const { return path_; }

 private:
  TraceReader(std::string path, int fd, size_t max_line_bytes)
      : path_(std::move(path)), fd_(fd), max_line_bytes_(max_line_bytes) {}
  // Reads the next line (without '\n') into `line`: true with a line, false at the end
  // of the file, or an error for a line over max_line_bytes_ or a failed read.
  absl::StatusOr<bool> ReadLine(std::string& line);

  std::string path_;
  int fd_ = -1;
  size_t max_line_bytes_ = kMaxTraceLineBytes;
  std::vector<char> buffer_;  // read-ahead; [begin_, end_) not yet consumed
  size_t begin_ = 0;
  size_t end_ = 0;
  bool eof_ = false;
  int64_t line_number_ = 0;
  int ranks_ = 0;
  int experts_ = 0;
  std::set<std::pair<int64_t, int>> seen_;
};

// Reads a whole trace into memory (convenience for small traces and tests).
absl::StatusOr<std::vector<TraceEntry>> ReadTrace(const std::string& path);

// Writes entries one line each. Not thread-safe. Movable.
class TraceWriter {
 public:
  // Truncates or creates `path` (`append`: extends it); InvalidArgument naming the file
  // and the system's reason when it cannot be opened for writing. A job file
  // (base::FileUse::kJob): a regular file only, confined on a worker with --allowed-roots
  // (PermissionDenied then).
  static absl::StatusOr<TraceWriter> Open(const std::string& path, bool append = false);
  TraceWriter(TraceWriter&& other) noexcept
      : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), good_(other.good_) {}
  TraceWriter& operator=(TraceWriter&& other) noexcept;
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;
  ~TraceWriter();

  absl::Status Append(const TraceEntry& entry);
  // Append and Close report a write error (e.g. disk full) with the file and errno, and
  // cut the file back to its last whole line.
  // Closes.
  absl::Status Close();

 private:
  TraceWriter(std::string path, int fd, int64_t good)
      : path_(std::move(path)), fd_(fd), good_(good) {}
  absl::Status Failed(std::string_view what);

  std::string path_;
  int fd_ = -1;       // written with write(2): every line reaches the file at once
  int64_t good_ = 0;  // bytes of whole lines known written
};

}  // namespace rackrun::planner

#endif  // RACKRUN_PLANNER_TRACE_H_
