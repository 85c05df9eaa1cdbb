#include "data/prepare.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "data/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::data {
namespace {

using testing::BrownSample;
using ::testing::HasSubstr;
using testing::TestDir;

// The documents of a dataset, decoded: each sequence without its trailing EOS.
std::vector<std::string> Documents(const std::string& prefix, const Tokenizer& t) {
  absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
  EXPECT_TRUE(d.ok()) << d.status();
  std::vector<std::string> docs;
  for (int64_t i = 0; d.ok() && i < d->sequences(); ++i) {
    std::vector<int32_t> ids(static_cast<size_t>(d->sequence_length(i)));
    d->Read(d->sequence_start(i), d->sequence_length(i), ids.data());
    EXPECT_EQ(ids.back(), t.eos_id());
    ids.pop_back();
    docs.push_back(*t.Decode(ids));
  }
  return docs;
}

// The Brown sample's documents, split as the format says (lines of a single form feed).
std::vector<std::string> BrownDocuments() {
  std::vector<std::string> docs(1);
  std::ifstream in(BrownSample());
  std::string line;
  while (std::getline(in, line)) {
    if (line == "\f") {
      docs.emplace_back();
    } else {
      docs.back() += line + "\n";
    }
  }
  return docs;
}

TEST(PrepareTest, TextToDatasetRoundTripsWithTheValidationSplit) {
  const std::filesystem::path dir = TestDir();
  const std::unique_ptr<Tokenizer> bytes = *OpenTokenizer("bytes");
  int calls = 0;
  PrepareOptions options{.tokenizer = bytes.get(),
                         .val_fraction = 0.1,
                         .threads = 3,
                         .on_progress = [&](const PrepareProgress&) { ++calls; }};
  absl::StatusOr<PrepareResult> r = PrepareDataset(BrownSample(), (dir / "brown").string(),
                                                   (dir / "brown-val").string(), options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GE(calls, 1);
  const std::vector<std::string> all = BrownDocuments();
  ASSERT_EQ(all.size(), 25u);
  // Every 10th document (the 10th, the 20th) goes to validation, in order.
  std::vector<std::string> train, val;
  for (size_t i = 0; i < all.size(); ++i) (i % 10 == 9 ? val : train).push_back(all[i]);
  EXPECT_EQ(Documents((dir / "brown").string(), *bytes), train);
  EXPECT_EQ(Documents((dir / "brown-val").string(), *bytes), val);
  EXPECT_EQ(r->train.info.documents, 23);
  EXPECT_EQ(r->validation->info.documents, 2);
  EXPECT_EQ(r->train.info.tokenizer.kind, "bytes");
  EXPECT_EQ(r->train.info.end_of_document, 256);
  EXPECT_EQ(r->bytes, static_cast<int64_t>(std::filesystem::file_size(BrownSample())));
  EXPECT_GT(r->train.info.unigram_entropy, 2.5);  // English text, in nats per byte
  EXPECT_LT(r->train.info.unigram_entropy, 3.5);
}

TEST(PrepareTest, OneThreadAndManyWriteTheSameBytes) {
  const std::filesystem::path dir = TestDir();
  const std::unique_ptr<Tokenizer> bytes = *OpenTokenizer("bytes");
  for (const int threads : {1, 4}) {
    const std::string p = (dir / absl::StrCat("t", threads)).string();
    ASSERT_TRUE(PrepareDataset(BrownSample(), p, p + "-val",
                               {.tokenizer = bytes.get(), .val_fraction = 0.05, .threads = threads})
                    .ok());
  }
  for (const char* ext : {".bin", ".idx", "-val.bin", "-val.idx"}) {
    EXPECT_EQ(*base::ReadWholeFile((dir / absl::StrCat("t1", ext)).string()),
              *base::ReadWholeFile((dir / absl::StrCat("t4", ext)).string()))
        << ext;
  }
}

TEST(PrepareTest, ASingleDocumentGivesValidationItsTail) {
  const std::filesystem::path dir = TestDir();
  std::string text;
  for (int i = 0; i < 100; ++i) text += "line " + std::to_string(i) + "\n";
  std::ofstream(dir / "one.txt") << text;
  const std::unique_ptr<Tokenizer> bytes = *OpenTokenizer("bytes");
  ASSERT_TRUE(PrepareDataset((dir / "one.txt").string(), (dir / "one").string(),
                             (dir / "one-val").string(),
                             {.tokenizer = bytes.get(), .val_fraction = 0.1})
                  .ok());
  const std::vector<std::string> train = Documents((dir / "one").string(), *bytes);
  const std::vector<std::string> val = Documents((dir / "one-val").string(), *bytes);
  ASSERT_EQ(train.size(), 1u);
  ASSERT_EQ(val.size(), 1u);
  EXPECT_EQ(train[0] + val[0], text);
  EXPECT_EQ(val[0].rfind("line ", 0), 0u);  // starts at a line
  EXPECT_NEAR(static_cast<double>(val[0].size()), 0.1 * static_cast<double>(text.size()), 10);
}

// A bad line far into the input stops the run and leaves no dataset under the output names.
TEST(PrepareTest, BadInputNamesTheLineAndLeavesNoDataset) {
  const std::filesystem::path dir = TestDir();
  {
    std::ofstream out(dir / "in.jsonl");
    for (int i = 0; i < 5000; ++i) out << "{\"text\": \"document number " << i << "\"}\n";
    out << "{\"text\": \"broken\n";
  }
  std::filesystem::create_directories(dir / "out");
  const std::unique_ptr<Tokenizer> bytes = *OpenTokenizer("bytes");
  absl::StatusOr<PrepareResult> r = PrepareDataset(
      (dir / "in.jsonl").string(), (dir / "out" / "in").string(), (dir / "out" / "in-val").string(),
      {.tokenizer = bytes.get(), .val_fraction = 0.1});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("in.jsonl:5001: malformed JSON"));
  EXPECT_TRUE(std::filesystem::is_empty(dir / "out"));
}

TEST(PrepareTest, EmptyInputsAndSplitsAreRefused) {
  const std::filesystem::path dir = TestDir();
  std::ofstream(dir / "empty.txt") << "\f\n\f\n";
  const std::unique_ptr<Tokenizer> bytes = *OpenTokenizer("bytes");
  absl::StatusOr<PrepareResult> r =
      PrepareDataset((dir / "empty.txt").string(), (dir / "e").string(), (dir / "e-val").string(),
                     {.tokenizer = bytes.get()});
  EXPECT_THAT(r.status().message(), HasSubstr("holds no text"));
  EXPECT_FALSE(std::filesystem::exists(dir / "e.idx"));
  r = PrepareDataset(BrownSample(), (dir / "x").string(), "",
                     {.tokenizer = bytes.get(), .val_fraction = 0.7});
  EXPECT_THAT(r.status().message(), HasSubstr("--val-fraction: 0.7 must lie in [0, 0.5]"));
}

}  // namespace
}  // namespace rackrun::data
