#include "planner/trace.h"

#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::planner {
namespace {

using ::testing::HasSubstr;

TraceEntry SmallEntry(int64_t microbatch, int layer) {
  TraceEntry entry;
  entry.microbatch = microbatch;
  entry.layer = layer;
  entry.loads = LoadMatrix(2, 4);
  for (int src = 0; src < 2; ++src) {
    for (int e = 0; e < 4; ++e) entry.loads.at(src, e) = 10 * src + e + microbatch;
  }
  return entry;
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

// Expects ParseTraceLine to reject `line` with a message naming "f:7" and `what`.
void ExpectRejected(const std::string& line, const std::string& what) {
  absl::StatusOr<TraceEntry> entry = ParseTraceLine(line, "f:7");
  ASSERT_FALSE(entry.ok()) << line;
  EXPECT_EQ(entry.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(entry.status().message()), HasSubstr("f:7: ")) << line;
  EXPECT_THAT(std::string(entry.status().message()), HasSubstr(what)) << line;
}

TEST(TraceTest, FormatsTheDesignLayoutAndParsesBack) {
  const TraceEntry entry = SmallEntry(3, 1);
  const std::string line = FormatTraceLine(entry);
  EXPECT_EQ(line,
            "{\"microbatch\": 3, \"layer\": 1, \"ranks\": 2, \"experts\": 4, \"loads\": "
            "[[3,4,5,6], [13,14,15,16]]}");
  absl::StatusOr<TraceEntry> back = ParseTraceLine(line, "x:1");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, entry);
}

TEST(TraceTest, AcceptsAnyFieldOrderAndWhitespace) {
  absl::StatusOr<TraceEntry> entry = ParseTraceLine(
      R"( { "loads" : [[1, 0], [0, 2]], "experts": 2, "ranks": 2, "layer": 0, "microbatch": 5 } )",
      "x:1");
  ASSERT_TRUE(entry.ok()) << entry.status();
  EXPECT_EQ(entry->microbatch, 5);
  EXPECT_EQ(entry->loads.at(1, 1), 2);
}

TEST(TraceTest, WriterAndStreamingReaderRoundTrip) {
  const std::string path = ::testing::TempDir() + "/roundtrip.jsonl";
  absl::StatusOr<TraceWriter> writer = TraceWriter::Open(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::vector<TraceEntry> written;
  for (int mb = 0; mb < 3; ++mb) {
    for (int layer = 0; layer < 2; ++layer) {
      written.push_back(SmallEntry(mb, layer));
      ASSERT_TRUE(writer->Append(written.back()).ok());
    }
  }
  ASSERT_TRUE(writer->Close().ok());
  absl::StatusOr<std::vector<TraceEntry>> read = ReadTrace(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, written);
}

TEST(TraceTest, SkipsBlankLinesButCountsThemInErrors) {
  const std::string good = FormatTraceLine(SmallEntry(0, 0));
  const std::string path = WriteFile("blank.jsonl", good + "\n\n   \n{\"microbatch\": 1}\n");
  absl::StatusOr<TraceReader> reader = TraceReader::Open(path);
  ASSERT_TRUE(reader.ok());
  absl::StatusOr<std::optional<TraceEntry>> first = reader->Next();
  ASSERT_TRUE(first.ok() && first->has_value());
  absl::StatusOr<std::optional<TraceEntry>> second = reader->Next();
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(path + ":4: missing field"));
}

TEST(TraceTest, RejectsBadJson) {
  ExpectRejected("{\"microbatch\": 0, \"layer\": ", "bad JSON");
  ExpectRejected("[1, 2, 3]", "expected an object");
}

TEST(TraceTest, RejectsMissingUnknownAndMistypedFields) {
  ExpectRejected(R"({"layer": 0, "ranks": 1, "experts": 1, "loads": [[1]]})",
                 "missing field \"microbatch\"");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 1})",
                 "missing field \"loads\"");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 1, "loads": [[1]],
                     "load": 3})",
                 "unknown field \"load\"");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": "1", "experts": 1, "loads": [[1]]})",
                 "field \"ranks\" is string, expected an integer");
  ExpectRejected(R"({"microbatch": 0.5, "layer": 0, "ranks": 1, "experts": 1, "loads": [[1]]})",
                 "field \"microbatch\" is number, expected an integer");
  ExpectRejected(R"({"microbatch": 0, "layer": -1, "ranks": 1, "experts": 1, "loads": [[1]]})",
                 "field \"layer\" is -1");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 0, "experts": 1, "loads": []})",
                 "field \"ranks\" is 0");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 1, "loads": {}})",
                 "field \"loads\" is object");
}

TEST(TraceTest, RejectsExpertsNotAMultipleOfRanks) {
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 2, "experts": 3,
                     "loads": [[1, 2, 3], [4, 5, 6]]})",
                 "experts (3) is not a multiple of ranks (2)");
}

TEST(TraceTest, RejectsWrongMatrixShape) {
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 2, "experts": 2, "loads": [[1, 2]]})",
                 "loads has 1 rows but ranks is 2");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 2, "experts": 2,
                     "loads": [[1, 2], [3]]})",
                 "loads[1] has 1 columns but experts is 2");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 2, "experts": 2,
                     "loads": [[1, 2], 3]})",
                 "loads[1] is number");
}

TEST(TraceTest, RejectsNegativeAndNonIntegerCounts) {
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 2, "loads": [[1, -2]]})",
                 "loads[0][1] is -2; token counts must be non-negative integers");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 2, "loads": [[1.5, 2]]})",
                 "loads[0][0] is 1.5");
  ExpectRejected(R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 2, "loads": [[1, "2"]]})",
                 "loads[0][1] is \"2\"");
  ExpectRejected(
      R"({"microbatch": 0, "layer": 0, "ranks": 1, "experts": 1, "loads": [[18446744073709551615]]})",
      "loads[0][0] is 18446744073709551615");
}

TEST(TraceTest, ReaderRejectsDomainChangesAndDuplicatesWithLineNumbers) {
  TraceEntry other = SmallEntry(1, 0);
  other.loads = LoadMatrix(1, 4);
  const std::string changed = WriteFile(
      "changed.jsonl", FormatTraceLine(SmallEntry(0, 0)) + "\n" + FormatTraceLine(other) + "\n");
  absl::StatusOr<std::vector<TraceEntry>> a = ReadTrace(changed);
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(std::string(a.status().message()),
              HasSubstr(changed + ":2: ranks/experts are 1/4 but earlier lines have 2/4"));

  const std::string duplicate =
      WriteFile("duplicate.jsonl", FormatTraceLine(SmallEntry(0, 1)) + "\n" +
                                       FormatTraceLine(SmallEntry(0, 0)) + "\n" +
                                       FormatTraceLine(SmallEntry(0, 1)) + "\n");
  absl::StatusOr<std::vector<TraceEntry>> b = ReadTrace(duplicate);
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(duplicate + ":3: microbatch 0 layer 1 appears twice"));
}

TEST(TraceTest, MissingFileIsNotFound) {
  absl::StatusOr<TraceReader> reader = TraceReader::Open("/nonexistent/trace.jsonl");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kNotFound);
}

// Found by tests/fuzz fuzz_trace_line: a number too large for a double threw
// json::out_of_range past the parse_error handler and terminated the process.
TEST(TraceReaderTest, ANumberTooLargeIsABadLineNotACrash) {
  absl::StatusOr<TraceEntry> entry = ParseTraceLine(
      R"({"microbatch": 1e400, "layer": 0, "ranks": 1, "experts": 1, "loads": [[1]]})", "t:4");
  ASSERT_FALSE(entry.ok());
  EXPECT_EQ(entry.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(entry.status().message(), HasSubstr("t:4: bad JSON (number overflow"));
}

// Issue #12: a 100 MB line was read whole (and parsed) before being refused.
TEST(TraceReaderTest, RefusesALineOverTheLimitAfterReadingOnlyTheLimit) {
  const std::string path = ::testing::TempDir() + "/trace_long_line.jsonl";
  TraceEntry entry;
  entry.loads = LoadMatrix(2, 4);
  {
    std::ofstream out(path);
    out << FormatTraceLine(entry) << "\n" << std::string(5000, ' ') << "{}\n";
  }
  absl::StatusOr<TraceReader> reader = TraceReader::Open(path, /*max_line_bytes=*/4096);
  ASSERT_TRUE(reader.ok()) << reader.status();
  absl::StatusOr<std::optional<TraceEntry>> first = reader->Next();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->has_value());
  absl::StatusOr<std::optional<TraceEntry>> second = reader->Next();
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(second.status().message(), HasSubstr(path + ":2: line is longer than 4096 bytes"));
}

TEST(TraceReaderTest, LastLineWithoutNewlineAndCrlfAreRead) {
  const std::string path = ::testing::TempDir() + "/trace_no_newline.jsonl";
  TraceEntry a;
  a.loads = LoadMatrix(1, 2);
  TraceEntry b = a;
  b.microbatch = 1;
  { std::ofstream(path) << FormatTraceLine(a) << "\r\n\n" << FormatTraceLine(b); }
  absl::StatusOr<std::vector<TraceEntry>> read = ReadTrace(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[1], b);
}

TEST(TraceReaderTest, ADirectoryIsNamedAsOne) {
  absl::StatusOr<TraceReader> reader = TraceReader::Open(::testing::TempDir());
  ASSERT_FALSE(reader.ok());
  EXPECT_THAT(reader.status().message(), HasSubstr("is a directory"));
}

}  // namespace

}  // namespace rackrun::planner
