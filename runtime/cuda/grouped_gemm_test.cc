// The grouped expert GEMM's host side (runtime/cuda/grouped_gemm.h), without a GPU: the group
// arrays BuildGroupedProblems makes from the batches (shapes, leading dimensions, operations,
// pointers, empty experts left out, extents, alignment, errors), checked by running them
// through a column-major reference of cublasGemmGroupedBatchedEx's semantics on host memory
// against cpu::Gemm per batch (the per-expert path's calls); the path names; and the errors of
// the shared-library loader (cublaslt_library.h) naming the file and the missing entry point.
#include "runtime/cuda/grouped_gemm.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/cpu/gemm.h"
#include "runtime/cuda/cublaslt_library.h"

namespace rackrun::runtime::cuda {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// cuBLAS's column-major GEMM on host memory: C = alpha op(A) op(B) + beta C, X(i, j) at
// X[i + j * ld], op T reading the transpose.
void ColumnMajorGemm(const GroupedProblems& p, int i) {
  const size_t g = static_cast<size_t>(i);
  const auto* a = static_cast<const float*>(p.a[g]);
  const auto* b = static_cast<const float*>(p.b[g]);
  auto* c = static_cast<float*>(p.c[g]);
  const bool ta = p.transa[g] == CUBLAS_OP_T, tb = p.transb[g] == CUBLAS_OP_T;
  for (int col = 0; col < p.n[g]; ++col) {
    for (int row = 0; row < p.m[g]; ++row) {
      double acc = 0;
      for (int l = 0; l < p.k[g]; ++l) {
        const float av = ta ? a[l + row * p.lda[g]] : a[row + l * p.lda[g]];
        const float bv = tb ? b[col + l * p.ldb[g]] : b[l + col * p.ldb[g]];
        acc += static_cast<double>(av) * bv;
      }
      float& out = c[row + col * p.ldc[g]];
      out = static_cast<float>(p.alpha[g] * acc + p.beta[g] * out);
    }
  }
}

// Batches over 5 experts, expert 2 without rows.
std::vector<ExpertBatch> Batches() {
  std::vector<ExpertBatch> out;
  const int64_t rows[] = {3, 7, 0, 1, 5};
  int64_t offset = 0;
  for (int e = 0; e < 5; ++e) {
    out.push_back({.instance = e, .expert = e, .master = true, .offset = offset, .rows = rows[e]});
    offset += rows[e];
  }
  return out;
}

constexpr int kIn = 8, kOut = 16, kExperts = 5, kRows = 16;

// Runs `g` both ways (per batch with cpu::Gemm; the grouped problems with the column-major
// reference) on copies of `c0` and compares.
void ExpectSameAsPerBatch(const ExpertGemm& g, const std::vector<float>& c0, float* c_base) {
  const std::vector<ExpertBatch> batches = Batches();
  std::copy(c0.begin(), c0.end(), c_base);
  for (const ExpertBatch& b : batches) {
    if (b.rows == 0) continue;
    const GemmShape s = ExpertShape(g, b);
    cpu::Gemm<float>(s.trans_a, s.trans_b, s.m, s.n, s.k, g.alpha,
                     static_cast<const float*>(ExpertOperandAt(g.a, b)), s.lda,
                     static_cast<const float*>(ExpertOperandAt(g.b, b)), s.ldb, g.beta,
                     static_cast<float*>(const_cast<void*>(ExpertOperandAt(g.c, b))), s.ldc);
  }
  const std::vector<float> want(c_base, c_base + c0.size());
  std::copy(c0.begin(), c0.end(), c_base);
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(batches, g);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->count(), 4);  // expert 2 left out
  EXPECT_EQ(p->expert, (std::vector<int>{0, 1, 3, 4}));
  EXPECT_EQ(p->group_size, std::vector<int>(4, 1));
  for (int i = 0; i < p->count(); ++i) ColumnMajorGemm(*p, i);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(c_base[i], want[i], 1e-4) << "element " << i;
}

TEST(GroupedGemmTest, ForwardProblemsAreThePerExpertGemms) {
  // y_b [rows x out] = x_b W_e.
  const std::vector<float> x = Random(kRows * kIn, 1), w = Random(kExperts * kIn * kOut, 2);
  std::vector<float> y(kRows * kOut);
  ExpertGemm g;
  g.shape = {.n = kOut, .k = kIn, .lda = kIn, .ldb = kOut, .ldc = kOut};
  g.a = {x.data(), kIn, 0};
  g.b = {w.data(), 0, kIn * kOut};
  g.c = {y.data(), kOut, 0};
  ExpectSameAsPerBatch(g, std::vector<float>(y.size(), 0.0f), y.data());
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(Batches(), g);
  ASSERT_TRUE(p.ok());
  // Column-major: m and n swap, our B is cuBLAS's A.
  EXPECT_EQ(p->m, std::vector<int>(4, kOut));
  EXPECT_EQ(p->n, (std::vector<int>{3, 7, 1, 5}));
  EXPECT_EQ(p->k, std::vector<int>(4, kIn));
  EXPECT_EQ(p->lda, std::vector<int>(4, kOut));
  EXPECT_EQ(p->ldb, std::vector<int>(4, kIn));
  EXPECT_EQ(p->transa, std::vector<cublasOperation_t>(4, CUBLAS_OP_N));
  EXPECT_EQ(p->a[2], w.data() + 3 * kIn * kOut);  // expert 3's weights
  EXPECT_EQ(p->b[2], x.data() + 10 * kIn);        // its rows start at 3 + 7
  EXPECT_EQ(p->c[3], y.data() + 11 * kOut);
  // What a bf16 copy must cover (our A and B): every row of x, the weights up to expert 4's.
  EXPECT_EQ(p->a_extent, kRows * kIn);
  EXPECT_EQ(p->b_extent, kExperts * kIn * kOut);
}

TEST(GroupedGemmTest, WeightGradientProblemsLeaveEmptyExpertsUntouched) {
  // dW_e += x_b^T dy_b: the rows are k; expert 2's gradient must stay as it was.
  const std::vector<float> x = Random(kRows * kIn, 3), dy = Random(kRows * kOut, 4);
  const std::vector<float> dw0 = Random(kExperts * kIn * kOut, 5);
  std::vector<float> dw(dw0.size());
  ExpertGemm g;
  g.shape = {.trans_a = true, .m = kIn, .n = kOut, .lda = kIn, .ldb = kOut, .ldc = kOut};
  g.rows_in_k = true;
  g.beta = 1.0f;
  g.a = {x.data(), kIn, 0};
  g.b = {dy.data(), kOut, 0};
  g.c = {dw.data(), 0, kIn * kOut};
  ExpectSameAsPerBatch(g, dw0, dw.data());
  for (int i = 2 * kIn * kOut; i < 3 * kIn * kOut; ++i) EXPECT_EQ(dw[i], dw0[i]);
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(Batches(), g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->k, (std::vector<int>{3, 7, 1, 5}));
  EXPECT_EQ(p->transb, std::vector<cublasOperation_t>(4, CUBLAS_OP_T));
  EXPECT_EQ(p->beta, std::vector<float>(4, 1.0f));
}

TEST(GroupedGemmTest, InputGradientProblemsAreThePerExpertGemms) {
  // dx_b = dy_b W_e^T.
  const std::vector<float> dy = Random(kRows * kOut, 6), w = Random(kExperts * kIn * kOut, 7);
  std::vector<float> dx(kRows * kIn);
  ExpertGemm g;
  g.shape = {.trans_b = true, .n = kIn, .k = kOut, .lda = kOut, .ldb = kOut, .ldc = kIn};
  g.a = {dy.data(), kOut, 0};
  g.b = {w.data(), 0, kIn * kOut};
  g.c = {dx.data(), kIn, 0};
  ExpectSameAsPerBatch(g, Random(kRows * kIn, 8), dx.data());
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(Batches(), g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->transa, std::vector<cublasOperation_t>(4, CUBLAS_OP_T));
  EXPECT_EQ(p->transb, std::vector<cublasOperation_t>(4, CUBLAS_OP_N));
}

TEST(GroupedGemmTest, PointersStepByElementSizeAndAlignmentIsReported) {
  alignas(16) static float buffer[4096];
  ExpertGemm g;
  g.shape = {.n = kOut, .k = kIn, .lda = kIn, .ldb = kOut, .ldc = kOut};
  g.a = {buffer, kIn, 0, 2};  // bf16 rows
  g.b = {buffer, 0, kIn * kOut, 2};
  g.c = {buffer, kOut, 0};
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(Batches(), g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(static_cast<const char*>(p->b[1]), reinterpret_cast<const char*>(buffer) + 3 * kIn * 2);
  EXPECT_EQ(static_cast<const char*>(p->a[1]),
            reinterpret_cast<const char*>(buffer) + kIn * kOut * 2);
  EXPECT_TRUE(p->aligned16);
  g.a.base = buffer + 1;  // 4 bytes off
  p = BuildGroupedProblems(Batches(), g);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->aligned16);
}

TEST(GroupedGemmTest, BadBatchesAndShapesAreErrorsNamingTheBatch) {
  static float buffer[1024];
  ExpertGemm g;
  g.shape = {.n = kOut, .k = kIn, .lda = kIn, .ldb = kOut, .ldc = kOut};
  g.a = g.b = g.c = {buffer, 0, 0};
  std::vector<ExpertBatch> batches = Batches();
  batches[3].rows = -1;
  absl::StatusOr<GroupedProblems> p = BuildGroupedProblems(batches, g);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("expert 3"), std::string::npos) << p.status();
  batches = Batches();
  batches[1].rows = int64_t{1} << 31;
  p = BuildGroupedProblems(batches, g);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("expert 1"), std::string::npos) << p.status();
  g.shape.lda = kIn - 1;  // shorter than a row of A
  p = BuildGroupedProblems(Batches(), g);
  ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("leading dimensions"), std::string::npos) << p.status();
  // No batch with rows: no problem, no error.
  g.shape.lda = kIn;
  batches = Batches();
  for (ExpertBatch& b : batches) b.rows = 0;
  p = BuildGroupedProblems(batches, g);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->count(), 0);
}

TEST(GroupedGemmTest, PathNames) {
  EXPECT_EQ(*ParseExpertGemmPath("grouped", "--expert-gemm"), ExpertGemmPath::kGrouped);
  EXPECT_EQ(*ParseExpertGemmPath("per_expert", "--expert-gemm"), ExpertGemmPath::kPerExpert);
  EXPECT_EQ(ExpertGemmPathName(ExpertGemmPath::kGrouped), "grouped");
  EXPECT_EQ(ExpertGemmPathName(ExpertGemmPath::kPerExpert), "per_expert");
  absl::StatusOr<ExpertGemmPath> bad = ParseExpertGemmPath("batched", "--expert-gemm");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--expert-gemm"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("batched"), std::string::npos) << bad.status();
}

TEST(SharedLibraryTest, AMissingFileIsAnErrorNamingItAndTheFix) {
  absl::StatusOr<SharedLibrary> so =
      SharedLibrary::Open("librackrun_no_such_library.so.13", "cuBLAS", "install it");
  ASSERT_EQ(so.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(so.status().message().find("cuBLAS: cannot load librackrun_no_such_library.so.13"),
            std::string::npos)
      << so.status();
  EXPECT_NE(so.status().message().find("install it"), std::string::npos) << so.status();
}

TEST(SharedLibraryTest, AMissingEntryPointIsAnErrorNamingIt) {
  absl::StatusOr<SharedLibrary> so = SharedLibrary::Open("libc.so.6", "libc", "-");
  ASSERT_TRUE(so.ok()) << so.status();
  decltype(&::strlen) found = nullptr;
  so->Bind(found, "strlen");
  EXPECT_NE(found, nullptr);
  EXPECT_TRUE(so->Check().ok());
  decltype(&::strlen) missing = &::strlen;
  so->Bind(missing, "rackrun_no_such_entry_point");
  so->Bind(found, "rackrun_second_missing_entry_point");
  EXPECT_EQ(missing, nullptr);
  const absl::Status s = so->Check();
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("libc: libc.so.6 has no rackrun_no_such_entry_point"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace rackrun::runtime::cuda
