#include "runtime/data.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "base/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::runtime {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "data_test";
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

TEST(TokenFileTest, RoundTripsUint16AndUint32) {
  for (const uint32_t vocab : {257u, 70000u}) {
    TokenFile file{.vocab = vocab, .end_of_document = 256, .tokens = {256, 0, 255, 1, 256, 7}};
    if (vocab > 65536) file.tokens.push_back(69999);
    const std::string path = TempPath("round_trip.tokens");
    ASSERT_TRUE(WriteTokenFile(path, file).ok());
    EXPECT_EQ(std::filesystem::file_size(path), 32 + file.tokens.size() * (vocab > 65536 ? 4 : 2));
    absl::StatusOr<TokenFile> read = ReadTokenFile(path);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->vocab, vocab);
    EXPECT_EQ(read->end_of_document, 256);
    EXPECT_EQ(read->tokens, file.tokens);
  }
}

TEST(TokenFileTest, HeaderIsLittleEndianAsDocumented) {
  const std::string path = TempPath("header.tokens");
  ASSERT_TRUE(
      WriteTokenFile(path, {.vocab = 257, .end_of_document = 256, .tokens = {258 - 2, 65}}).ok());
  std::ifstream in(path, std::ios::binary);
  std::vector<unsigned char> b(36);
  in.read(reinterpret_cast<char*>(b.data()), 36);
  EXPECT_EQ(std::string(b.begin(), b.begin() + 8), "RKRTOKNS");
  EXPECT_THAT(std::vector<unsigned char>(b.begin() + 8, b.begin() + 36),
              ElementsAre(1, 0, 0, 0,              // version
                          2, 0, 0, 0,              // dtype: uint16
                          2, 0, 0, 0, 0, 0, 0, 0,  // count
                          1, 1, 0, 0,              // vocab 257
                          0, 1, 0, 0,              // end of document 256
                          0, 1, 65, 0));           // tokens 256, 65
}

TEST(TokenFileTest, RefusesTruncatedAndForeignFiles) {
  const std::string path = TempPath("bad.tokens");
  ASSERT_TRUE(
      WriteTokenFile(path, {.vocab = 257, .end_of_document = 256, .tokens = {1, 2, 3}}).ok());
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  absl::StatusOr<TokenFile> read = ReadTokenFile(path);
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(read.status().message(), HasSubstr("truncated"));
  EXPECT_THAT(read.status().message(), HasSubstr(path));

  std::ofstream(path) << "hello, not a token file at all, sorry";
  read = ReadTokenFile(path);
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(read.status().message(), HasSubstr("wrong magic"));

  read = ReadTokenFile(TempPath("missing.tokens"));
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(read.status().message(), HasSubstr("rackrun data"));
}

// Issue #12: a header claiming a vocabulary of 4 billion once aborted training with
// std::length_error (the unigram counts are vocab-sized); now the reader refuses it.
TEST(TokenFileTest, RefusesAVocabularyAboveTheLimit) {
  const std::string path = TempPath("huge-vocab.tokens");
  ASSERT_TRUE(WriteTokenFile(path, {.vocab = 257, .end_of_document = -1, .tokens = {1, 2}}).ok());
  std::string bytes = *base::ReadWholeFile(path);
  for (int i = 0; i < 4; ++i) bytes[24 + i] = static_cast<char>(0xff);  // vocab 4294967295
  absl::StatusOr<TokenFile> read = ParseTokenFile(bytes, path);
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(read.status().message(), HasSubstr("vocab 4294967295 is above the limit"));
  EXPECT_THAT(read.status().message(), HasSubstr(path));
  EXPECT_FALSE(WriteTokenFile(path, {.vocab = kMaxTokenVocab + 1, .tokens = {1}}).ok());
}

TEST(TokenFileTest, RefusesTokensOutsideTheVocabulary) {
  EXPECT_FALSE(WriteTokenFile(TempPath("v.tokens"), {.vocab = 10, .tokens = {3, 10}}).ok());
}

TEST(ByteTokenizerTest, MarksEveryDocumentAndRoundTrips) {
  const std::vector<std::string> docs = {"ab", "\xc3\xa9"};  // "é" is two bytes
  const std::vector<int32_t> tokens = ByteTokenize(docs);
  EXPECT_THAT(tokens, ElementsAre(256, 97, 98, 256, 0xc3, 0xa9));
  EXPECT_EQ(ByteDetokenize(tokens), "\n<|eod|>\nab\n<|eod|>\n\xc3\xa9");
}

TEST(SplitDocumentsTest, SplitsAtFormFeedLines) {
  EXPECT_THAT(SplitDocuments("one\ntwo\n\f\nthree\n\f\n\f\n"),
              ElementsAre("one\ntwo\n", "three\n"));
  EXPECT_THAT(SplitDocuments("no marks"), ElementsAre("no marks"));
}

TEST(SplitTrainValidationTest, EveryNthDocumentGoesToValidation) {
  std::vector<std::string> docs;
  for (int i = 0; i < 20; ++i) docs.push_back("doc" + std::to_string(i));
  absl::StatusOr<DocumentSplit> split = SplitTrainValidation(docs, 0.1);
  ASSERT_TRUE(split.ok());
  EXPECT_THAT(split->validation, ElementsAre("doc9", "doc19"));
  EXPECT_EQ(split->train.size(), 18u);
}

TEST(SplitTrainValidationTest, SingleDocumentIsCutAtALineNearTheEnd) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "line " + std::to_string(i) + "\n";
  absl::StatusOr<DocumentSplit> split = SplitTrainValidation({text}, 0.1);
  ASSERT_TRUE(split.ok());
  ASSERT_EQ(split->validation.size(), 1u);
  EXPECT_EQ(split->train[0] + split->validation[0], text);
  EXPECT_EQ(split->validation[0].rfind("line ", 0), 0u);  // starts at a line
  EXPECT_NEAR(static_cast<double>(split->validation[0].size()), 0.1 * text.size(), 10);
  EXPECT_FALSE(SplitTrainValidation({text}, 0.7).ok());
}

TEST(UnigramEntropyTest, MatchesHandComputation) {
  // p = {1/2, 1/4, 1/4}: H = 1.5 bits.
  EXPECT_NEAR(UnigramEntropy(std::vector<int32_t>{0, 0, 1, 2}, 4), 1.5 * std::log(2.0), 1e-12);
  EXPECT_EQ(UnigramEntropy(std::vector<int32_t>{5, 5, 5}, 8), 0.0);
}

std::vector<int32_t> Ramp(int n) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = i % 250;
  return t;
}

TEST(WindowLoaderTest, TargetsAreInputsShiftedByOne) {
  absl::StatusOr<WindowLoader> loader = WindowLoader::Create(Ramp(1000), -1, 16, 3, 7, true);
  ASSERT_TRUE(loader.ok());
  Batch b;
  loader->Next(b);
  ASSERT_EQ(b.inputs.size(), 48u);
  for (size_t i = 0; i < 48; ++i) EXPECT_EQ(b.targets[i], (b.inputs[i] + 1) % 250);
  EXPECT_THAT(b.segment_starts, ElementsAre(0, 16, 32));
}

TEST(WindowLoaderTest, SameSeedSameBatchesDifferentSeedDifferentOrder) {
  auto run = [](uint64_t seed) {
    WindowLoader loader = *WindowLoader::Create(Ramp(5000), -1, 32, 4, seed, true);
    std::vector<int32_t> all;
    Batch b;
    for (int i = 0; i < 100; ++i) {  // crosses several epochs (155 windows each)
      loader.Next(b);
      all.insert(all.end(), b.inputs.begin(), b.inputs.end());
    }
    return all;
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

TEST(WindowLoaderTest, EachEpochServesEveryWindowOnce) {
  WindowLoader loader = *WindowLoader::Create(Ramp(3301), -1, 10, 1, 3, true);
  const int64_t windows = loader.windows_per_epoch();
  std::set<int32_t> firsts;
  Batch b;
  for (int64_t i = 0; i < windows; ++i) {
    loader.Next(b);
    firsts.insert(b.inputs[0] + 1000 * b.inputs[1]);
  }
  EXPECT_EQ(loader.position().epoch, 0u);
  EXPECT_GE(windows, 329);
  loader.Next(b);
  EXPECT_EQ(loader.position().epoch, 1u);
}

TEST(WindowLoaderTest, RestoredPositionContinuesIdentically) {
  WindowLoader a = *WindowLoader::Create(Ramp(4000), -1, 32, 4, 11, true);
  Batch b;
  for (int i = 0; i < 40; ++i) a.Next(b);  // into the second epoch
  const LoaderPosition saved = a.position();
  std::vector<int32_t> expected;
  for (int i = 0; i < 50; ++i) {
    a.Next(b);
    expected.insert(expected.end(), b.inputs.begin(), b.inputs.end());
  }
  WindowLoader c = *WindowLoader::Create(Ramp(4000), -1, 32, 4, 999, true);
  ASSERT_TRUE(c.Restore(saved).ok());
  std::vector<int32_t> got;
  for (int i = 0; i < 50; ++i) {
    c.Next(b);
    got.insert(got.end(), b.inputs.begin(), b.inputs.end());
  }
  EXPECT_EQ(got, expected);
  LoaderPosition broken = saved;
  broken.cursor = 1 << 30;
  EXPECT_FALSE(c.Restore(broken).ok());
}

TEST(WindowLoaderTest, DocumentMarksStartSegments) {
  // Documents of 5 tokens, each led by the mark 256.
  std::vector<int32_t> tokens;
  for (int d = 0; d < 40; ++d) {
    tokens.push_back(256);
    for (int i = 0; i < 4; ++i) tokens.push_back(d);
  }
  WindowLoader loader = *WindowLoader::Create(tokens, 256, 8, 2, 0, false);
  Batch b;
  loader.Next(b);
  // Row 0 = tokens[0..8): marks at 0 and 5; row 1 = tokens[8..16): marks at 10 and 15,
  // flattened indices 8 + 2 and 8 + 7 (the row start 8 is a start too).
  EXPECT_THAT(b.segment_starts, ElementsAre(0, 5, 8, 10, 15));
}

TEST(WindowLoaderTest, RefusesStreamsShorterThanTwoWindows) {
  absl::StatusOr<WindowLoader> loader = WindowLoader::Create(Ramp(20), -1, 16, 1, 0, true);
  ASSERT_FALSE(loader.ok());
  EXPECT_THAT(loader.status().message(), HasSubstr("model.seq_len"));
}

}  // namespace
}  // namespace rackrun::runtime
