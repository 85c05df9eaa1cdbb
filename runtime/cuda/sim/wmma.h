// The CUDA simulator's warp matrix operations (tests only; README.md here): the subset of
// CUDA's `nvcuda::wmma` (mma.h) that the engine's tensor-core kernels use, for a .cu file
// compiled as plain C++ (RACKRUN_CUDA_SIM).
//
// Contract:
// - fragment<matrix_a, M, N, K, T, Layout>, fragment<matrix_b, ...>, fragment<accumulator,
//   M, N, K, float>: m16n16k16 with T = __nv_bfloat16 and m16n16k8 with T =
//   precision::tf32 (elements stored as float), as on sm_80+; fill_fragment,
//   load_matrix_sync, store_matrix_sync, mma_sync and __float_to_tf32 (round to nearest,
//   ties away from zero, as cvt.rna) with CUDA's signatures. mma_sync reads a tf32 operand
//   as the tensor cores do: its low 13 mantissa bits ignored (a kernel rounds first).
// - CUDA leaves the mapping of a fragment's elements to lanes unspecified; here every lane
//   holds the whole tile (x[], num_elements = rows x columns), so code may only apply the
//   same operation to every element, as on a GPU.
// - A load or store names a pointer CUDA requires 256-bit aligned and a leading dimension
//   that is a multiple of 16 bytes: anything else stops the program (on a GPU it is
//   undefined behaviour).
// - No implicit barrier: a lane loads what is in memory when it gets there, so a kernel
//   that reads a tile other lanes wrote needs its __syncwarp, as on a GPU. mma_sync
//   multiplies in float, summing over k in order (a GPU's order and internal precision
//   differ; the products of bf16 or tf32 values are exact in float either way).
#ifndef RACKRUN_RUNTIME_CUDA_SIM_WMMA_H_
#define RACKRUN_RUNTIME_CUDA_SIM_WMMA_H_

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace nvcuda::wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };
namespace precision {
struct tf32 {};
}  // namespace precision

// Round to tf32 (10 mantissa bits): to nearest, ties away from zero (cvt.rna.tf32.f32).
inline float __float_to_tf32(float in) {
  uint32_t bits;
  std::memcpy(&bits, &in, sizeof(bits));
  if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & 0xffffe000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

namespace detail {

template <typename Use, int M, int N, int K>
struct Shape;
template <int M, int N, int K>
struct Shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

[[noreturn]] inline void Refuse(const char* what) {
  std::fprintf(stderr, "CUDA simulator: wmma: %s (undefined behaviour on a GPU)\n", what);
  std::fflush(stderr);
  std::abort();
}

template <typename T>
void CheckAccess(const T* p, unsigned ldm) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) Refuse("a pointer that is not 256-bit aligned");
  if ((ldm * sizeof(T)) % 16 != 0) Refuse("a leading dimension that is not a multiple of 16 bytes");
}

// What a fragment of element type T stores.
template <typename T>
struct Storage {
  using type = T;
};
template <>
struct Storage<precision::tf32> {
  using type = float;
};

// An operand as the tensor cores read it: bf16 exactly, tf32 without its low 13 bits.
inline float Operand(__nv_bfloat16 v, bool) { return __bfloat162float(v); }
inline float Operand(float v, bool tf32) {
  if (!tf32) return v;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits &= 0xffffe000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && (K == 16 || K == 8), "the simulator has m16n16k16/k8 only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : (K == 16 ? std::is_same_v<T, __nv_bfloat16>
                                                            : std::is_same_v<T, precision::tf32>),
                "the simulator has bf16 (k16) and tf32 (k8) operands with float accumulators");

 public:
  using element_type = typename detail::Storage<T>::type;
  static constexpr bool tf32 = std::is_same_v<T, precision::tf32>;
  static constexpr int rows = detail::Shape<Use, M, N, K>::rows;
  static constexpr int cols = detail::Shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  element_type x[num_elements];  // row-major (the simulator's own mapping; see the header)

  element_type& at(int r, int c) { return x[r * cols + c]; }
  const element_type& at(int r, int c) const { return x[r * cols + c]; }
};

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f,
                   const typename fragment<Use, M, N, K, T, Layout>::element_type& v) {
  for (auto& e : f.x) e = v;
}

// Operand tiles: the layout is the fragment's.
template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f,
                      const typename fragment<Use, M, N, K, T, Layout>::element_type* p,
                      unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "an accumulator load names its layout");
  detail::CheckAccess(p, ldm);
  constexpr bool row = std::is_same_v<Layout, row_major>;
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.cols; ++c) f.at(r, c) = row ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  detail::CheckAccess(p, ldm);
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.cols; ++c)
      f.at(r, c) = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  detail::CheckAccess(p, ldm);
  for (int r = 0; r < f.rows; ++r)
    for (int c = 0; c < f.cols; ++c)
      (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.at(r, c);
}

// d = a b + c (d may be c).
template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  fragment<accumulator, M, N, K, float> out;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = c.at(m, n);
      for (int k = 0; k < K; ++k) {
        acc += detail::Operand(a.at(m, k), a.tf32) * detail::Operand(b.at(k, n), b.tf32);
      }
      out.at(m, n) = acc;
    }
  d = out;
}

}  // namespace nvcuda::wmma

#endif  // RACKRUN_RUNTIME_CUDA_SIM_WMMA_H_
