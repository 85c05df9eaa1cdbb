#include "data/tokenizer.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "base/crc32c.h"
#include "base/file.h"
#include "data/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::data {
namespace {

using testing::BrownSample;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TestDir;

// The Brown sample's non-empty lines, one sentence each, as the trainer takes them.
std::function<bool(std::string*)> BrownLines() {
  auto lines = std::make_shared<std::vector<std::string>>();
  for (absl::string_view l : absl::StrSplit(*base::ReadWholeFile(BrownSample()), '\n')) {
    if (!l.empty() && l != "\f") lines->emplace_back(l);
  }
  auto next = std::make_shared<size_t>(0);
  return [lines, next](std::string* out) {
    if (*next >= lines->size()) return false;
    *out = (*lines)[(*next)++];
    return true;
  };
}

TEST(ByteTokenizerTest, IdsAreTheBytesAndDecodeInvertsEncode) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = OpenTokenizer("bytes");
  ASSERT_TRUE(t.ok());
  std::vector<int32_t> ids;
  ASSERT_TRUE((*t)->Encode("a\xc3\xa9", ids).ok());
  EXPECT_THAT(ids, ElementsAre(97, 0xc3, 0xa9));
  ids.push_back(kByteEndOfDocument);  // control ids decode to nothing
  EXPECT_EQ(*(*t)->Decode(ids), "a\xc3\xa9");
  EXPECT_EQ((*t)->vocab_size(), 257);
  EXPECT_EQ((*t)->eos_id(), 256);
  EXPECT_EQ((*t)->bos_id(), 256);
  EXPECT_EQ((*t)->pad_id(), -1);
  EXPECT_EQ((*t)->info().Describe(), "bytes (vocab 257)");
}

std::string TrainModel(const std::filesystem::path& dir, const std::string& type, int vocab) {
  const std::string path = (dir / (type + ".model")).string();
  SentencePieceTraining options{
      .output = path, .vocab_size = vocab, .model_type = type, .threads = 2};
  const absl::Status s = TrainSentencePiece(options, BrownLines());
  EXPECT_TRUE(s.ok()) << s;
  return path;
}

// The spm_encode CLI (Debian's sentencepiece package) on the same model and text: ids
// from the library's own tool, not through our wrapper.
std::vector<int32_t> SpmEncode(const std::string& model, const std::string& text_file) {
  const std::string out = text_file + ".ids";
  const std::string command = "spm_encode --model=" + model + " --output_format=id < " + text_file +
                              " > " + out + " 2>/dev/null";
  if (std::system(command.c_str()) != 0) return {};
  std::vector<int32_t> ids;
  std::ifstream in(out);
  int32_t id;
  while (in >> id) ids.push_back(id);
  return ids;
}

TEST(SentencePieceTest, BpeAndUnigramModelsTrainLoadAndMatchSpmEncode) {
  const std::filesystem::path dir = TestDir();
  const std::string sentence =
      "The jury said it did find that many of Georgia's laws are outmoded.";
  std::ofstream(dir / "sentence.txt") << sentence << "\n";
  for (const std::string type : {"bpe", "unigram"}) {
    SCOPED_TRACE(type);
    const std::string model = TrainModel(dir, type, 600);
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = OpenTokenizer(model);
    ASSERT_TRUE(t.ok()) << t.status();
    const TokenizerInfo& info = (*t)->info();
    EXPECT_EQ(info.kind, "sentencepiece");
    EXPECT_EQ(info.model_type, type);
    EXPECT_EQ(info.vocab, 600);
    EXPECT_EQ((*t)->bos_id(), 1);
    EXPECT_EQ((*t)->eos_id(), 2);
    EXPECT_EQ((*t)->pad_id(), -1);
    EXPECT_EQ(info.model_crc32c, base::Crc32c(*base::ReadWholeFile(model)));
    std::vector<int32_t> ids;
    ASSERT_TRUE((*t)->Encode(sentence, ids).ok());
    EXPECT_LT(ids.size(), sentence.size() / 2) << "a trained model merges characters";
    for (const int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 600);
    EXPECT_EQ(*(*t)->Decode(ids), sentence);
    if (std::system("command -v spm_encode >/dev/null 2>&1") == 0) {
      EXPECT_EQ(ids, SpmEncode(model, (dir / "sentence.txt").string()));
    }
    // The record survives JSON, and names the tokenizer.
    absl::StatusOr<TokenizerInfo> back = TokenizerInfo::FromJson(info.ToJson(), "test");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(back->SameTokenizer(info));
    EXPECT_THAT(info.Describe(), HasSubstr("sentencepiece " + type + ", vocab 600"));
  }
  // Same corpus and options: the same model bytes (a deterministic trainer).
  const std::string again = (dir / "again").string();
  std::filesystem::create_directories(again);
  EXPECT_EQ(*base::ReadWholeFile(TrainModel(again, "bpe", 600)),
            *base::ReadWholeFile((dir / "bpe.model").string()));
}

TEST(SentencePieceTest, DifferentModelsAreDifferentTokenizers) {
  const std::filesystem::path dir = TestDir();
  const TokenizerInfo a = (*OpenTokenizer(TrainModel(dir, "bpe", 600)))->info();
  const TokenizerInfo b = (*OpenTokenizer(TrainModel(dir, "unigram", 600)))->info();
  EXPECT_FALSE(a.SameTokenizer(b));
  EXPECT_FALSE(a.SameTokenizer((*OpenTokenizer("bytes"))->info()));
}

TEST(SentencePieceTest, BadModelsAndOptionsAreNamed) {
  const std::filesystem::path dir = TestDir();
  const std::string not_model = (dir / "not.model").string();
  std::ofstream(not_model) << "this is not a protobuf";
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = OpenTokenizer(not_model);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr(not_model));
  EXPECT_THAT(t.status().message(), HasSubstr("not a SentencePiece model"));
  t = OpenTokenizer((dir / "missing.model").string());
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("missing.model"));

  absl::Status s = TrainSentencePiece(
      {.output = (dir / "m.model").string(), .model_type = "wordpiece"}, BrownLines());
  EXPECT_THAT(s.message(), HasSubstr("--model-type"));
  // A vocabulary larger than the corpus supports: the library's reason, and what to do.
  s = TrainSentencePiece(
      {.output = (dir / "m.model").string(), .vocab_size = 200000, .model_type = "bpe"},
      BrownLines());
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("lower --vocab"));
  EXPECT_FALSE(std::filesystem::exists(dir / "m.model"));
}

}  // namespace
}  // namespace rackrun::data
