#include "data/indexed_dataset.h"

#include <cstring>
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

// An independent Megatron writer, written from the format's description (docs/design.md
// section 8, megatron/core/datasets/indexed_dataset.py's _IndexWriter) byte by byte,
// sharing no code with ours: documents of `sequences` per document.
struct Le {
  std::string bytes;
  Le& u8(uint8_t v) {
    bytes.push_back(static_cast<char>(v));
    return *this;
  }
  Le& n(uint64_t v, int width) {
    for (int i = 0; i < width; ++i) bytes.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return *this;
  }
};

void WriteMegatron(const std::string& prefix, uint8_t code, int width,
                   const std::vector<std::vector<int64_t>>& sequences,
                   const std::vector<int64_t>& document_index) {
  Le bin, idx;
  for (const auto& s : sequences) {
    for (const int64_t t : s) bin.n(static_cast<uint64_t>(t), width);
  }
  idx.bytes.append("MMIDIDX\0\0", 9);
  idx.n(1, 8).u8(code).n(sequences.size(), 8).n(document_index.size(), 8);
  for (const auto& s : sequences) idx.n(s.size(), 4);
  uint64_t pointer = 0;
  for (const auto& s : sequences) {
    idx.n(pointer, 8);
    pointer += s.size() * static_cast<uint64_t>(width);
  }
  for (const int64_t d : document_index) idx.n(static_cast<uint64_t>(d), 8);
  std::ofstream(prefix + ".bin", std::ios::binary) << bin.bytes;
  std::ofstream(prefix + ".idx", std::ios::binary) << idx.bytes;
}

std::vector<int32_t> ReadAll(const IndexedDataset& d) {
  std::vector<int32_t> out(static_cast<size_t>(d.tokens()));
  d.Read(0, d.tokens(), out.data());
  return out;
}

TEST(IndexedDatasetTest, ReadsWhatAnIndependentWriterWroteInEveryIntegerDtype) {
  const std::string prefix = (TestDir() / "megatron").string();
  // Two documents: the first of two sequences (sentences), the second of one.
  const std::vector<std::vector<int64_t>> seqs = {{5, 6, 7}, {8}, {9, 10, 2}};
  struct Case {
    uint8_t code;
    int width;
  };
  for (const Case c : {Case{8, 2}, Case{4, 4}, Case{1, 1}, Case{3, 2}, Case{5, 8}, Case{2, 1}}) {
    SCOPED_TRACE(static_cast<int>(c.code));
    WriteMegatron(prefix, c.code, c.width, seqs, {0, 2, 3});
    absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix + ".idx");
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->prefix(), prefix);
    EXPECT_EQ(d->dtype_code(), c.code);
    EXPECT_EQ(d->sequences(), 3);
    EXPECT_EQ(d->documents(), 2);
    EXPECT_EQ(d->tokens(), 7);
    EXPECT_THAT(ReadAll(*d), ElementsAre(5, 6, 7, 8, 9, 10, 2));
    EXPECT_EQ(d->sequence_start(2), 4);
    EXPECT_EQ(d->sequence_length(2), 3);
    EXPECT_EQ(d->document_index(1), 2);
    EXPECT_FALSE(d->info().has_value());  // Megatron writes no record
  }
  // Float dtypes hold no token ids.
  WriteMegatron(prefix, 7, 4, seqs, {0, 3});
  absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("dtype float32 holds no token ids"));
}

TEST(IndexedDatasetTest, RefusesBrokenIndexesNamingTheFileAndTheFault) {
  const std::string prefix = (TestDir() / "bad").string();
  const std::vector<std::vector<int64_t>> seqs = {{1, 2}, {3}};
  const auto expect = [&](const std::string& text) {
    absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
    ASSERT_FALSE(d.ok());
    EXPECT_THAT(d.status().message(), HasSubstr(prefix));
    EXPECT_THAT(d.status().message(), HasSubstr(text));
  };
  WriteMegatron(prefix, 8, 2, seqs, {0, 2});
  std::string idx = *base::ReadWholeFile(prefix + ".idx");
  const auto rewrite = [&](const std::string& bytes) {
    std::ofstream(prefix + ".idx", std::ios::binary) << bytes;
  };
  rewrite("MMIDIDX");
  expect("shorter than its 34-byte header");
  rewrite("NOTANIDX" + idx.substr(8));
  expect("wrong magic");
  std::string v2 = idx;
  v2[9] = 2;
  rewrite(v2);
  expect("version 2, expected 1");
  std::string dtype = idx;
  dtype[17] = 9;
  rewrite(dtype);
  expect("unknown dtype code 9");
  rewrite(idx.substr(0, idx.size() - 1));
  expect("truncated");
  std::string pointer = idx;  // second sequence's pointer: byte 34 + 8 + 8
  pointer[34 + 8 + 8] = 6;
  rewrite(pointer);
  expect("sequence 1 starts at byte 6 of the .bin, expected 4");
  std::string docs = idx;  // the last document-index entry must be S
  docs[docs.size() - 8] = 1;
  rewrite(docs);
  expect("document index entry 1 is 1");
  rewrite(idx);
  std::filesystem::resize_file(prefix + ".bin", 4);
  absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("has 4 bytes but its index describes 6"));
  std::filesystem::remove(prefix + ".idx");
  expect("PREFIX.bin + PREFIX.idx");
}

// Our writer's files, parsed here by hand: what Megatron's reader would see.
TEST(IndexedDatasetWriterTest, WritesTheMegatronLayoutAndItsRecord) {
  const std::string prefix = (TestDir() / "ours").string();
  absl::StatusOr<IndexedDatasetWriter> w =
      IndexedDatasetWriter::Create(prefix, kMegatronUint16, 300);
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(w->AddDocument(std::vector<int32_t>{1, 2, 3, 299}).ok());
  ASSERT_TRUE(w->AddDocument(std::vector<int32_t>{7, 299}).ok());
  EXPECT_THAT(w->AddDocument(std::vector<int32_t>{300}).message(),
              HasSubstr("outside the vocabulary"));
  // Nothing under the dataset's names before Finish.
  EXPECT_FALSE(std::filesystem::exists(prefix + ".bin"));
  EXPECT_FALSE(std::filesystem::exists(prefix + ".idx"));
  DatasetInfo info;
  info.tokenizer = TokenizerInfo{.kind = "bytes", .vocab = 300, .eos = 299};
  info.end_of_document = 299;
  ASSERT_TRUE(w->Finish(info).ok());

  const std::string bin = *base::ReadWholeFile(prefix + ".bin");
  EXPECT_EQ(bin, std::string("\x01\x00\x02\x00\x03\x00\x2b\x01\x07\x00\x2b\x01", 12));
  const std::string idx = *base::ReadWholeFile(prefix + ".idx");
  Le expected;
  expected.bytes.append("MMIDIDX\0\0", 9);
  expected.n(1, 8).u8(8).n(2, 8).n(3, 8);  // version, uint16, S = 2, D = 3
  expected.n(4, 4).n(2, 4);                // lengths
  expected.n(0, 8).n(8, 8);                // byte offsets
  expected.n(0, 8).n(1, 8).n(2, 8);        // document index
  EXPECT_EQ(idx, expected.bytes);
  absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->info().has_value());
  EXPECT_EQ(d->info()->documents, 2);
  EXPECT_EQ(d->info()->tokens, 6);
  EXPECT_EQ(d->info()->end_of_document, 299);
  EXPECT_EQ(d->info()->tokenizer.kind, "bytes");
  EXPECT_GT(d->info()->unigram_entropy, 0);
  // No temporaries are left.
  int files = 0;
  for (const auto& e :
       std::filesystem::directory_iterator(std::filesystem::path(prefix).parent_path())) {
    EXPECT_THAT(e.path().string(), ::testing::Not(HasSubstr(".tmp-")));
    ++files;
  }
  EXPECT_EQ(files, 3);
}

TEST(IndexedDatasetWriterTest, AnAbandonedWriterLeavesNothingAndAnOldDatasetStaysWhole) {
  const std::filesystem::path dir = TestDir();
  const std::string prefix = (dir / "d").string();
  {
    absl::StatusOr<IndexedDatasetWriter> w =
        IndexedDatasetWriter::Create(prefix, kMegatronInt32, 70000);
    ASSERT_TRUE(w->AddDocument(std::vector<int32_t>{69999, 5}).ok());
  }  // destroyed without Finish (an error, a crash of the pipeline)
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  // A finished dataset, then an abandoned rewrite: the old one is still there and whole.
  {
    absl::StatusOr<IndexedDatasetWriter> w =
        IndexedDatasetWriter::Create(prefix, kMegatronInt32, 70000);
    ASSERT_TRUE(w->AddDocument(std::vector<int32_t>{69999, 5}).ok());
    ASSERT_TRUE(w->Finish({.tokenizer = {.kind = "unknown", .vocab = 70000}}).ok());
  }
  {
    absl::StatusOr<IndexedDatasetWriter> w =
        IndexedDatasetWriter::Create(prefix, kMegatronInt32, 70000);
    ASSERT_TRUE(w->AddDocument(std::vector<int32_t>{1, 2, 3}).ok());
  }
  absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->dtype_code(), kMegatronInt32);
  EXPECT_THAT(ReadAll(*d), ElementsAre(69999, 5));
}

TEST(IndexedDatasetTest, ARecordOfOtherDataIsRefused) {
  const std::string prefix = (TestDir() / "r").string();
  absl::StatusOr<IndexedDatasetWriter> w =
      IndexedDatasetWriter::Create(prefix, kMegatronUint16, 10);
  ASSERT_TRUE(w->AddDocument(std::vector<int32_t>{1, 2}).ok());
  ASSERT_TRUE(w->Finish({.tokenizer = {.kind = "unknown", .vocab = 10}}).ok());
  WriteMegatron(prefix, 8, 2, {{1, 2, 3}}, {0, 1});  // Megatron rewrote the data
  absl::StatusOr<IndexedDataset> d = IndexedDataset::Open(prefix);
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("it belongs to other data"));
  EXPECT_THAT(d.status().message(), HasSubstr(DatasetInfoPath(prefix)));
}

TEST(MegatronDTypeTest, FollowsMegatronsOptimalDtype) {
  EXPECT_EQ(MegatronDTypeForVocab(257), kMegatronUint16);
  EXPECT_EQ(MegatronDTypeForVocab(65499), kMegatronUint16);
  EXPECT_EQ(MegatronDTypeForVocab(65500), kMegatronInt32);
  EXPECT_EQ(MegatronDTypeBytes(8), 2u);
  EXPECT_EQ(MegatronDTypeBytes(5), 8u);
  EXPECT_EQ(MegatronDTypeBytes(0), 0u);
  EXPECT_EQ(DatasetPrefix("a/b.bin"), "a/b");
  EXPECT_EQ(DatasetPrefix("a/b.idx"), "a/b");
  EXPECT_EQ(DatasetPrefix("a/b"), "a/b");
}

}  // namespace
}  // namespace rackrun::data
