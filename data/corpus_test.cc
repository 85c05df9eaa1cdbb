#include "data/corpus.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/utf8.h"
#include "data/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::data {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TestDir;

std::string Write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

absl::StatusOr<std::vector<std::string>> ReadAll(const std::string& input,
                                                 CorpusOptions options = {}) {
  absl::StatusOr<DocumentReader> r = DocumentReader::Open(input, options);
  if (!r.ok()) return r.status();
  std::vector<std::string> docs;
  Document d;
  while (true) {
    absl::StatusOr<bool> got = r->Next(d);
    if (!got.ok()) return got.status();
    if (!*got) break;
    docs.push_back(d.text);
  }
  return docs;
}

TEST(DocumentReaderTest, TextFilesSplitAtFormFeedLinesAndFoldersInNameOrder) {
  const std::filesystem::path dir = TestDir();
  std::filesystem::create_directories(dir / "folder");
  Write(dir / "folder" / "b.txt", "one\ntwo\n\f\nthree\n\f\n\f\n");
  Write(dir / "folder" / "a.txt", "first, no newline");
  EXPECT_THAT(*ReadAll((dir / "folder" / "b.txt").string()), ElementsAre("one\ntwo\n", "three\n"));
  EXPECT_THAT(*ReadAll((dir / "folder").string()),
              ElementsAre("first, no newline", "one\ntwo\n", "three\n"));
  absl::StatusOr<std::vector<std::string>> missing = ReadAll((dir / "nope.txt").string());
  EXPECT_THAT(missing.status().message(), HasSubstr("nope.txt' does not exist"));
}

TEST(DocumentReaderTest, JsonLinesTakeTheKeyAndSkipBlankLines) {
  const std::filesystem::path dir = TestDir();
  const std::string path = Write(dir / "c.jsonl",
                                 "{\"text\": \"hello\", \"id\": 1}\n\n"
                                 "{\"text\": \"caf\\u00e9\\nnext\", \"body\": \"b\"}\r\n"
                                 "{\"text\": \"\"}\n");
  EXPECT_THAT(*ReadAll(path), ElementsAre("hello", "caf\xc3\xa9\nnext"));
  absl::StatusOr<std::vector<std::string>> body = ReadAll(path, {.json_key = "body"});
  ASSERT_FALSE(body.ok());  // line 1 has no "body"
  EXPECT_THAT(body.status().message(),
              HasSubstr(path + ":1: no key \"body\" (the object has \"id\", \"text\")"));
}

// Each bad input names the file and the line, and says what to do.
TEST(DocumentReaderTest, BadJsonLinesNameTheFileAndLine) {
  const std::filesystem::path dir = TestDir();
  struct Case {
    std::string text;
    std::string expected;
  };
  const Case cases[] = {
      {"{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n", ":2: malformed JSON"},
      {"{\"text\": \"ok\"}\n\n[1, 2]\n", ":3: a JSON array, not an object"},
      {"{\"text\": 42}\n", ":1: \"text\" is a number, not a string"},
      {"{\"content\": \"x\"}\n",
       ":1: no key \"text\" (the object has \"content\"); choose the key with --json-key"},
  };
  for (const Case& c : cases) {
    const std::string path = Write(dir / "bad.jsonl", c.text);
    absl::StatusOr<std::vector<std::string>> docs = ReadAll(path);
    ASSERT_FALSE(docs.ok()) << c.text;
    EXPECT_THAT(docs.status().message(), HasSubstr(path + c.expected));
  }
}

TEST(DocumentReaderTest, InvalidUtf8FollowsThePolicy) {
  const std::filesystem::path dir = TestDir();
  const std::string text = Write(dir / "t.txt", "good\n\f\nline one\nbad \xff byte\n\f\nlast\n");
  absl::StatusOr<std::vector<std::string>> docs = ReadAll(text);
  ASSERT_FALSE(docs.ok());
  EXPECT_THAT(docs.status().message(),
              HasSubstr(text + ":4: invalid UTF-8 (byte 0xff at byte 5 of the line)"));
  EXPECT_THAT(docs.status().message(), HasSubstr("--invalid-utf8 replace"));
  EXPECT_THAT(*ReadAll(text, {.invalid_utf8 = InvalidUtf8::kReplace}),
              ElementsAre("good\n", "line one\nbad \xef\xbf\xbd byte\n", "last\n"));
  absl::StatusOr<DocumentReader> r =
      DocumentReader::Open(text, {.invalid_utf8 = InvalidUtf8::kSkip});
  Document d;
  std::vector<std::string> kept;
  while (*r->Next(d)) kept.push_back(d.text);
  EXPECT_THAT(kept, ElementsAre("good\n", "last\n"));
  EXPECT_EQ(r->skipped_documents(), 1);

  const std::string json = Write(dir / "u.jsonl", "{\"text\": \"a\"}\n{\"text\": \"\xc3\x28\"}\n");
  docs = ReadAll(json);
  ASSERT_FALSE(docs.ok());
  EXPECT_THAT(docs.status().message(), HasSubstr(json + ":2: invalid UTF-8 (byte 0xc3"));
  EXPECT_THAT(*ReadAll(json, {.invalid_utf8 = InvalidUtf8::kSkip}), ElementsAre("a"));
}

TEST(Utf8Test, FindsEveryKindOfBadSequence) {
  EXPECT_EQ(base::FirstInvalidUtf8("plain ascii"), std::string_view::npos);
  EXPECT_EQ(base::FirstInvalidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            std::string_view::npos);
  EXPECT_EQ(base::FirstInvalidUtf8("ab\xc0\xaf"), 2u);         // overlong
  EXPECT_EQ(base::FirstInvalidUtf8("\xed\xa0\x80"), 0u);       // surrogate
  EXPECT_EQ(base::FirstInvalidUtf8("x\xf4\x90\x80\x80"), 1u);  // above U+10FFFF
  EXPECT_EQ(base::FirstInvalidUtf8("xy\xe2\x82"), 2u);         // truncated
  EXPECT_EQ(base::ReplaceInvalidUtf8("a\xffz"), "a\xef\xbf\xbdz");
  EXPECT_TRUE(ParseInvalidUtf8("skip").ok());
  EXPECT_THAT(ParseInvalidUtf8("ignore").status().message(),
              HasSubstr("use error, replace or skip"));
}

}  // namespace
}  // namespace rackrun::data
