// The simulated cuBLASLt and cuBLAS (blas.cc), called directly, against a naive reference here:
// every operation pair, non-square shapes, padded leading dimensions (padding holds NaNs, so a
// read outside the matrix shows), beta 0 (C holds NaNs) and not, in place and not; fp32, TF32
// (rounded to nearest even: exact cases) and bf16 operands with fp32 and bf16 results; the
// grouped GEMM as grouped_gemm.cc calls it; stream order; the refusals.
#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr cublasOperation_t N = CUBLAS_OP_N;
constexpr cublasOperation_t T = CUBLAS_OP_T;

// `x` rounded to `bits` significant bits, ties to even (nearbyint under the default mode):
// frexp/ldexp arithmetic, independent of blas.cc's bit manipulation.
float RoundToBits(float x, int bits) {
  if (x == 0.0f || !std::isfinite(x)) return x;
  int e = 0;
  const double m = std::frexp(static_cast<double>(x), &e);
  return static_cast<float>(std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits));
}
float Tf32(float x) { return RoundToBits(x, 11); }  // 1 implicit + 10 stored mantissa bits
float Bf16(float x) { return RoundToBits(x, 8); }   // 1 implicit + 7

uint16_t Bf16Bits(float x) {  // x already a bf16 value (or NaN)
  if (std::isnan(x)) return 0x7fc0;
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16Bits(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

size_t Bytes(cudaDataType_t t) { return t == CUDA_R_16BF ? 2 : 4; }

// A column-major matrix on the host; the padding rows of each column hold NaN.
struct HostMatrix {
  int rows = 0, cols = 0, ld = 1;
  std::vector<float> v;
  float at(int i, int j) const { return v[static_cast<size_t>(i + j * ld)]; }
};

HostMatrix Random(int rows, int cols, int ld, std::mt19937& rng, bool bf16) {
  HostMatrix h{rows, cols, ld, std::vector<float>(static_cast<size_t>(ld) * cols, kNaN)};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int j = 0; j < cols; ++j) {
    for (int i = 0; i < rows; ++i) {
      const float x = u(rng);
      h.v[static_cast<size_t>(i + j * ld)] = bf16 ? Bf16(x) : x;
    }
  }
  return h;
}

// Device memory from cudaMalloc, freed at the end of the scope.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  char* bytes() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
};

std::vector<char> Encode(const std::vector<float>& v, cudaDataType_t type) {
  std::vector<char> out(v.size() * Bytes(type));
  for (size_t i = 0; i < v.size(); ++i) {
    if (type == CUDA_R_16BF) {
      const uint16_t h = Bf16Bits(v[i]);
      std::memcpy(&out[2 * i], &h, 2);
    } else {
      std::memcpy(&out[4 * i], &v[i], 4);
    }
  }
  return out;
}

void Upload(const DeviceBuffer& d, const std::vector<float>& v, cudaDataType_t type) {
  const std::vector<char> bytes = Encode(v, type);
  ASSERT_EQ(cudaMemcpy(d.get(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
}

std::vector<float> Download(const void* d, size_t count, cudaDataType_t type) {
  std::vector<char> bytes(count * Bytes(type));
  EXPECT_EQ(cudaMemcpy(bytes.data(), d, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) {
    if (type == CUDA_R_16BF) {
      uint16_t h = 0;
      std::memcpy(&h, &bytes[2 * i], 2);
      out[i] = FromBf16Bits(h);
    } else {
      std::memcpy(&out[i], &bytes[4 * i], 4);
    }
  }
  return out;
}

// D = alpha op(A) op(B) + beta C in double, operands optionally rounded to TF32 first.
std::vector<double> Reference(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                              float alpha, const HostMatrix& a, const HostMatrix& b, float beta,
                              const HostMatrix& c, bool tf32) {
  std::vector<double> d(static_cast<size_t>(m) * n);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      double sum = 0;
      for (int p = 0; p < k; ++p) {
        float x = ta == N ? a.at(i, p) : a.at(p, i);
        float y = tb == N ? b.at(p, j) : b.at(j, p);
        if (tf32) {
          x = Tf32(x);
          y = Tf32(y);
        }
        sum += static_cast<double>(x) * y;
      }
      d[static_cast<size_t>(i + j * m)] = alpha * sum + (beta != 0.0f ? beta * c.at(i, j) : 0.0);
    }
  }
  return d;
}

// `got` (m x n, columns `ld` apart) against `want` (columns m apart): fp32 to 1e-6 of the largest
// magnitude, bf16 also to half a bf16 unit of each value.
void ExpectNear(const std::vector<float>& got, int ld, const std::vector<double>& want, int m,
                int n, bool bf16, const std::string& what) {
  double scale = 1;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      const double w = want[static_cast<size_t>(i + j * m)];
      const double g = got[static_cast<size_t>(i + j * ld)];
      const double tol = 1e-6 * scale + (bf16 ? std::ldexp(std::abs(w), -8) : 0.0);
      ASSERT_NEAR(g, w, tol) << what << " at (" << i << ", " << j << ")";
    }
  }
}

double MaxDiff(const std::vector<float>& got, int ld, const std::vector<double>& want, int m,
               int n) {
  double diff = 0;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      diff = std::max(diff, std::abs(got[static_cast<size_t>(i + j * ld)] -
                                     want[static_cast<size_t>(i + j * m)]));
    }
  }
  return diff;
}

// One cuBLASLt GEMM's descriptors, destroyed at the end of the scope.
struct LtDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescs() { Release(); }
  void Release() {
    for (cublasLtMatrixLayout_t* l : {&a, &b, &c, &d}) {
      if (*l != nullptr) cublasLtMatrixLayoutDestroy(*l);
      *l = nullptr;
    }
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    op = nullptr;
    pref = nullptr;
  }
};

struct LtCase {
  cublasOperation_t ta = N, tb = N;
  int m = 1, n = 1, k = 1;
  int pad = 0;  // extra rows in every leading dimension
  float alpha = 1, beta = 0;
  bool in_place = false;  // C == D (the engine's way); else C is its own buffer
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t ab = CUDA_R_32F, cd = CUDA_R_32F;

  int a_rows() const { return ta == N ? m : k; }
  int a_cols() const { return ta == N ? k : m; }
  int b_rows() const { return tb == N ? k : n; }
  int b_cols() const { return tb == N ? n : k; }
};

// Creates `t`'s descriptor (TRANSA, TRANSB set) and layouts.
void MakeDescs(const LtCase& t, LtDescs& s) {
  ASSERT_EQ(cublasLtMatmulDescCreate(&s.op, t.compute, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSA, &t.ta, sizeof(t.ta)),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSB, &t.tb, sizeof(t.tb)),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&s.a, t.ab, t.a_rows(), t.a_cols(), t.a_rows() + t.pad),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&s.b, t.ab, t.b_rows(), t.b_cols(), t.b_rows() + t.pad),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&s.c, t.cd, t.m, t.n, t.m + t.pad), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&s.d, t.cd, t.m, t.n, t.m + t.pad), CUBLAS_STATUS_SUCCESS);
}

// The heuristic's algorithm for `s` with a workspace limit of 1 MiB and `alignment`.
cublasLtMatmulAlgo_t Choose(cublasLtHandle_t lt, LtDescs& s, uint32_t alignment = 256) {
  EXPECT_EQ(cublasLtMatmulPreferenceCreate(&s.pref), CUBLAS_STATUS_SUCCESS);
  const uint64_t ws = 1 << 20;
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                 &ws, sizeof(ws)),
            CUBLAS_STATUS_SUCCESS);
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(s.pref, attr, &alignment, sizeof(alignment)),
              CUBLAS_STATUS_SUCCESS);
  }
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, s.op, s.a, s.b, s.c, s.d, s.pref, 1, &r, &found),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(found, 1);
  EXPECT_EQ(r.state, CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(r.workspaceSize, 0u);
  return r.algo;
}

class SimBlasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cublasLtCreate(&lt_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    EXPECT_EQ(cublasLtDestroy(lt_), CUBLAS_STATUS_SUCCESS);
  }

  // Runs `t` on random inputs through the heuristic's algorithm and checks D against the
  // reference (TF32-rounded operands under TF32); returns D (columns m + pad apart).
  std::vector<float> RunLt(const LtCase& t, uint32_t seed, std::vector<double>* fp32_reference) {
    std::mt19937 rng(seed);
    const bool bf_in = t.ab == CUDA_R_16BF, bf_out = t.cd == CUDA_R_16BF;
    const HostMatrix a = Random(t.a_rows(), t.a_cols(), t.a_rows() + t.pad, rng, bf_in);
    const HostMatrix b = Random(t.b_rows(), t.b_cols(), t.b_rows() + t.pad, rng, bf_in);
    HostMatrix c = Random(t.m, t.n, t.m + t.pad, rng, bf_out);
    if (t.beta == 0.0f && !t.in_place) std::fill(c.v.begin(), c.v.end(), kNaN);  // never read
    const size_t d_count = static_cast<size_t>(c.ld) * t.n;
    DeviceBuffer da(a.v.size() * Bytes(t.ab)), db(b.v.size() * Bytes(t.ab));
    DeviceBuffer dc(d_count * Bytes(t.cd)), dd(d_count * Bytes(t.cd));
    Upload(da, a.v, t.ab);
    Upload(db, b.v, t.ab);
    Upload(dc, c.v, t.cd);
    const std::vector<float> sentinel(d_count, -7.0f);  // D's padding must keep it
    Upload(dd, t.in_place ? c.v : sentinel, t.cd);
    LtDescs s;
    MakeDescs(t, s);
    const cublasLtMatmulAlgo_t algo = Choose(lt_, s);
    void* d = t.in_place ? dc.get() : dd.get();
    EXPECT_EQ(cublasLtMatmul(lt_, s.op, &t.alpha, da.get(), s.a, db.get(), s.b, &t.beta, dc.get(),
                             s.c, d, s.d, &algo, nullptr, 0, stream_),
              CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const std::vector<float> got = Download(d, d_count, t.cd);
    const bool tf32 = t.compute == CUBLAS_COMPUTE_32F_FAST_TF32;
    const std::string what = "ta " + std::to_string(t.ta) + " tb " + std::to_string(t.tb) +
                             " beta " + std::to_string(t.beta);
    ExpectNear(got, c.ld, Reference(t.ta, t.tb, t.m, t.n, t.k, t.alpha, a, b, t.beta, c, tf32), t.m,
               t.n, bf_out, what);
    for (int j = 0; j < t.n && !t.in_place; ++j) {
      for (int i = t.m; i < c.ld; ++i) EXPECT_EQ(got[static_cast<size_t>(i + j * c.ld)], -7.0f);
    }
    if (fp32_reference != nullptr) {
      *fp32_reference = Reference(t.ta, t.tb, t.m, t.n, t.k, t.alpha, a, b, t.beta, c, false);
    }
    return got;
  }

  cublasLtHandle_t lt_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

TEST_F(SimBlasTest, Fp32EveryOperationPair) {
  for (cublasOperation_t ta : {N, T}) {
    for (cublasOperation_t tb : {N, T}) {
      // Out of place with beta 0 (C all NaN), then in place with beta != 0.
      RunLt({.ta = ta, .tb = tb, .m = 7, .n = 5, .k = 9, .pad = 3, .alpha = 1.5f}, 1, nullptr);
      RunLt({.ta = ta,
             .tb = tb,
             .m = 7,
             .n = 5,
             .k = 9,
             .pad = 2,
             .alpha = -1,
             .beta = -0.5f,
             .in_place = true},
            2, nullptr);
      // Out of place with beta != 0: C read from its own buffer.
      RunLt({.ta = ta, .tb = tb, .m = 3, .n = 11, .k = 4, .pad = 1, .beta = 2}, 3, nullptr);
    }
  }
}

TEST_F(SimBlasTest, Fp32LargerThanOneBlock) {
  // Several column panels and a partial one, row blocks and leftover rows, several k passes.
  RunLt({.ta = T, .tb = N, .m = 70, .n = 130, .k = 300, .pad = 1, .beta = 0.25f, .in_place = true},
        4, nullptr);
}

TEST_F(SimBlasTest, Tf32RoundsOperandsAndDiffersFromFp32) {
  const LtCase fp32{.ta = N, .tb = T, .m = 16, .n = 24, .k = 64, .pad = 1};
  LtCase tf32 = fp32;
  tf32.compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  std::vector<double> plain;
  const std::vector<float> f = RunLt(fp32, 5, nullptr);
  const std::vector<float> t = RunLt(tf32, 5, &plain);  // same inputs, checked vs TF32 reference
  EXPECT_LT(MaxDiff(f, 17, plain, 16, 24), 1e-5);
  EXPECT_GT(MaxDiff(t, 17, plain, 16, 24), 1e-4) << "TF32 computed as fp32";
}

TEST_F(SimBlasTest, Tf32RoundsToNearestEven) {
  // D = op(A) * 1 for a 4 x 1 A: the TF32 values of A, exactly.
  const float ulp = std::ldexp(1.0f, -10);                            // TF32's unit at 1
  const std::vector<float> a = {1 + ulp / 2,                          // tie, even below: 1
                                1 + ulp + ulp / 2,                    // tie, even above: 1 + 2 ulp
                                1 + ulp / 2 + std::ldexp(1.0f, -20),  // above the tie: 1 + ulp
                                -(1 + ulp / 2 - std::ldexp(1.0f, -20))};  // below: -1
  const std::vector<float> want = {1, 1 + 2 * ulp, 1 + ulp, -1};
  LtDescs s;
  MakeDescs({.m = 4, .n = 1, .k = 1, .compute = CUBLAS_COMPUTE_32F_FAST_TF32}, s);
  const cublasLtMatmulAlgo_t algo = Choose(lt_, s);
  DeviceBuffer da(16), db(4), dd(16);
  Upload(da, a, CUDA_R_32F);
  Upload(db, {1.0f}, CUDA_R_32F);
  const float one = 1, zero = 0;
  ASSERT_EQ(cublasLtMatmul(lt_, s.op, &one, da.get(), s.a, db.get(), s.b, &zero, dd.get(), s.c,
                           dd.get(), s.d, &algo, nullptr, 0, stream_),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Download(dd.get(), 4, CUDA_R_32F), want);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(Tf32(a[i]), want[i]);  // the reference agrees
}

TEST_F(SimBlasTest, Bf16OperandsFp32AndBf16Results) {
  const cudaDataType_t bf = CUDA_R_16BF;
  RunLt({.ta = N,
         .tb = T,
         .m = 9,
         .n = 11,
         .k = 33,
         .pad = 2,
         .beta = 0.5f,
         .in_place = true,
         .ab = bf},
        6, nullptr);
  RunLt({.ta = T,
         .tb = N,
         .m = 9,
         .n = 11,
         .k = 33,
         .pad = 2,
         .beta = 1,
         .in_place = true,
         .ab = bf,
         .cd = bf},
        7, nullptr);
  RunLt({.ta = T, .tb = T, .m = 12, .n = 5, .k = 20, .pad = 1, .alpha = 2, .ab = bf, .cd = bf}, 8,
        nullptr);
}

TEST_F(SimBlasTest, Bf16ResultRoundsToNearestEven) {
  // Rows of D = A [1, 1]^T with k = 2: sums halfway between two bf16 values.
  const float u = std::ldexp(1.0f, -7);  // bf16's unit at 1
  const std::vector<float> a = {1, 1 + u, 1, u / 2, u / 2, u / 2 + std::ldexp(1.0f, -12)};  // 3 x 2
  const std::vector<float> want = {1, 1 + 2 * u, 1 + u};
  LtDescs s;
  MakeDescs({.m = 3, .n = 1, .k = 2, .ab = CUDA_R_16BF, .cd = CUDA_R_16BF}, s);
  const cublasLtMatmulAlgo_t algo = Choose(lt_, s);
  DeviceBuffer da(12), db(4), dd(6);
  Upload(da, a, CUDA_R_16BF);
  Upload(db, {1.0f, 1.0f}, CUDA_R_16BF);
  const float one = 1, zero = 0;
  ASSERT_EQ(cublasLtMatmul(lt_, s.op, &one, da.get(), s.a, db.get(), s.b, &zero, dd.get(), s.c,
                           dd.get(), s.d, &algo, nullptr, 0, stream_),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Download(dd.get(), 3, CUDA_R_16BF), want);
}

TEST_F(SimBlasTest, WorkWaitsForTheStreamAndOwnsItsArguments) {
  const LtCase t{.m = 2, .n = 2, .k = 2};
  const std::vector<float> a = {1, 2, 3, 4}, b = {1, 0, 0, 1};  // D = alpha A
  DeviceBuffer da(16), db(16), dd(16);
  Upload(da, a, CUDA_R_32F);
  Upload(db, b, CUDA_R_32F);
  Upload(dd, {-7, -7, -7, -7}, CUDA_R_32F);
  float alpha = 2, beta = 0;
  {
    LtDescs s;
    MakeDescs(t, s);
    const cublasLtMatmulAlgo_t algo = Choose(lt_, s);
    ASSERT_EQ(cublasLtMatmul(lt_, s.op, &alpha, da.get(), s.a, db.get(), s.b, &beta, dd.get(), s.c,
                             dd.get(), s.d, &algo, nullptr, 0, stream_),
              CUBLAS_STATUS_SUCCESS);
  }  // descriptors destroyed before the GEMM runs
  alpha = 100;
  // cudaMemcpy (legacy stream) does not wait for a non-blocking stream: D is not written yet.
  EXPECT_EQ(Download(dd.get(), 4, CUDA_R_32F), std::vector<float>(4, -7.0f));
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(Download(dd.get(), 4, CUDA_R_32F), (std::vector<float>{2, 4, 6, 8}));
}

// ---- Refusals -------------------------------------------------------------------------------

TEST_F(SimBlasTest, HostMemoryRefused) {
  LtDescs s;
  MakeDescs({.m = 4, .n = 4, .k = 4}, s);
  DeviceBuffer da(64), db(64), dd(64);
  std::vector<float> host(16, 1.0f);
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, 64, cudaHostAllocDefault), cudaSuccess);
  const float one = 1, zero = 0;
  const auto run = [&](const void* a, const void* b, void* d, const float* alpha) {
    return cublasLtMatmul(lt_, s.op, alpha, a, s.a, b, s.b, &zero, d, s.c, d, s.d, nullptr, nullptr,
                          0, stream_);
  };
  EXPECT_EQ(run(host.data(), db.get(), dd.get(), &one), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(da.get(), pinned, dd.get(), &one), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(da.get(), db.get(), host.data(), &one), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(da.get(), db.get(), nullptr, &one), CUBLAS_STATUS_INVALID_VALUE);
  // A matrix whose last column lies far past its allocation's end (64 MiB: outside any
  // allocation of this test).
  cublasLtMatrixLayout_t far = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&far, CUDA_R_32F, 4, 4, 1 << 22), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt_, s.op, &one, da.get(), far, db.get(), s.b, &zero, dd.get(), s.c,
                           dd.get(), s.d, nullptr, nullptr, 0, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatrixLayoutDestroy(far);
  // Host pointer mode: alpha in device memory is refused.
  EXPECT_EQ(run(da.get(), db.get(), dd.get(), static_cast<const float*>(da.get())),
            CUBLAS_STATUS_INVALID_VALUE);
  // A workspace outside device memory.
  EXPECT_EQ(cublasLtMatmul(lt_, s.op, &one, da.get(), s.a, db.get(), s.b, &zero, dd.get(), s.c,
                           dd.get(), s.d, nullptr, host.data(), 64, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(run(da.get(), db.get(), dd.get(), &one), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

TEST_F(SimBlasTest, LayoutsThatDoNotFitRefused) {
  LtDescs s;
  MakeDescs({.ta = T, .m = 4, .n = 3, .k = 5}, s);
  cublasLtMatrixLayout_t wrong_b = nullptr, wrong_c = nullptr, l = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&wrong_b, CUDA_R_32F, 4, 3, 4), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&wrong_c, CUDA_R_32F, 3, 4, 3), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&s.pref), CUBLAS_STATUS_SUCCESS);
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  EXPECT_EQ(
      cublasLtMatmulAlgoGetHeuristic(lt_, s.op, s.a, wrong_b, s.c, s.d, s.pref, 1, &r, &found),
      CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(
      cublasLtMatmulAlgoGetHeuristic(lt_, s.op, s.a, s.b, wrong_c, s.d, s.pref, 1, &r, &found),
      CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(found, 0);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt_, s.op, s.a, s.b, s.c, s.d, s.pref, 0, &r, &found),
            CUBLAS_STATUS_INVALID_VALUE);
  DeviceBuffer buf(256);
  const float one = 1;
  EXPECT_EQ(cublasLtMatmul(lt_, s.op, &one, buf.get(), s.a, buf.get(), wrong_b, &one, buf.get(),
                           s.c, buf.get(), s.d, nullptr, nullptr, 0, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  // In place (C == D) needs C's layout to be D's.
  cublasLtMatrixLayout_t wide_d = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&wide_d, CUDA_R_32F, 4, 3, 6), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt_, s.op, &one, buf.get(), s.a, buf.get(), s.b, &one, buf.get(), s.c,
                           buf.get(), wide_d, nullptr, nullptr, 0, stream_),
            CUBLAS_STATUS_INVALID_VALUE);
  // ld below the rows; a type not computed here.
  EXPECT_EQ(cublasLtMatrixLayoutCreate(&l, CUDA_R_32F, 8, 2, 7), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasLtMatrixLayoutCreate(&l, CUDA_R_16F, 8, 2, 8), CUBLAS_STATUS_NOT_SUPPORTED);
  for (cublasLtMatrixLayout_t x : {wrong_b, wrong_c, wide_d}) cublasLtMatrixLayoutDestroy(x);
}

TEST_F(SimBlasTest, UnsupportedAttributesAndTypesRefused) {
  cublasLtMatmulDesc_t op = nullptr;
  EXPECT_EQ(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_16F, CUDA_R_16F),
            CUBLAS_STATUS_NOT_SUPPORTED);
  LtDescs s;
  MakeDescs({.m = 2, .n = 2, .k = 2}, s);
  const cublasOperation_t conj = CUBLAS_OP_C;
  const int32_t device_mode = CUBLASLT_POINTER_MODE_DEVICE;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_TRANSA, &conj, 2),
            CUBLAS_STATUS_INVALID_VALUE);  // wrong size: refused, descriptor unchanged
  Choose(lt_, s);                          // still usable
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(s.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &device_mode,
                                           sizeof(device_mode)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  // A refused value poisons the descriptor: the heuristic and the GEMM refuse it too.
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt_, s.op, s.a, s.b, s.c, s.d, s.pref, 1, &r, &found),
            CUBLAS_STATUS_NOT_SUPPORTED);
  DeviceBuffer buf(64);
  const float one = 1;
  EXPECT_EQ(cublasLtMatmul(lt_, s.op, &one, buf.get(), s.a, buf.get(), s.b, &one, buf.get(), s.c,
                           buf.get(), s.d, nullptr, nullptr, 0, stream_),
            CUBLAS_STATUS_NOT_SUPPORTED);
  LtDescs e;
  MakeDescs({.m = 2, .n = 2, .k = 2}, e);
  const uint32_t relu = CUBLASLT_EPILOGUE_RELU;
  EXPECT_EQ(
      cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &relu, sizeof(relu)),
      CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_TRANSB, &conj, sizeof(conj)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  const void* bias = buf.get();
  EXPECT_EQ(
      cublasLtMatmulDescSetAttribute(e.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
      CUBLAS_STATUS_NOT_SUPPORTED);
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&e.pref), CUBLAS_STATUS_SUCCESS);
  const uint32_t search = 0;
  EXPECT_EQ(cublasLtMatmulPreferenceSetAttribute(e.pref, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &search,
                                                 sizeof(search)),
            CUBLAS_STATUS_NOT_SUPPORTED);
  // Type combinations outside the table: fp32 operands with a bf16 D; bf16 operands under TF32.
  LtDescs f;
  MakeDescs({.m = 2, .n = 2, .k = 2, .cd = CUDA_R_16BF}, f);
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&f.pref), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt_, f.op, f.a, f.b, f.c, f.d, f.pref, 1, &r, &found),
            CUBLAS_STATUS_NOT_SUPPORTED);
  LtDescs g;
  MakeDescs({.m = 2, .n = 2, .k = 2, .compute = CUBLAS_COMPUTE_32F_FAST_TF32, .ab = CUDA_R_16BF},
            g);
  ASSERT_EQ(cublasLtMatmulPreferenceCreate(&g.pref), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt_, g.op, g.a, g.b, g.c, g.d, g.pref, 1, &r, &found),
            CUBLAS_STATUS_NOT_SUPPORTED);
}

TEST_F(SimBlasTest, AlgorithmsCheckTheirTypesAndAlignment) {
  const LtCase t{.m = 4, .n = 4, .k = 4};
  LtDescs s, bf;
  MakeDescs(t, s);
  MakeDescs({.m = 4, .n = 4, .k = 4, .ab = CUDA_R_16BF}, bf);
  const cublasLtMatmulAlgo_t algo = Choose(lt_, s);
  const cublasLtMatmulAlgo_t bf_algo = Choose(lt_, bf);
  EXPECT_NE(std::memcmp(&algo, &bf_algo, sizeof(algo)), 0);
  cublasLtMatmulHeuristicResult_t r{};
  r.workspaceSize = 99;
  EXPECT_EQ(cublasLtMatmulAlgoCheck(lt_, s.op, s.a, s.b, s.c, s.d, &algo, &r),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(r.state, CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(r.workspaceSize, 0u);
  // A different shape of the same types passes (gemm.cc's bucketed algorithms); other types not.
  LtDescs other;
  MakeDescs({.ta = T, .m = 9, .n = 2, .k = 30}, other);
  EXPECT_EQ(cublasLtMatmulAlgoCheck(lt_, other.op, other.a, other.b, other.c, other.d, &algo, &r),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmulAlgoCheck(lt_, s.op, s.a, s.b, s.c, s.d, &bf_algo, &r),
            CUBLAS_STATUS_INVALID_VALUE);
  DeviceBuffer buf(256);
  const float one = 1;
  const auto run = [&](const cublasLtMatmulAlgo_t* a, size_t offset) {
    return cublasLtMatmul(lt_, s.op, &one, buf.bytes() + offset, s.a, buf.get(), s.b, &one,
                          buf.get(), s.c, buf.get(), s.d, a, nullptr, 0, stream_);
  };
  EXPECT_EQ(run(&bf_algo, 0), CUBLAS_STATUS_INVALID_VALUE);
  // An algorithm chosen for 256-byte alignment refuses an A at 4 bytes; one for 4 takes it.
  EXPECT_EQ(run(&algo, 4), CUBLAS_STATUS_NOT_SUPPORTED);
  LtDescs four;
  MakeDescs(t, four);
  const cublasLtMatmulAlgo_t algo4 = Choose(lt_, four, 4);
  EXPECT_EQ(run(&algo4, 4), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(run(&algo4, 2), CUBLAS_STATUS_NOT_SUPPORTED);  // not even a float's alignment
  EXPECT_EQ(run(nullptr, 4), CUBLAS_STATUS_SUCCESS);       // no algorithm: the library picks
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

TEST(SimBlasStatusTest, NamesAndStrings) {
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_INVALID_VALUE), "CUBLAS_STATUS_INVALID_VALUE");
  EXPECT_STREQ(cublasGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_STREQ(cublasGetStatusName(CUBLAS_STATUS_EXECUTION_FAILED),
               "CUBLAS_STATUS_EXECUTION_FAILED");
  EXPECT_GT(std::strlen(cublasLtGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED)), 0u);
  EXPECT_GT(std::strlen(cublasGetStatusString(CUBLAS_STATUS_ALLOC_FAILED)), 0u);
}

// ---- cuBLAS's grouped GEMM ------------------------------------------------------------------

struct Group {
  cublasOperation_t ta, tb;
  int m, n, k, pad;
  float alpha, beta;
};

class SimGroupedGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cublasCreate_v2(&handle_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cublasSetStream_v2(handle_, stream_), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaMalloc(&workspace_, 1 << 16), cudaSuccess);
    ASSERT_EQ(cublasSetWorkspace_v2(handle_, workspace_, 1 << 16), CUBLAS_STATUS_SUCCESS);
  }
  void TearDown() override {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cublasDestroy_v2(handle_), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cudaStreamDestroy(stream_), cudaSuccess);
    EXPECT_EQ(cudaFree(workspace_), cudaSuccess);
  }

  // One group of one problem per entry of `groups`, as grouped_gemm.cc calls it (C in place).
  // The device pointer arrays first point at decoys; a copy queued on the stream before the
  // call points them at the real matrices, so reading them at the call reads the decoys.
  void Run(const std::vector<Group>& groups, cudaDataType_t ab, cublasComputeType_t compute) {
    std::mt19937 rng(11);
    const int count = static_cast<int>(groups.size());
    const bool bf = ab == CUDA_R_16BF;
    std::vector<HostMatrix> a, b, c;
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;  // A, B, C of each problem
    std::vector<const void*> pointers(3 * groups.size());
    Arrays h;
    for (int i = 0; i < count; ++i) {
      const Group& g = groups[static_cast<size_t>(i)];
      const int ar = g.ta == N ? g.m : g.k, ac = g.ta == N ? g.k : g.m;
      const int br = g.tb == N ? g.k : g.n, bc = g.tb == N ? g.n : g.k;
      a.push_back(Random(ar, ac, ar + g.pad, rng, bf));
      b.push_back(Random(br, bc, br + g.pad, rng, bf));
      c.push_back(Random(g.m, g.n, g.m + g.pad, rng, false));
      for (const HostMatrix* x : {&a.back(), &b.back(), &c.back()}) {
        const cudaDataType_t type = x == &c.back() ? CUDA_R_32F : ab;
        buffers.push_back(std::make_unique<DeviceBuffer>(x->v.size() * Bytes(type)));
        Upload(*buffers.back(), x->v, type);
      }
      for (int w = 0; w < 3; ++w) {
        pointers[static_cast<size_t>(w * count + i)] =
            buffers[static_cast<size_t>(3 * i + w)]->get();
      }
      h.Add(g);
    }
    // Decoys: same sizes, other values; the arrays hold them until the queued copy runs.
    std::vector<std::unique_ptr<DeviceBuffer>> decoys;
    std::vector<const void*> decoy_pointers(pointers.size());
    for (size_t i = 0; i < pointers.size(); ++i) {
      decoys.push_back(std::make_unique<DeviceBuffer>(1 << 16));  // larger than any matrix here
      decoy_pointers[i] = decoys.back()->get();
    }
    const size_t array_bytes = pointers.size() * sizeof(void*);
    DeviceBuffer arrays(array_bytes), staged(array_bytes);
    ASSERT_EQ(cudaMemcpy(arrays.get(), decoy_pointers.data(), array_bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(staged.get(), pointers.data(), array_bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(
        cudaMemcpyAsync(arrays.get(), staged.get(), array_bytes, cudaMemcpyDeviceToDevice, stream_),
        cudaSuccess);
    const auto* dev = static_cast<const void* const*>(arrays.get());
    ASSERT_EQ(h.Call(handle_, dev, ab, dev + count, ab, const_cast<void* const*>(dev + 2 * count),
                     CUDA_R_32F, compute),
              CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    for (int i = 0; i < count; ++i) {
      const Group& g = groups[static_cast<size_t>(i)];
      const HostMatrix& ci = c[static_cast<size_t>(i)];
      const std::vector<float> got =
          Download(buffers[static_cast<size_t>(3 * i + 2)]->get(), ci.v.size(), CUDA_R_32F);
      ExpectNear(
          got, ci.ld,
          Reference(g.ta, g.tb, g.m, g.n, g.k, g.alpha, a[static_cast<size_t>(i)],
                    b[static_cast<size_t>(i)], g.beta, ci, compute == CUBLAS_COMPUTE_32F_FAST_TF32),
          g.m, g.n, false, "group " + std::to_string(i));
    }
  }

  // The per-group host arrays of one grouped call.
  struct Arrays {
    std::vector<cublasOperation_t> ta, tb;
    std::vector<int> m, n, k, lda, ldb, ldc, size;
    std::vector<float> alpha, beta;
    void Add(const Group& g) {
      ta.push_back(g.ta);
      tb.push_back(g.tb);
      m.push_back(g.m);
      n.push_back(g.n);
      k.push_back(g.k);
      lda.push_back((g.ta == N ? g.m : g.k) + g.pad);
      ldb.push_back((g.tb == N ? g.k : g.n) + g.pad);
      ldc.push_back(g.m + g.pad);
      size.push_back(1);
      alpha.push_back(g.alpha);
      beta.push_back(g.beta);
    }
    cublasStatus_t Call(cublasHandle_t h, const void* const* a, cudaDataType_t at,
                        const void* const* b, cudaDataType_t bt, void* const* c, cudaDataType_t ct,
                        cublasComputeType_t compute, const int* m_array = nullptr) const {
      return cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m_array ? m_array : m.data(),
                                        n.data(), k.data(), alpha.data(), a, at, lda.data(), b, bt,
                                        ldb.data(), beta.data(), c, ct, ldc.data(),
                                        static_cast<int>(m.size()), size.data(), compute);
    }
  };

  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
};

const std::vector<Group> kGroups = {{N, N, 5, 3, 4, 2, 1.0f, 0.0f},
                                    {T, N, 2, 6, 7, 1, -0.5f, 1.0f},
                                    {N, T, 8, 1, 3, 0, 2.0f, 0.5f}};

TEST_F(SimGroupedGemmTest, Fp32ThreeGroups) { Run(kGroups, CUDA_R_32F, CUBLAS_COMPUTE_32F); }

TEST_F(SimGroupedGemmTest, Tf32ThreeGroups) {
  Run(kGroups, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32);
}

TEST_F(SimGroupedGemmTest, Bf16OperandsFp32C) {
  Run({{T, T, 6, 4, 9, 1, 1.0f, 0.0f}, {N, T, 3, 5, 2, 0, 1.0f, 1.0f}}, CUDA_R_16BF,
      CUBLAS_COMPUTE_32F);
}

TEST_F(SimGroupedGemmTest, Refusals) {
  Arrays h;
  h.Add({N, N, 2, 2, 2, 0, 1.0f, 0.0f});
  DeviceBuffer matrices(64), arrays(3 * sizeof(void*));
  const void* ptrs[3] = {matrices.get(), matrices.get(), matrices.get()};
  ASSERT_EQ(cudaMemcpy(arrays.get(), ptrs, sizeof(ptrs), cudaMemcpyHostToDevice), cudaSuccess);
  const auto* dev = static_cast<const void* const*>(arrays.get());
  void* const* dev_c = const_cast<void* const*>(dev + 2);
  EXPECT_EQ(
      h.Call(handle_, dev, CUDA_R_32F, dev + 1, CUDA_R_32F, dev_c, CUDA_R_32F, CUBLAS_COMPUTE_32F),
      CUBLAS_STATUS_SUCCESS);
  // Pointer arrays on the host.
  EXPECT_EQ(
      h.Call(handle_, ptrs, CUDA_R_32F, dev + 1, CUDA_R_32F, dev_c, CUDA_R_32F, CUBLAS_COMPUTE_32F),
      CUBLAS_STATUS_INVALID_VALUE);
  // A per-group array in device memory.
  DeviceBuffer m_dev(sizeof(int));
  EXPECT_EQ(h.Call(handle_, dev, CUDA_R_32F, dev + 1, CUDA_R_32F, dev_c, CUDA_R_32F,
                   CUBLAS_COMPUTE_32F, static_cast<const int*>(m_dev.get())),
            CUBLAS_STATUS_INVALID_VALUE);
  // Types outside the table.
  EXPECT_EQ(
      h.Call(handle_, dev, CUDA_R_32F, dev + 1, CUDA_R_32F, dev_c, CUDA_R_16BF, CUBLAS_COMPUTE_32F),
      CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(h.Call(handle_, dev, CUDA_R_16BF, dev + 1, CUDA_R_16BF, dev_c, CUDA_R_32F,
                   CUBLAS_COMPUTE_32F_FAST_TF32),
            CUBLAS_STATUS_NOT_SUPPORTED);
  // A leading dimension below the rows.
  h.lda[0] = 1;
  EXPECT_EQ(
      h.Call(handle_, dev, CUDA_R_32F, dev + 1, CUDA_R_32F, dev_c, CUDA_R_32F, CUBLAS_COMPUTE_32F),
      CUBLAS_STATUS_INVALID_VALUE);
  // Workspaces: host memory, or not 256-byte aligned.
  std::vector<char> host(512);
  EXPECT_EQ(cublasSetWorkspace_v2(handle_, host.data(), host.size()), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasSetWorkspace_v2(handle_, static_cast<char*>(workspace_) + 16, 256),
            CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cublasCreate_v2(nullptr), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

using SimGroupedGemmDeathTest = SimGroupedGemmTest;

TEST_F(SimGroupedGemmDeathTest, AHostMatrixBehindADevicePointerStopsTheProgram) {
  // The arrays are in device memory, so the call is accepted; the host matrix they point at is
  // found when the GEMM runs (a GPU's illegal address).
  Arrays h;
  h.Add({N, N, 2, 2, 2, 0, 1.0f, 0.0f});
  std::vector<float> host(4, 1.0f);
  DeviceBuffer matrices(64), arrays(3 * sizeof(void*));
  const void* ptrs[3] = {host.data(), matrices.get(), matrices.get()};
  ASSERT_EQ(cudaMemcpy(arrays.get(), ptrs, sizeof(ptrs), cudaMemcpyHostToDevice), cudaSuccess);
  const auto* dev = static_cast<const void* const*>(arrays.get());
  EXPECT_DEATH(
      {
        if (h.Call(handle_, dev, CUDA_R_32F, dev + 1, CUDA_R_32F, const_cast<void* const*>(dev + 2),
                   CUDA_R_32F, CUBLAS_COMPUTE_32F) == CUBLAS_STATUS_SUCCESS) {
          (void)cudaStreamSynchronize(stream_);
        }
      },
      "problem 0 .*is not device memory");
}

}  // namespace
