#include "data/token_file.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/file.h"
#include "data/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::data {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TestDir;

TEST(TokenFileTest, RoundTripsUint16AndUint32) {
  const std::string path = (TestDir() / "round_trip.tokens").string();
  for (const uint32_t vocab : {257u, 70000u}) {
    TokenFile file{.vocab = vocab, .end_of_document = 256, .tokens = {256, 0, 255, 1, 256, 7}};
    if (vocab > 65536) file.tokens.push_back(69999);
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
  const std::string path = (TestDir() / "header.tokens").string();
  ASSERT_TRUE(
      WriteTokenFile(path, {.vocab = 257, .end_of_document = 256, .tokens = {256, 65}}).ok());
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
  const std::string path = (TestDir() / "bad.tokens").string();
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

  read = ReadTokenFile(path + ".missing");
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(read.status().message(), HasSubstr("rackrun data"));
}

// Issue #12: a header claiming a vocabulary of 4 billion once aborted training with
// std::length_error (the unigram counts are vocab-sized); now the reader refuses it.
TEST(TokenFileTest, RefusesAVocabularyAboveTheLimit) {
  const std::string path = (TestDir() / "huge-vocab.tokens").string();
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
  EXPECT_FALSE(
      WriteTokenFile((TestDir() / "v.tokens").string(), {.vocab = 10, .tokens = {3, 10}}).ok());
}

TEST(ByteTokenizeTest, PutsTheMarkBeforeEveryDocument) {
  const std::vector<std::string> docs = {"ab", "\xc3\xa9"};  // "é" is two bytes
  EXPECT_THAT(ByteTokenize(docs), ElementsAre(256, 97, 98, 256, 0xc3, 0xa9));
}

}  // namespace
}  // namespace rackrun::data
