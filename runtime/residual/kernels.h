// Internal vector kernels of the residual-stream component: blocked projections (the
// mapping GEMVs batched over tokens), their transposes, weight-gradient outer products and
// small per-token reductions. Written with GCC vector extensions so the same template
// compiles to 512-bit code for float and double; every kernel has a scalar tail.
//
// Not a public header: only runtime/residual/*.cc include it.
#ifndef RACKRUN_RUNTIME_RESIDUAL_KERNELS_H_
#define RACKRUN_RUNTIME_RESIDUAL_KERNELS_H_

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "runtime/cpu/gemm.h"

namespace rackrun::runtime::residual_internal {

// Vector width of the target: 64 bytes with AVX-512, 32 with AVX, else 16 (SSE: a wider
// vector would be passed in memory, and GCC rejects that ABI under -Werror=psabi). Tile
// shapes keep the accumulators within the 32 (AVX-512) or 16 (AVX, SSE) vector registers.
#if defined(__AVX512F__)
inline constexpr int kVectorBytes = 64;
inline constexpr int kTileRows = 4, kTileOutputs = 4, kTileVectors = 4;
#elif defined(__AVX__)
inline constexpr int kVectorBytes = 32;
inline constexpr int kTileRows = 4, kTileOutputs = 3, kTileVectors = 2;
#else
inline constexpr int kVectorBytes = 16;
inline constexpr int kTileRows = 4, kTileOutputs = 3, kTileVectors = 2;
#endif

template <typename T>
struct SimdOf;
template <>
struct SimdOf<float> {
  typedef float type __attribute__((vector_size(kVectorBytes)));
};
template <>
struct SimdOf<double> {
  typedef double type __attribute__((vector_size(kVectorBytes)));
};
template <typename T>
using Simd = typename SimdOf<T>::type;
template <typename T>
inline constexpr int kLanes = static_cast<int>(kVectorBytes / sizeof(T));

template <typename T>
inline Simd<T> Load(const T* p) {
  Simd<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
inline void Store(T* p, Simd<T> v) {
  std::memcpy(p, &v, sizeof(v));
}
template <typename T, size_t... I>
inline Simd<T> SplatLanes(T s, std::index_sequence<I...>) {
  return Simd<T>{((void)I, s)...};
}
// One broadcast instruction (`Simd<T>{} + s` would cost an add, kept for signed zeros).
template <typename T>
inline Simd<T> Splat(T s) {
  return SplatLanes<T>(s, std::make_index_sequence<static_cast<size_t>(kLanes<T>)>());
}
// a * b + c where the kernels mean a multiply-accumulate: one fused instruction (one
// rounding) when the build's instruction set has FMA, a multiply then an add when it has
// not. The project compiles with -ffp-contract=off (docs/design.md section 4.10), so the
// compiler never fuses on its own and every caller of a kernel gets the same bits.
inline Simd<float> Fma(Simd<float> a, Simd<float> b, Simd<float> c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
inline Simd<double> Fma(Simd<double> a, Simd<double> b, Simd<double> c) {
#if defined(__AVX512F__)
  return _mm512_fmadd_pd(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_pd(a, b, c);
#else
  return a * b + c;
#endif
}
template <typename T>
requires std::is_floating_point_v<T>
inline T Fma(T a, T b, T c) {
#if defined(__FMA__) || defined(__AVX512F__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

template <typename T>
inline T HSum(Simd<T> v) {
  // Pairwise, in a fixed order, so results do not depend on the call site.
  T s[kLanes<T>];
  std::memcpy(s, &v, sizeof(v));
  for (int w = kLanes<T> / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) s[i] += s[i + w];
  return s[0];
}

// Norms of the mapping inputs (RMSNorm, LayerNorm) have no learned gain; eps inside the sqrt.
inline constexpr double kNormEps = 1e-6;

// The RMSNorm scale sqrt(sumsq / n + eps) of n values whose squares sum to sumsq.
template <typename T>
inline T RmsOf(T sumsq, int64_t n) {
  return std::sqrt(sumsq / static_cast<T>(n) + static_cast<T>(kNormEps));
}

template <typename T>
inline T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// <a, b> over n elements.
template <typename T>
inline T Dot(const T* a, const T* b, int64_t n) {
  constexpr int L = kLanes<T>;
  Simd<T> a0 = {}, a1 = {};
  int64_t e = 0;
  for (; e + 2 * L <= n; e += 2 * L) {
    a0 = Fma(Load(a + e), Load(b + e), a0);
    a1 = Fma(Load(a + e + L), Load(b + e + L), a1);
  }
  for (; e + L <= n; e += L) a0 += Load(a + e) * Load(b + e);
  T s = HSum<T>(a0 + a1);
  for (; e < n; ++e) s = Fma(a[e], b[e], s);
  return s;
}

// sum and sum of squares of x (n elements).
template <typename T>
inline void Moments(const T* x, int64_t n, T* sum, T* sumsq) {
  constexpr int L = kLanes<T>;
  Simd<T> s0 = {}, s1 = {}, q0 = {}, q1 = {};
  int64_t e = 0;
  for (; e + 2 * L <= n; e += 2 * L) {
    Simd<T> v0 = Load(x + e), v1 = Load(x + e + L);
    s0 += v0;
    s1 += v1;
    q0 = Fma(v0, v0, q0);
    q1 = Fma(v1, v1, q1);
  }
  for (; e + L <= n; e += L) {
    Simd<T> v0 = Load(x + e);
    s0 += v0;
    q0 = Fma(v0, v0, q0);
  }
  T s = HSum<T>(s0 + s1), q = HSum<T>(q0 + q1);
  for (; e < n; ++e) {
    s += x[e];
    q = Fma(x[e], x[e], q);
  }
  *sum = s;
  *sumsq = q;
}

// y += a * x.
template <typename T>
inline void Axpy(T a, const T* x, T* y, int64_t n) {
  constexpr int L = kLanes<T>;
  const Simd<T> av = Splat(a);
  int64_t e = 0;
  for (; e + L <= n; e += L) Store(y + e, Fma(av, Load(x + e), Load(y + e)));
  for (; e < n; ++e) y[e] = Fma(a, x[e], y[e]);
}

// y += a * b elementwise.
template <typename T>
inline void MulAdd(const T* a, const T* b, T* y, int64_t n) {
  constexpr int L = kLanes<T>;
  int64_t e = 0;
  for (; e + L <= n; e += L) Store(y + e, Fma(Load(a + e), Load(b + e), Load(y + e)));
  for (; e < n; ++e) y[e] = Fma(a[e], b[e], y[e]);
}

// y = sum_j coef[j] * rows[j] for `count` rows of n elements at stride ld (rows[j] =
// base + j * ld). Overwrites y; count >= 1.
template <typename T>
inline void Combine(const T* coef, int count, const T* base, int64_t ld, int64_t n, T* y) {
  constexpr int L = kLanes<T>;
  int64_t e = 0;
  for (; e + 2 * L <= n; e += 2 * L) {
    Simd<T> a0 = {}, a1 = {};
    for (int j = 0; j < count; ++j) {
      const Simd<T> c = Splat(coef[j]);
      a0 = Fma(c, Load(base + j * ld + e), a0);
      a1 = Fma(c, Load(base + j * ld + e + L), a1);
    }
    Store(y + e, a0);
    Store(y + e + L, a1);
  }
  for (; e < n; ++e) {
    T s = 0;
    for (int j = 0; j < count; ++j) s = Fma(coef[j], base[j * ld + e], s);
    y[e] = s;
  }
}

// Micro-kernel of Project: RB rows x PB outputs over e in [0, K).
template <typename T, int RB, int PB>
inline void ProjectTile(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, T* y,
                        int64_t ldy) {
  constexpr int L = kLanes<T>;
  Simd<T> acc[RB][PB] = {};
  int64_t e = 0;
  for (; e + L <= K; e += L) {
    Simd<T> xv[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) xv[r] = Load(x + r * ldx + e);
#pragma GCC unroll 8
    for (int p = 0; p < PB; ++p) {
      const Simd<T> wv = Load(w + p * ldw + e);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) acc[r][p] = Fma(xv[r], wv, acc[r][p]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < PB; ++p) {
      T s = HSum<T>(acc[r][p]);
      for (int64_t t = e; t < K; ++t) s = Fma(x[r * ldx + t], w[p * ldw + t], s);
      y[r * ldy + p] += s;
    }
}

// y[r][p] += sum_e x[r*ldx + e] * w[p*ldw + e] for r < rows, p < P, e < K. y must be
// initialised by the caller (zero for a plain product). K is processed in chunks so that
// the rows' chunk and the weights' chunk stay in L2 across the tile loops.
template <typename T>
inline void Project(const T* x, int64_t ldx, int rows, const T* w, int64_t ldw, int P, int64_t K,
                    T* y, int64_t ldy) {
  constexpr int64_t kChunk = 1024;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t kc = std::min(kChunk, K - k0);
    constexpr int RB = kTileRows, PB = kTileOutputs;
    int r = 0;
    for (; r + RB <= rows; r += RB) {
      int p = 0;
      for (; p + PB <= P; p += PB)
        ProjectTile<T, RB, PB>(x + r * ldx + k0, ldx, w + p * ldw + k0, ldw, kc, y + r * ldy + p,
                               ldy);
      for (; p + 2 <= P; p += 2)
        ProjectTile<T, RB, 2>(x + r * ldx + k0, ldx, w + p * ldw + k0, ldw, kc, y + r * ldy + p,
                              ldy);
      for (; p < P; ++p)
        ProjectTile<T, RB, 1>(x + r * ldx + k0, ldx, w + p * ldw + k0, ldw, kc, y + r * ldy + p,
                              ldy);
    }
    for (; r < rows; ++r) {
      int p = 0;
      for (; p + PB <= P; p += PB)
        ProjectTile<T, 1, PB>(x + r * ldx + k0, ldx, w + p * ldw + k0, ldw, kc, y + r * ldy + p,
                              ldy);
      for (; p < P; ++p)
        ProjectTile<T, 1, 1>(x + r * ldx + k0, ldx, w + p * ldw + k0, ldw, kc, y + r * ldy + p,
                             ldy);
    }
  }
}

// w[p*ldw + e] += sum_r c[r*ldc + p] * x[r*ldx + e] for e in [e0, e1): the weight gradient
// of a projection. Rows are summed in index order, so splitting [0, K) across threads by
// e keeps the result independent of the thread count. Rows are ldx apart (often a power of
// two), so each row block's slice of x is first copied into a contiguous buffer; the sums
// then run with register accumulators for 4 outputs x one cache line of columns.
template <typename T>
inline void AccumulateOuter(const T* c, int64_t ldc, int rows, const T* x, int64_t ldx, int P,
                            int64_t e0, int64_t e1, T* w, int64_t ldw) {
  constexpr int L = kLanes<T>;
  constexpr int V = 2;
  constexpr int64_t EC = V * L;
  constexpr int kRowBlock = 256;
  T xs[kRowBlock * EC];
  int64_t e = e0;
  for (; e + EC <= e1; e += EC) {
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int rn = std::min(kRowBlock, rows - r0);
      for (int r = 0; r < rn; ++r) std::memcpy(xs + r * EC, x + (r0 + r) * ldx + e, sizeof(T) * EC);
      const T* cb = c + r0 * ldc;
      int p = 0;
      for (; p + 4 <= P; p += 4) {
        Simd<T> acc[4][V] = {};
        for (int r = 0; r < rn; ++r) {
          const Simd<T> x0 = Load(xs + r * EC), x1 = Load(xs + r * EC + L);
          const T* cr = cb + r * ldc + p;
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const Simd<T> cv = Splat(cr[i]);
            acc[i][0] = Fma(cv, x0, acc[i][0]);
            acc[i][1] = Fma(cv, x1, acc[i][1]);
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int v = 0; v < V; ++v)
            Store(w + (p + i) * ldw + e + v * L, Load(w + (p + i) * ldw + e + v * L) + acc[i][v]);
      }
      for (; p < P; ++p) {
        Simd<T> acc[V] = {};
        for (int r = 0; r < rn; ++r) {
          const Simd<T> cv = Splat(cb[r * ldc + p]);
          for (int v = 0; v < V; ++v) acc[v] = Fma(cv, Load(xs + r * EC + v * L), acc[v]);
        }
        for (int v = 0; v < V; ++v)
          Store(w + p * ldw + e + v * L, Load(w + p * ldw + e + v * L) + acc[v]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int64_t f = e; f < e1; ++f) {
      T s = 0;
      for (int r = 0; r < rows; ++r) s = Fma(c[r * ldc + p], x[r * ldx + f], s);
      w[p * ldw + f] += s;
    }
}

// ---------------------------------------------------------------------------------------
// Panel-packed weights. Rows of a P x K weight matrix are K apart in memory, so a kernel
// that walks P rows at the same column hits one cache set P times (K a power of two) and
// thrashes L1. Packing puts the P rows' lanes of one vector block side by side:
// packed[(b * P + p) * L + l] = w[p][b * L + l] (zero past K).

template <typename T>
inline int64_t PanelSize(int P, int64_t K) {
  constexpr int L = kLanes<T>;
  return (K + L - 1) / L * P * L;
}

template <typename T>
inline void PackPanels(const T* w, int64_t ldw, int P, int64_t K, T* packed) {
  constexpr int L = kLanes<T>;
  const int64_t blocks = (K + L - 1) / L;
  for (int64_t b = 0; b < blocks; ++b)
    for (int p = 0; p < P; ++p) {
      T* dst = packed + (b * P + p) * L;
      const int64_t e0 = b * L;
      const int64_t n = std::min<int64_t>(L, K - e0);
      std::memcpy(dst, w + p * ldw + e0, sizeof(T) * static_cast<size_t>(n));
      for (int64_t l = n; l < L; ++l) dst[l] = T(0);
    }
}

// x[r*ldx + e] += sum_p c[r*ldc + p] * w[p][e] with w panel-packed: the transpose of a
// mapping projection (the input gradients of the mapping projections).
template <typename T>
inline void ProjectTransposeAddPacked(const T* c, int64_t ldc, int rows, const T* packed, int P,
                                      int64_t K, T* x, int64_t ldx) {
  constexpr int L = kLanes<T>;
  constexpr int V = kTileVectors;
  const int64_t full = K / L;
  for (int r = 0; r < rows; r += 4) {
    const int rb = std::min(4, rows - r);
    int64_t b = 0;
    if (rb == 4) {
      for (; b + V <= full; b += V) {
        Simd<T> acc[4][V];
        for (int i = 0; i < 4; ++i)
          for (int v = 0; v < V; ++v) acc[i][v] = Load(x + (r + i) * ldx + (b + v) * L);
        for (int p = 0; p < P; ++p) {
          Simd<T> wv[V];
          for (int v = 0; v < V; ++v) wv[v] = Load(packed + ((b + v) * P + p) * L);
          for (int i = 0; i < 4; ++i) {
            const Simd<T> cv = Splat(c[(r + i) * ldc + p]);
            for (int v = 0; v < V; ++v) acc[i][v] = Fma(cv, wv[v], acc[i][v]);
          }
        }
        for (int i = 0; i < 4; ++i)
          for (int v = 0; v < V; ++v) Store(x + (r + i) * ldx + (b + v) * L, acc[i][v]);
      }
    }
    for (int i = 0; i < rb; ++i) {
      T* xr = x + (r + i) * ldx;
      const T* cr = c + (r + i) * ldc;
      for (int64_t f = b; f < full; ++f) {
        Simd<T> acc = Load(xr + f * L);
        for (int p = 0; p < P; ++p) acc = Fma(Splat(cr[p]), Load(packed + (f * P + p) * L), acc);
        Store(xr + f * L, acc);
      }
      for (int64_t e = full * L; e < K; ++e) {
        T s = xr[e];
        for (int p = 0; p < P; ++p) s = Fma(cr[p], packed[(full * P + p) * L + (e - full * L)], s);
        xr[e] = s;
      }
    }
  }
}

// dw[p*ldw + e] += sum_r c[r*ldc + p] * x[r*ldx + e] over all e in [0, K), split over e
// across the OpenMP threads (each e owned by one thread: deterministic for any count).
template <typename T>
inline void ParallelWeightGrad(const T* c, int64_t ldc, int rows, const T* x, int64_t ldx, int P,
                               int64_t K, T* dw, int64_t ldw) {
  constexpr int64_t kSlice = 256;
  const int64_t slices = (K + kSlice - 1) / kSlice;
#pragma omp parallel for schedule(static) if (static_cast <int64_t>(rows) * K >= (1 << 15))
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t e0 = s * kSlice;
    AccumulateOuter(c, ldc, rows, x, ldx, P, e0, std::min(K, e0 + kSlice), dw, ldw);
  }
}

// ---------------------------------------------------------------------------------------
// Projection of many rows onto few outputs (the mapping logits of all tokens: P = 20..80
// outputs over K = kC..NC inputs). A general GEMM packs the large operand (the state) and
// runs at about half its square-matrix rate on such skinny shapes; here the small operand
// is packed instead, transposed, in K chunks that stay in L1/L2 while every row streams
// through once: wt[e * Ppad + p] = w[p][e], P padded with zeros to Ppad = a multiple of
// the vector width.

template <typename T>
inline int PaddedOutputs(int P) {
  return (P + kLanes<T> - 1) / kLanes<T> * kLanes<T>;
}

// Packs the P x K matrix w (rows ldw apart) into wt (K x Ppad).
template <typename T>
inline void PackTransposed(const T* w, int64_t ldw, int P, int64_t K, T* wt) {
  const int Ppad = PaddedOutputs<T>(P);
  constexpr int64_t kBlock = 64;
  for (int64_t e0 = 0; e0 < K; e0 += kBlock) {
    const int64_t e1 = std::min(K, e0 + kBlock);
    for (int64_t e = e0; e < e1; ++e)
      for (int p = P; p < Ppad; ++p) wt[e * Ppad + p] = T(0);
    for (int p = 0; p < P; ++p)
      for (int64_t e = e0; e < e1; ++e) wt[e * Ppad + p] = w[p * ldw + e];
  }
}

// Two rows x V vectors of outputs over e in [e0, e1); accumulates into z (rows ldz apart).
template <typename T, int R, int V>
inline void ProjectRowsTile(const T* x, int64_t ldx, const T* wt, int Ppad, int v0, int64_t e0,
                            int64_t e1, T* z, int64_t ldz) {
  constexpr int L = kLanes<T>;
  Simd<T> acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = Load(z + r * ldz + (v0 + v) * L);
  const T* wp = wt + v0 * L;
  for (int64_t e = e0; e < e1; ++e) {
    Simd<T> wv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      wv[v] = Load(wp + e * Ppad + v * L);
      // Keep the weights in registers for all R rows (GCC would otherwise fold the load
      // into each row's FMA: R loads per weight vector, and the loop becomes load-bound).
      asm("" : "+x"(wv[v]));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const Simd<T> b = Splat(x[r * ldx + e]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(b, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(z + r * ldz + (v0 + v) * L, acc[r][v]);
}

// z[r * ldz + p] = sum_e x[r * ldx + e] * w[p][e] for r < rows, p < Ppad (overwrites; the
// padded outputs come out 0), with wt = PackTransposed(w). Each output is summed over e in
// index order whatever the row range, so splitting rows across threads does not change
// results.
template <typename T>
inline void ProjectRows(const T* x, int64_t ldx, int rows, const T* wt, int Ppad, int64_t K, T* z,
                        int64_t ldz) {
  constexpr int L = kLanes<T>;
  const int nv = Ppad / L;
  // K chunks keep the chunk of wt (kc x Ppad, 64 KiB) in L2 while a block of rows passes;
  // the rows' chunks stream from memory once. Row blocks bound the re-reads of wt.
  constexpr int kRowBlock = 256;
  const int64_t kc = std::max<int64_t>(8, int64_t{65536} / static_cast<int64_t>(sizeof(T)) / Ppad);
  for (int rb = 0; rb < rows; rb += kRowBlock) {
    const int rn = std::min(kRowBlock, rows - rb);
    const T* xb = x + rb * ldx;
    T* zb = z + rb * ldz;
    for (int r = 0; r < rn; ++r) std::fill(zb + r * ldz, zb + r * ldz + Ppad, T(0));
    for (int64_t e0 = 0; e0 < K; e0 += kc) {
      const int64_t e1 = std::min(K, e0 + kc);
      // Rows in pairs; an odd last row runs the same pair tile on itself (row stride 0),
      // so every row's outputs come from the same instruction sequence, whatever the split.
      for (int r = 0; r < rn; r += 2) {
        const int64_t lx = r + 1 < rn ? ldx : 0, lz = r + 1 < rn ? ldz : 0;
        const T* xr = xb + r * ldx;
        T* zr = zb + r * ldz;
        int v = 0;
        for (; v + 4 <= nv; v += 4) ProjectRowsTile<T, 2, 4>(xr, lx, wt, Ppad, v, e0, e1, zr, lz);
        if (v + 3 == nv) {
          ProjectRowsTile<T, 2, 3>(xr, lx, wt, Ppad, v, e0, e1, zr, lz);
          v += 3;
        }
        for (; v + 2 <= nv; v += 2) ProjectRowsTile<T, 2, 2>(xr, lx, wt, Ppad, v, e0, e1, zr, lz);
        for (; v < nv; ++v) ProjectRowsTile<T, 2, 1>(xr, lx, wt, Ppad, v, e0, e1, zr, lz);
      }
    }
  }
}

// c = alpha * op(a) * op(b) + beta * c (row-major, cpu::GemmSerial's contract) for the
// mapping projections of all tokens at once: OpenBLAS's packed kernels run 3-4x faster
// than the per-token-block Project tiles above. With `parallel`, the rows of c (or its
// columns when m < n) are split over the OpenMP threads in fixed blocks of 16, as
// cpu::Gemm does; unlike cpu::Gemm this is not added to cpu::GemmSeconds() (the model's
// timing counts the residual component's time as its own). Each element is reduced by one
// kernel call: deterministic for a fixed thread count. Call outside a parallel region.
template <typename T>
inline void BatchGemm(bool parallel, bool trans_a, bool trans_b, int m, int n, int k, T alpha,
                      const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (!parallel) {
    cpu::GemmSerial<T>(trans_a, trans_b, m, n, k, alpha, a, static_cast<int>(lda), b,
                       static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
    return;
  }
  const bool by_rows = m >= n;
#pragma omp parallel
  {
    const int threads = omp_get_num_threads();
    const int t = omp_get_thread_num();
    const int extent = by_rows ? m : n;
    const int blocks = (extent + 15) / 16;
    const int b0 = static_cast<int>(static_cast<int64_t>(blocks) * t / threads) * 16;
    const int b1 =
        std::min(extent, static_cast<int>(static_cast<int64_t>(blocks) * (t + 1) / threads) * 16);
    if (b1 > b0) {
      if (by_rows) {
        const T* a0 = trans_a ? a + b0 : a + b0 * lda;
        cpu::GemmSerial<T>(trans_a, trans_b, b1 - b0, n, k, alpha, a0, static_cast<int>(lda), b,
                           static_cast<int>(ldb), beta, c + b0 * ldc, static_cast<int>(ldc));
      } else {
        const T* b_0 = trans_b ? b + b0 * ldb : b + b0;
        cpu::GemmSerial<T>(trans_a, trans_b, m, b1 - b0, k, alpha, a, static_cast<int>(lda), b_0,
                           static_cast<int>(ldb), beta, c + b0, static_cast<int>(ldc));
      }
    }
  }
}

}  // namespace rackrun::runtime::residual_internal

#endif  // RACKRUN_RUNTIME_RESIDUAL_KERNELS_H_
