#include "data/loader.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "data/indexed_dataset.h"
#include "data/test_util.h"
#include "data/token_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::data {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TestDir;

// A dataset whose token at position p is `base + p % modulus` (so a window's position can
// be read off its tokens), in documents of `doc` tokens each ended by `eod`.
std::string MakeDataset(const std::filesystem::path& dir, const std::string& name, int64_t tokens,
                        int32_t base, int32_t modulus, int32_t vocab, int32_t eod = -1,
                        int64_t doc = 1000) {
  const std::string prefix = (dir / name).string();
  absl::StatusOr<IndexedDatasetWriter> w =
      IndexedDatasetWriter::Create(prefix, MegatronDTypeForVocab(vocab), vocab);
  EXPECT_TRUE(w.ok()) << w.status();
  std::vector<int32_t> ids;
  for (int64_t p = 0; p < tokens; ++p) {
    ids.push_back(eod >= 0 && ids.size() + 1 == static_cast<size_t>(doc)
                      ? eod
                      : base + static_cast<int32_t>(p % modulus));
    if (static_cast<int64_t>(ids.size()) == doc || p + 1 == tokens) {
      EXPECT_TRUE(w->AddDocument(ids).ok());
      ids.clear();
    }
  }
  DatasetInfo info;
  info.tokenizer = TokenizerInfo{.kind = "bytes", .vocab = vocab, .eos = eod};
  info.end_of_document = eod;
  EXPECT_TRUE(w->Finish(info).ok());
  return prefix;
}

LoaderOptions Options(int seq, int batch, uint64_t seed = 7, bool shuffle = true) {
  return {.seq_len = seq,
          .batch = batch,
          .seed = seed,
          .shuffle = shuffle,
          .vocab = 0,
          .field = "data.train"};
}

TEST(LoaderTest, SamplesAreWindowsOfTheStreamWithTargetsShiftedByOne) {
  const std::string d = MakeDataset(TestDir(), "ramp", 5000, 0, 250, 257);
  absl::StatusOr<std::unique_ptr<Loader>> l = Loader::Create({{1, d}}, Options(16, 3));
  ASSERT_TRUE(l.ok()) << l.status();
  Batch b;
  ASSERT_TRUE((*l)->Next(b).ok());
  ASSERT_EQ(b.inputs.size(), 48u);
  for (size_t i = 0; i < 48; ++i) {
    EXPECT_EQ(b.targets[i], (b.inputs[i] + 1) % 250);
    if (i % 16 != 0) {
      EXPECT_EQ(b.inputs[i], (b.inputs[i - 1] + 1) % 250);
    }
  }
  EXPECT_THAT(b.segment_starts, ElementsAre(0, 16, 32));
  EXPECT_EQ((*l)->position().samples, 3u);
}

// Every window of an epoch once, a fresh order and shift the next epoch.
TEST(LoaderTest, EachEpochServesEveryWindowOnceInAFreshOrder) {
  const int64_t n = 3301;
  const int seq = 10;
  const std::string d = MakeDataset(TestDir(), "ramp", n, 0, 200, 257);
  std::unique_ptr<Loader> l = *Loader::Create({{1, d}}, Options(seq, 1));
  const int64_t w = (n - seq) / seq;
  EXPECT_EQ(l->windows_per_epoch(), w);
  std::vector<uint64_t> drawn(1, 0);
  std::vector<int64_t> starts[2];
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::set<int64_t> seen;
    for (int64_t i = 0; i < w; ++i) {
      const int64_t s = l->DrawAt(static_cast<uint64_t>(epoch * w + i), drawn).start;
      starts[epoch].push_back(s);
      seen.insert(s);
      EXPECT_LE(s + seq + 1, n);
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(w));  // a permutation
    // One shift per epoch: all starts agree modulo seq.
    for (const int64_t s : seen) EXPECT_EQ(s % seq, *seen.begin() % seq);
  }
  EXPECT_NE(starts[0], starts[1]);
  std::vector<int64_t> sorted = starts[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, starts[0]) << "not shuffled";
}

TEST(LoaderTest, SameSeedSameSamplesOtherSeedOtherOrder) {
  const std::string d = MakeDataset(TestDir(), "ramp", 5000, 0, 250, 257);
  const auto run = [&](uint64_t seed) {
    std::unique_ptr<Loader> l = *Loader::Create({{1, d}}, Options(32, 4, seed));
    std::vector<int32_t> all;
    Batch b;
    for (int i = 0; i < 100; ++i) {  // crosses several epochs (155 windows each)
      EXPECT_TRUE(l->Next(b).ok());
      all.insert(all.end(), b.inputs.begin(), b.inputs.end());
    }
    return all;
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

// Blends sample their datasets in the ratios of their weights: within 1% over 10k samples.
TEST(LoaderTest, BlendRatiosFollowTheWeights) {
  const std::filesystem::path dir = TestDir();
  const std::string a = MakeDataset(dir, "a", 4000, 0, 100, 300);
  const std::string b = MakeDataset(dir, "b", 9000, 100, 100, 300);
  const std::string c = MakeDataset(dir, "c", 3000, 200, 100, 300);
  struct Case {
    std::vector<BlendEntry> blend;
    std::vector<double> expected;
  };
  const Case cases[] = {
      {{{0.3, a}, {0.7, b}}, {0.3, 0.7}},
      {{{1, a}, {2, b}, {5, c}}, {0.125, 0.25, 0.625}},
      {{{-1, a}, {-1, b}, {-1, c}}, {0.25, 9.0 / 16, 3.0 / 16}},  // paths only: by size
  };
  for (const Case& k : cases) {
    std::unique_ptr<Loader> l = *Loader::Create(k.blend, Options(8, 100));
    std::vector<int> count(k.blend.size(), 0);
    Batch batch;
    for (int step = 0; step < 100; ++step) {
      ASSERT_TRUE(l->Next(batch).ok());
      for (int r = 0; r < 100; ++r)
        ++count[static_cast<size_t>(batch.inputs[static_cast<size_t>(r) * 8] / 100)];
    }
    for (size_t d = 0; d < k.blend.size(); ++d) {
      const double observed = count[d] / 10000.0;
      EXPECT_NEAR(observed, k.expected[d], 0.01 * k.expected[d]) << "dataset " << d;
      EXPECT_EQ(l->position().drawn[d], static_cast<uint64_t>(count[d]));
    }
  }
}

// Ranks reading their rows of the microbatch see together what one reader sees: two
// domains (D = 2), or four ranks, each reading only its share.
TEST(LoaderTest, SharesOfTheMicrobatchTileIt) {
  const std::filesystem::path dir = TestDir();
  const std::vector<BlendEntry> blend = {{0.4, MakeDataset(dir, "a", 4000, 0, 100, 300)},
                                         {0.6, MakeDataset(dir, "b", 6000, 100, 100, 300)}};
  std::unique_ptr<Loader> one = *Loader::Create(blend, Options(16, 8));
  for (const int ranks : {2, 4}) {
    std::vector<std::unique_ptr<Loader>> shares;
    for (int r = 0; r < ranks; ++r) shares.push_back(*Loader::Create(blend, Options(16, 8)));
    std::unique_ptr<Loader> whole = *Loader::Create(blend, Options(16, 8));
    Batch all, part;
    for (int step = 0; step < 20; ++step) {
      ASSERT_TRUE(whole->Next(all).ok());
      std::vector<int32_t> joined;
      for (int r = 0; r < ranks; ++r) {
        const int rows = 8 / ranks;
        ASSERT_TRUE(shares[static_cast<size_t>(r)]->Next(r * rows, rows, part).ok());
        EXPECT_EQ(part.batch, rows);
        joined.insert(joined.end(), part.inputs.begin(), part.inputs.end());
        EXPECT_EQ(shares[static_cast<size_t>(r)]->position().samples, whole->position().samples);
      }
      EXPECT_EQ(joined, all.inputs);
    }
  }
  EXPECT_FALSE(one->Next(6, 4, *std::make_unique<Batch>()).ok());
}

// The position saved on one layout continues on another with exactly the next samples.
TEST(LoaderTest, APositionResumesWithTheNextSamplesOnAnyShare) {
  const std::filesystem::path dir = TestDir();
  const std::vector<BlendEntry> blend = {{0.3, MakeDataset(dir, "a", 3000, 0, 100, 300)},
                                         {0.7, MakeDataset(dir, "b", 5000, 100, 100, 300)}};
  std::unique_ptr<Loader> a = *Loader::Create(blend, Options(32, 4, 11));
  Batch b;
  for (int i = 0; i < 70; ++i) ASSERT_TRUE(a->Next(b).ok());  // into the second epochs
  const std::string saved = a->SavePosition();
  std::vector<int32_t> expected;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(a->Next(b).ok());
    expected.insert(expected.end(), b.inputs.begin(), b.inputs.end());
  }
  // Two readers of half the rows each (another D), restored from the saved position.
  std::vector<std::unique_ptr<Loader>> halves;
  for (int r = 0; r < 2; ++r) {
    halves.push_back(*Loader::Create(blend, Options(32, 4, 11)));
    ASSERT_TRUE(halves.back()->RestorePosition(saved).ok());
  }
  std::vector<int32_t> got;
  for (int i = 0; i < 50; ++i) {
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(halves[static_cast<size_t>(r)]->Next(2 * r, 2, b).ok());
      got.insert(got.end(), b.inputs.begin(), b.inputs.end());
    }
  }
  EXPECT_EQ(got, expected);
  // Other data, another seed or a damaged record are refused, naming both sides.
  std::unique_ptr<Loader> other =
      *Loader::Create({{0.5, blend[0].path}, {0.5, blend[1].path}}, Options(32, 4, 11));
  absl::Status s = other->RestorePosition(saved);
  EXPECT_THAT(s.message(), HasSubstr("belongs to other data (0.3 x '"));
  EXPECT_THAT(s.message(), HasSubstr("than this job's (0.5 x '"));
  s = (*Loader::Create(blend, Options(64, 4, 11)))->RestorePosition(saved);
  EXPECT_THAT(s.message(), HasSubstr("recorded with seq_len 32, this job has 64"));
  // Another seed in the job: the checkpoint's stream goes on all the same.
  std::unique_ptr<Loader> reseeded = *Loader::Create(blend, Options(32, 4, 12));
  ASSERT_TRUE(reseeded->RestorePosition(saved).ok());
  std::vector<int32_t> again;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(reseeded->Next(b).ok());
    again.insert(again.end(), b.inputs.begin(), b.inputs.end());
  }
  EXPECT_EQ(again, expected);
  EXPECT_EQ(a->RestorePosition("{}").code(), absl::StatusCode::kDataLoss);
}

TEST(LoaderTest, DocumentEndsStartSegments) {
  // Documents of 5 tokens: 4 ids then the end-of-document id 299.
  const std::string d = MakeDataset(TestDir(), "docs", 400, 0, 50, 300, /*eod=*/299, /*doc=*/5);
  std::unique_ptr<Loader> l = *Loader::Create({{1, d}}, Options(8, 2, 0, /*shuffle=*/false));
  Batch b;
  ASSERT_TRUE(l->Next(b).ok());
  // Row 0 = tokens [0, 8): the id 299 at 4; row 1 = tokens [8, 16): 299 at 9 and 14, i.e.
  // flattened 8 + 1 and 8 + 6 (the row start 8 is a start too).
  EXPECT_EQ(b.inputs[4], 299);
  EXPECT_THAT(b.segment_starts, ElementsAre(0, 4, 8, 9, 14));
}

TEST(LoaderTest, BadBlendsAreRefusedNamingTheDatasets) {
  const std::filesystem::path dir = TestDir();
  const std::string bytes = MakeDataset(dir, "bytes", 1000, 0, 100, 257, 256);
  const std::string other = MakeDataset(dir, "other", 1000, 0, 100, 300);  // another vocab
  absl::StatusOr<std::unique_ptr<Loader>> l =
      Loader::Create({{1, bytes}, {1, other}}, Options(8, 2));
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(),
              HasSubstr("'" + bytes + "' was made with tokenizer bytes (vocab 257) but '" + other +
                        "' with bytes (vocab 300)"));
  l = Loader::Create({{1, bytes}}, Options(600, 2));
  EXPECT_THAT(l.status().message(), HasSubstr("fewer than 2 windows of model.seq_len + 1 = 601"));
  l = Loader::Create({{0, bytes}, {1, bytes}}, Options(8, 2));
  EXPECT_THAT(l.status().message(), HasSubstr("weights must be positive"));
  l = Loader::Create({{1, (dir / "missing").string()}}, Options(8, 2));
  EXPECT_THAT(l.status().message(), HasSubstr("data.train: cannot open dataset index"));
}

// A Megatron dataset without a record: the model's vocabulary bounds it, checked per id read.
TEST(LoaderTest, DataWithoutARecordNeedsTheModelsVocabularyAndIsChecked) {
  const std::filesystem::path dir = TestDir();
  const std::string d = MakeDataset(dir, "m", 2000, 0, 500, 600);
  std::filesystem::remove(DatasetInfoPath(d));
  absl::StatusOr<std::unique_ptr<Loader>> l = Loader::Create({{1, d}}, Options(8, 4));
  EXPECT_THAT(l.status().message(), HasSubstr("set model.vocab"));
  LoaderOptions o = Options(8, 4);
  o.vocab = 300;  // too small for ids up to 499
  l = Loader::Create({{1, d}}, o);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ((*l)->tokenizer().kind, "unknown");
  Batch b;
  absl::Status s;
  for (int i = 0; i < 50 && s.ok(); ++i) s = (*l)->Next(b);
  EXPECT_THAT(s.message(), HasSubstr("'" + d + "' holds token id "));
  EXPECT_THAT(s.message(), HasSubstr("outside the vocabulary [0, 300)"));
}

TEST(LoaderTest, ReadsTokenFilesToo) {
  const std::string path = (TestDir() / "old.tokens").string();
  TokenFile file{.vocab = 257, .end_of_document = 256, .tokens = {}};
  for (int i = 0; i < 1000; ++i) file.tokens.push_back(i % 7 == 0 ? 256 : i % 200);
  ASSERT_TRUE(WriteTokenFile(path, file).ok());
  std::unique_ptr<Loader> l = *Loader::Create({{1, path}}, Options(10, 2, 0, false));
  EXPECT_EQ(l->tokenizer().kind, "bytes");
  EXPECT_EQ(l->end_of_document(), 256);
  Batch b;
  ASSERT_TRUE(l->Next(b).ok());
  EXPECT_EQ(std::vector<int32_t>(b.inputs.begin(), b.inputs.begin() + 10),
            std::vector<int32_t>(file.tokens.begin(), file.tokens.begin() + 10));
  EXPECT_THAT(b.segment_starts, ElementsAre(0, 7, 10, 14));
}

int64_t ResidentKib() {
  std::ifstream in("/proc/self/status");
  std::string key;
  int64_t value = 0;
  while (in >> key) {
    if (key == "VmRSS:") {
      in >> value;
      return value;
    }
    in.ignore(1 << 20, '\n');
  }
  return -1;
}

// A dataset larger than this machine's memory (64 GiB, sparse on disk) trains with flat
// resident memory: the loader maps it and touches only the windows it serves.
TEST(LoaderTest, ADatasetLargerThanMemoryKeepsResidentMemoryFlat) {
  const std::filesystem::path dir = TestDir();
  const std::string prefix = (dir / "huge").string();
  constexpr int64_t kSequences = 32, kLength = int64_t{1} << 30;  // uint16 ids: 64 GiB
  {
    const int fd = ::open((prefix + ".bin").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    if (::ftruncate(fd, kSequences * kLength * 2) != 0) {
      ::close(fd);
      GTEST_SKIP() << "this filesystem cannot hold a 64 GiB sparse file";
    }
    ::close(fd);
    std::string idx("MMIDIDX\0\0", 9);
    const auto put = [&](uint64_t v, int w) {
      for (int i = 0; i < w; ++i) idx.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    };
    put(1, 8);
    idx.push_back(8);
    put(kSequences, 8);
    put(kSequences + 1, 8);
    for (int64_t i = 0; i < kSequences; ++i) put(kLength, 4);
    for (int64_t i = 0; i < kSequences; ++i) put(static_cast<uint64_t>(i * kLength * 2), 8);
    for (int64_t i = 0; i <= kSequences; ++i) put(static_cast<uint64_t>(i), 8);
    std::ofstream(prefix + ".idx", std::ios::binary) << idx;
  }
  LoaderOptions o = Options(4096, 8);
  o.vocab = 1000;
  std::unique_ptr<Loader> l = *Loader::Create({{1, prefix}}, o);
  EXPECT_EQ(l->tokens(), kSequences * kLength);
  Batch b;
  ASSERT_TRUE(l->Next(b).ok());
  const int64_t before = ResidentKib();
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(l->Next(b).ok());
  const int64_t grown = ResidentKib() - before;
  // 1600 windows of 8 KiB, up to 3 pages each: at most ~19 MiB even if every page stayed;
  // the whole dataset would be 64 GiB.
  std::printf("[ measured ] resident growth over 200 microbatches of 8 x 4096: %lld KiB\n",
              static_cast<long long>(grown));
  EXPECT_LT(grown, 64 * 1024);
}

}  // namespace
}  // namespace rackrun::data
