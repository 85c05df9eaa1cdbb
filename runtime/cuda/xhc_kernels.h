// Launchers of the xhc stream kernels (runtime/cuda/xhc_kernels.cu), used by XhcStreams
// (runtime/cuda/xhc.h), which owns the buffers and the GEMMs between them. Each mirrors a
// stage of the CPU engine's runtime/residual/xhc.cc, named beside it; the record layouts
// are the CPU's (Group::Rec, Sublayer::Coef) so the two read alike.
//
// Shapes the kernels support (XhcStreams validates them): N <= 32 streams, k <= 4 active,
// J <= 3 convolutions of at most 32 taps, C <= 4096, groups of g <= 4 sublayers (xhc g = 1,
// xhc_flash 2, xhc_flash4 4). S is the state's element type (float or __nv_bfloat16);
// coefficients, u, out and the state gradient are fp32.
#ifndef RACKRUN_RUNTIME_CUDA_XHC_KERNELS_H_
#define RACKRUN_RUNTIME_CUDA_XHC_KERNELS_H_

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

// Layout's accessors run on the host and in the kernels.
#if defined(__CUDACC__)
#define RACKRUN_HOST_DEVICE __host__ __device__
#else
#define RACKRUN_HOST_DEVICE
#endif

namespace rackrun::runtime::cuda::xhc {

inline constexpr int kMaxN = 32;
inline constexpr int kMaxK = 4;
inline constexpr int kMaxG = 4;
inline constexpr int kMaxJ = 3;
inline constexpr int kMaxKr = kMaxJ + 1;
inline constexpr int kMaxTaps = 32;
inline constexpr int kMaxWidth = 4096;
inline constexpr int kMaxSinkhornN = 8;
inline constexpr float kNormEps = 1e-6f;
inline constexpr float kGramSchmidtEps = 1e-6f;
inline constexpr float kSinkhornEps = 1e-6f;

// Record layouts (floats per token), as the CPU's XhcImpl with group size g (1: xhc; 2, 4:
// the flash schedules). A Layout describes one sublayer: s is its position in its group and
// mix whether it mixes with H_res (the group's last sublayer).
struct Layout {
  int N = 0, C = 0, k = 0, m = 0, Kr = 1, J = 0;
  int iters = 20;
  int g = 1, s = 0;
  bool mix = true;
  // Group record: mu, sd, rms, gates[k], router logits yr[N], pre logits ypre[g][N],
  // H_pre[g][N].
  RACKRUN_HOST_DEVICE int RecStride() const { return 3 + k + N + 2 * g * N; }
  static constexpr int kMu = 0, kSd = 1, kRms = 2, kGate = 3;
  RACKRUN_HOST_DEVICE int YrOff() const { return 3 + k; }
  RACKRUN_HOST_DEVICE int YpreOff(int at) const { return 3 + k + N + at * N; }
  RACKRUN_HOST_DEVICE int HpreOff(int at) const { return 3 + k + N + g * N + at * N; }
  RACKRUN_HOST_DEVICE int YpreOff() const { return YpreOff(s); }
  RACKRUN_HOST_DEVICE int HpreOff() const { return HpreOff(s); }
  // Group-entry projections per token: router rows then every sublayer's pre rows.
  RACKRUN_HOST_DEVICE int P1() const { return N + g * N; }
  // Sublayer coefficients: ra, q[P2] (scaled by 1/ra), H_res[k*k] (unused without mixing),
  // H_post[k*Kr].
  RACKRUN_HOST_DEVICE int P2() const { return (mix ? k * k : 0) + k * Kr; }
  // Offset of the H_post logits in q.
  RACKRUN_HOST_DEVICE int PostQ() const { return mix ? k * k : 0; }
  // Row stride of c2 (the active logits' gradients): P2 rounded up to 8 elements, so its bf16
  // copy's rows stay 16-byte aligned for the tensor-core GEMM dW2 += c2^T A.
  RACKRUN_HOST_DEVICE int C2Stride() const { return (P2() + 7) / 8 * 8; }
  RACKRUN_HOST_DEVICE int CoefStride() const { return 1 + P2() + k * k + k * Kr; }
  static constexpr int kRa = 0, kQ = 1;
  RACKRUN_HOST_DEVICE int HresOff() const { return 1 + P2(); }
  RACKRUN_HOST_DEVICE int HpostOff() const { return 1 + P2() + k * k; }
  // Saved rows per token: A (k rows) then out (O's first row), C each, in S. An MLP
  // sublayer's other basis rows (its convolutions after Gram-Schmidt) are not kept: the
  // backward computes them again from the saved out rows (RebuildBasis) into scratch that the
  // sublayers share, Kr - 1 rows a token fewer per MLP sublayer.
  RACKRUN_HOST_DEVICE int64_t SavedStride() const { return static_cast<int64_t>(k + 1) * C; }
  // Per-token scalar-parameter gradients of the write (a_res, b_res[kk], a_post,
  // b_post[k*Kr]; the first 1 + k*k stay 0 without mixing) and of the read (a_pre, b_pre[N]).
  RACKRUN_HOST_DEVICE int WriteScalStride() const { return 2 + k * k + k * Kr; }
  RACKRUN_HOST_DEVICE int ReadScalStride() const { return 1 + N; }
};

// Scalar parameters one kernel reads (device pointers into the parameter buffer).
struct MapParams {
  const float* a_pre = nullptr;
  const float* b_pre = nullptr;  // N
  // Every sublayer's a_pre and b_pre in the group (ReadEntry computes all their H_pre).
  const float* group_a_pre[kMaxG] = {};
  const float* group_b_pre[kMaxG] = {};
  const float* a_res = nullptr;  // null without mixing
  const float* b_res = nullptr;  // k x k
  const float* a_post = nullptr;
  const float* b_post = nullptr;  // k x Kr
  const float* conv[kMaxJ] = {};  // taps x C each
  int conv_taps[kMaxJ] = {};
};

// colsum[p] = sum of router row p (N rows of N*C): the LayerNorm centring.
cudaError_t RouterColumnSums(const Layout& l, const float* w_router, float* colsum,
                             cudaStream_t stream);

// Read at a group's entry (EntryToken + dense read + GatherActive): per token, moments of the
// N x C state, routing, gates, the H_pre of every sublayer of the group (p.group_a_pre /
// group_b_pre); u = sum_i H_pre_i x_i; the k active rows into `saved` and ra; for g > 1 the
// non-active bases of the later sublayers, base[t][s-1] = sum_(i not in I) H_pre^s_i x_i
// (tokens x (g-1) x C; null for g = 1). z: tokens x P1 projections (router rows then every
// sublayer's pre rows) of the raw state.
template <typename S>
cudaError_t ReadEntry(const Layout& l, int64_t tokens, const S* x, const float* z,
                      const float* colsum, const MapParams& p, float* rec, int32_t* idx, float* u,
                      float* base, S* saved, float* coef, cudaStream_t stream);
// Read of a later sublayer s > 0 of a flash group (XhcImpl::BaseToken + GatherActive):
// u = base_s + sum_j H_pre^s_(I_j) A_(s-1),j from the current active rows of x; those rows
// into `saved` (A_(s-1)) and ra. rec and idx are the group's (written by ReadEntry).
template <typename S>
cudaError_t ReadBase(const Layout& l, int64_t tokens, const S* x, const float* base,
                     const float* rec, const int32_t* idx, float* u, S* saved, float* coef,
                     cudaStream_t stream);
// ActiveMaps: q (tokens x P2, the raw active projections) -> coef's q / ra, H_res (Sinkhorn,
// row clamp; only when l.mix), H_post.
cudaError_t ActiveMaps(const Layout& l, int64_t tokens, const float* q, const MapParams& p,
                       float* coef, cudaStream_t stream);
// Write (FusedWriteBack): the basis O (MLP: causal convolutions + modified Gram-Schmidt), its
// first row (out) saved after A, then the k active rows of x mixed (l.mix; otherwise kept)
// and written back in place.
// segment: per token, the first token of its segment.
template <typename S>
cudaError_t Write(const Layout& l, int64_t tokens, const float* out, const int32_t* segment,
                  const MapParams& p, const float* rec, const int32_t* idx, const float* coef, S* x,
                  S* saved, cudaStream_t stream);

// WriteBackward per token: FusedWriteBackBackward, gate and H_post gradients, Gram-Schmidt
// backward (MLP), the Sinkhorn and row-clamp backward (l.mix), ActiveMapsBackward. Writes dA
// (tokens x kC, fp32, including RMSNorm(vec A)'s direct term), d_out (tokens x C), dg
// (MLP: tokens x J x C), c2 (tokens x C2Stride(), divided by ra), wscal; adds the gate
// gradients to dp (tokens x k: a flash group's sublayers accumulate into it; the caller zeroes
// it before the group's last sublayer).
// `tape`: tokens x SinkhornTapeFloats(l) floats of scratch (the recomputed Sinkhorn).
// `basis`: MLP (l.J > 0), RebuildBasis's rows; otherwise unused (may be null).
int64_t SinkhornTapeFloats(int n, int iters);
template <typename S>
cudaError_t WriteBackward(const Layout& l, int64_t tokens, const float* dx, const S* saved,
                          const S* basis, const int32_t* segment, const MapParams& p,
                          const float* rec, const int32_t* idx, const float* coef, float* da,
                          float* d_out, float* dg, float* dp, float* c2, float* wscal, float* tape,
                          cudaStream_t stream);
// RebuildBasis (MLP, l.J > 0; nothing otherwise): an MLP sublayer's basis rows 1..J
// (tokens x J x C, in S) from its saved out rows, as Write computed them from the body output
// (the same code, on the same values for an fp32 state), for WriteBackward.
template <typename S>
cudaError_t RebuildBasis(const Layout& l, int64_t tokens, const S* saved, const int32_t* segment,
                         const MapParams& p, S* basis, cudaStream_t stream);
// ScatterActiveGrad: dX rows I = dA; x rows I = A (the state walked back).
template <typename S>
cudaError_t ScatterActive(const Layout& l, int64_t tokens, const float* da, const S* saved,
                          const int32_t* idx, float* dx, S* x, cudaStream_t stream);
// ConvolutionsBackward: d_out += the convolutions' input gradients (from dg); the weight
// gradients accumulated into dconv (the J convolutions' gradients, adjacent: taps_j x C each,
// in order) through `partial` (ConvPartialFloats).
int64_t ConvPartialFloats(const Layout& l, int64_t tokens, const int* taps);
template <typename S>
cudaError_t ConvolutionsBackward(const Layout& l, int64_t tokens, const float* dg, const S* saved,
                                 const int32_t* segment, const MapParams& p, float* d_out,
                                 float* dconv, float* partial, cudaStream_t stream);
// ReadBackward per token: DenseReadBackward over the current rows (dx += H_pre^s du; the
// H_pre^s logit gradients into dypre[t][s], tokens x g x N, and rscal), then at a group's
// entry (l.s == 0) EntryTokenBackward over the whole group: c1 (tokens x P1, divided by the
// norm scales) and dx += alpha x + beta.
template <typename S>
cudaError_t ReadBackward(const Layout& l, int64_t tokens, const S* x, const float* du,
                         const float* dp, const float* colsum, const MapParams& p, const float* rec,
                         const int32_t* idx, float* dx, float* dypre, float* c1, float* rscal,
                         cudaStream_t stream);
// The two sums over tokens below run in chunks of tokens (reduce.cuh's ColumnSums: a fixed
// order, so results repeat bit for bit); `partial` holds ColumnSumPartialFloats(tokens,
// columns) floats (N columns for the centring, `count` for SumScalars).
int64_t ColumnSumPartialFloats(int64_t tokens, int columns);
// LayerNorm centring of the router rows' gradient: dW_r[p][e] -= sum_t c1[t][p] mu_t
// (c1 rows P1 apart; corr: N floats).
cudaError_t RouterCentring(const Layout& l, int64_t tokens, const float* c1, const float* rec,
                           float* dw_router, float* corr, float* partial, cudaStream_t stream);
// grads[s] += sum over tokens of scal[t * stride + s], s < count: the scalar parameters of a
// sublayer are adjacent in the parameter buffer in the order of the per-token records
// (a_res, b_res, a_post, b_post; a_pre, b_pre).
cudaError_t SumScalars(int64_t tokens, int stride, int count, const float* scal, float* grads,
                       float* partial, cudaStream_t stream);

// ---- hc and mhc (docs/design.md 5.2, 5.3; the CPU's HcImpl and MhcImpl in
// runtime/residual/hyper_connections.cc): every sublayer reads, mixes and writes the full
// N x C state, N <= kDenseMaxN (above 8 streams the maps are a warp's work, mhc's Sinkhorn a
// lane per row, and the write's backward goes through shared-memory tiles). The record
// layouts are the CPU's (MapLayout).
inline constexpr int kDenseMaxN = 16;  // the CPU's limit for hc and mhc
struct DenseLayout {
  bool hc = false;  // hc; mhc otherwise
  int N = 0, C = 0, iters = 20;
  // Projection outputs per projected row: hc [m | r (N) | b] per stream (N rows of C per
  // token); mhc [pre (N) | post (N) | res (N*N)] (one row of N*C per token).
  RACKRUN_HOST_DEVICE int P() const { return hc ? N + 2 : 2 * N + N * N; }
  RACKRUN_HOST_DEVICE int Rows() const { return hc ? N : 1; }
  // Coefficient record per token: hc per stream r_s, y_s[P], then A_m (N), A_r (N*N), B (N);
  // mhc r, y[P], H_pre (N), H_post (N), H_res (N*N).
  RACKRUN_HOST_DEVICE int CoefStride() const {
    return (hc ? N * (1 + P()) : 1 + P()) + 2 * N + N * N;
  }
  RACKRUN_HOST_DEVICE int Pre() const { return hc ? N * (1 + P()) : 1 + P(); }
  RACKRUN_HOST_DEVICE int Post() const { return hc ? Pre() + N + N * N : Pre() + N; }
  RACKRUN_HOST_DEVICE int Res() const { return hc ? Pre() + N : Pre() + 2 * N; }
  // H_res[i][j] (the weight of input stream j in output stream i) at Res() + i * ResRow() +
  // j * ResCol(): hc stores A_r = H_res^T.
  RACKRUN_HOST_DEVICE int ResRow() const { return hc ? 1 : N; }
  RACKRUN_HOST_DEVICE int ResCol() const { return hc ? N : 1; }
  // The write's backward record per token: dH_post (N), then dH_res in H_res's layout.
  RACKRUN_HOST_DEVICE int DcoefStride() const { return N + N * N; }
  // Per-token scalar-parameter gradients: hc s_a, s_b, A_m0 (N), B0 (N), A_r0 (N*N); mhc
  // a_pre, a_post, a_res, b_pre (N), b_post (N), b_res (N*N).
  RACKRUN_HOST_DEVICE int ScalStride() const { return (hc ? 2 : 3) + 2 * N + N * N; }
};
// MapParams for hc: a_pre = s_a, a_post = s_b, b_pre = A_m0, b_res = A_r0, b_post = B0; for
// mhc its own fields.

// DenseRead per token: the RMS norms (hc per stream, mhc of vec X), the maps from z (tokens x
// Rows() x P: the projections) into coef (mhc's H_res by Sinkhorn), u = sum_j H_pre_j x_j,
// the state copied to `saved` (tokens x N x C).
template <typename S>
cudaError_t DenseRead(const DenseLayout& l, int64_t tokens, const S* x, const float* z,
                      const MapParams& p, float* coef, float* u, S* saved, cudaStream_t stream);
// DenseWrite: X' = H_res X + H_post^T out in place; out copied to out_saved (tokens x C).
template <typename S>
cudaError_t DenseWrite(const DenseLayout& l, int64_t tokens, const float* out, const float* coef,
                       S* x, float* out_saved, cudaStream_t stream);
// DenseWriteBackward per token (G = dx): d_out = sum_i H_post_i G_i; dcoef = <G_i, out>, then
// <G_i, x_j> in H_res's layout; dx := H_res^T G.
template <typename S>
cudaError_t DenseWriteBackward(const DenseLayout& l, int64_t tokens, const S* saved,
                               const float* out_saved, const float* coef, float* dx, float* d_out,
                               float* dcoef, cudaStream_t stream);
// Floats of DenseReadBackward's Sinkhorn scratch per token (mhc): up to 8 streams every
// iteration's matrix (SinkhornTapeFloats), above 8 its column and row sums (2 N per
// iteration: the warp's backward recovers the matrices from them).
int64_t DenseTapeFloats(const DenseLayout& l);

// DenseReadBackward per token: dH_pre_j = <du, x_j>; dx_j += H_pre_j du + alpha_j x_j (the
// norms' terms); the maps' logit gradients (mhc: the Sinkhorn recomputed with `tape`, tokens x
// DenseTapeFloats(l)): c (tokens x Rows() x P, divided by the norms) and scal
// (tokens x ScalStride()).
template <typename S>
cudaError_t DenseReadBackward(const DenseLayout& l, int64_t tokens, const S* saved, const float* du,
                              const float* coef, const float* dcoef, const MapParams& p, float* dx,
                              float* c, float* scal, float* tape, cudaStream_t stream);

// Collapse: y[t] = sum of the N streams; CollapseBackward: every stream's gradient = dy[t].
template <typename S>
cudaError_t Collapse(const Layout& l, int64_t tokens, const S* x, float* y, cudaStream_t stream);
cudaError_t CollapseBackward(const Layout& l, int64_t tokens, const float* dy, float* dx,
                             cudaStream_t stream);

// Sinkhorn (runtime/residual/sinkhorn.h) on `count` n x n matrices: h = Sinkhorn(z), and
// when dh is not null dz = its backward. For tests of the device function alone.
// `tape`: count x SinkhornTapeFloats(n, iters) floats. n <= kDenseMaxN: a thread per matrix up to
// kMaxSinkhornN, a warp per matrix above (the dense hc/mhc kernels' two forms).
cudaError_t SinkhornBatch(int count, int n, int iters, const float* z, float* h, const float* dh,
                          float* dz, float* tape, cudaStream_t stream);

}  // namespace rackrun::runtime::cuda::xhc

#endif  // RACKRUN_RUNTIME_CUDA_XHC_KERNELS_H_
