// xhc, xhc_flash and xhc_flash4 (docs/design.md sections 5.4, 5.5) as one schedule with a
// group size g: g = 1 is xhc (every sublayer routes, reads densely and mixes), g = 2 and
// g = 4 are the flash schedules (routing and pre-mappings from the group-entry state,
// mixing only in the group's last sublayer).
//
// Choices where the design leaves detail open (and the tests pin them):
//  - LayerNorm and RMSNorm have no learned gain or bias; eps = 1e-6 inside the sqrt.
//  - TopK ties go to the lower stream index.
//  - Gram-Schmidt is the modified (sequential) form; denominators are <v,v> + 1e-6.
//  - The active block of a flash group lives in the state's active rows (updated in
//    place), so the group's final scatter is free.
//  - Flash pre-mappings for sublayer s read the current active rows A_(s-1) and the
//    group-entry non-active rows through base_s; the H_post of each sublayer comes from
//    RMSNorm(vec A_(s-1)), H_res (last sublayer only) from the same.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "runtime/residual/kernels.h"
#include "runtime/residual/residual_impl.h"
#include "runtime/residual/sinkhorn.h"

namespace rackrun::runtime {

namespace {

using residual_internal::Axpy;
using residual_internal::BatchGemm;
using residual_internal::Combine;
using residual_internal::Dot;
using residual_internal::kNormEps;
using residual_internal::Moments;
using residual_internal::MulAdd;
using residual_internal::PackPanels;
using residual_internal::PackTransposed;
using residual_internal::PaddedOutputs;
using residual_internal::PanelSize;
using residual_internal::ProjectRows;
using residual_internal::ProjectTransposeAddPacked;
using residual_internal::RmsOf;
using residual_internal::Sigmoid;

constexpr double kGramSchmidtEps = 1e-6;
constexpr int kTokenBlock = 8;
// A block's Sinkhorns run as one batch.
static_assert(kTokenBlock <= SinkhornProjection<float>::kBatch);
// Limits that keep per-token coefficient arrays on the stack (checked by Validate).
constexpr int kMaxN = 64;
constexpr int kMaxK = 16;
constexpr int kMaxKr = 8;
constexpr int64_t kRowPad = 16;  // elements: one cache line of float (two of double)
// Tiles of the write-back backward's fused pass (elements; a multiple of every vector
// width) and the row stride of their scratch copies.
constexpr int64_t kTile = 256;
constexpr int64_t kTileRow = kTile + kRowPad;

// ---- Fused write-back (WriteOutput), one token at a time ----
// The MLP basis O = [out, v_1 .. v_J] (causal depthwise convolutions, then modified
// Gram-Schmidt) and the write-back x_j = sum_i H_res[j][i] a_i + sum_r p_j H_post[j][r] o_r
// (or x_j += sum_r ... without mixing): the convolutions one pass per tap (as MulAdd),
// then 1 + J fused passes over C: the first takes <v_j, o_0> and |o_0|^2; pass i subtracts
// c_(m,i) o_i from every later row m and accumulates |o_(i+1)|^2 and <v_m, o_(i+1)>, so
// row i+1 is final at the end of it; the last pass finishes row J and writes the k stream
// rows back in place (each element's k inputs are loaded before any of its outputs is
// stored). Per element the arithmetic is that of the sequential form (convolution taps in
// order, v - c o_i, the write-back terms in order); only the dot products are summed in
// another order.
template <typename T, typename V>
inline V Ld(const T* p) {
  if constexpr (std::is_same_v<T, V>) {
    return *p;
  } else {
    return residual_internal::Load<T>(p);
  }
}
template <typename T, typename V>
inline void St(T* p, V v) {
  if constexpr (std::is_same_v<T, V>) {
    *p = v;
  } else {
    residual_internal::Store<T>(p, v);
  }
}
template <typename T, typename V>
inline V Bc(T s) {
  if constexpr (std::is_same_v<T, V>) {
    return s;
  } else {
    return residual_internal::Splat<T>(s);
  }
}
template <typename T, typename V>
inline T Total(V v) {
  if constexpr (std::is_same_v<T, V>) {
    return v;
  } else {
    return residual_internal::HSum<T>(v);
  }
}

// y = sum_i w[i * ldw] * x[-i * ldx] (n elements; taps in order, one pass each, as
// MulAdd). Shared by the forward and the backward's recomputation, so they agree bitwise.
template <typename T>
inline void ConvRow(const T* w, int64_t ldw, const T* x, int64_t ldx, int taps, int64_t n, T* y) {
  std::fill(y, y + n, T(0));
  for (int i = 0; i < taps; ++i) residual_internal::MulAdd(w + i * ldw, x - i * ldx, y, n);
}

// Calls step.template operator()<V>(e) for every vector of n elements, then for the
// scalar tail with V = T.
template <typename T, typename Step>
inline void ForElements(int64_t n, Step&& step) {
  constexpr int L = residual_internal::kLanes<T>;
  int64_t e = 0;
  for (; e + L <= n; e += L) step.template operator()<residual_internal::Simd<T>>(e);
  for (; e < n; ++e) step.template operator()<T>(e);
}

// The operands of one token's write-back.
template <typename T>
struct WriteBackArgs {
  int64_t C = 0;
  int k = 0;                // active rows
  int Kr = 1;               // basis rows
  int J = 0;                // convolutions (MLP; 0 otherwise)
  T* x[kMaxK] = {};         // the k stream rows, updated in place
  const T* mix = nullptr;   // k x k H_res (mixing) or null (x_j += ...)
  const T* post = nullptr;  // k x Kr: p_j H_post[j][r]
  const T* out = nullptr;   // the sublayer output of this token (C)
  T* o = nullptr;           // Kr x C: the basis (written when J > 0 or save_o0)
  int64_t ldo = 0;          // its row stride
  bool save_o0 = false;     // store o_0 = out into o (attention rows saved for backward)
  // Convolution j: taps[j] valid taps, weights w[j] + i * C, inputs out - i * C (the
  // outputs of the previous tokens of the segment).
  int taps[kMaxKr] = {};
  const T* w[kMaxKr] = {};
};

// The last pass of FusedWriteBack: finish basis row J = Kr - 1 (MLP: o_J -= c_J o_(J-1),
// with c_J its coefficient against o_(J-1)), then write the k stream rows back. kK, kKR: k
// and Kr as compile-time constants (0: from the arguments), so the loops over rows unroll
// and the rows' values stay in registers (with run-time bounds they are arrays on the
// stack, stored and reloaded at every element); the arithmetic is the same either way.
template <typename T, int kK, int kKR>
void WriteBackLastPass(const WriteBackArgs<T>& a, T cJ) {
  const int k = kK > 0 ? kK : a.k;
  const int Kr = kKR > 0 ? kKR : a.Kr;
  const int J = kKR > 0 ? kKR - 1 : a.J;  // Kr = 1 + J
  T* o = a.o;
  const int64_t ldo = a.ldo;
  const T* ob = J > 0 ? o : a.out;
  ForElements<T>(a.C, [&]<typename V>(int64_t e) {
    V ov[kKR > 0 ? kKR : kMaxKr];
    for (int r = 0; r < Kr; ++r) ov[r] = Ld<T, V>(ob + r * ldo + e);
    if (J > 0) {
      ov[J] += Bc<T, V>(-cJ) * ov[J - 1];
      St<T, V>(o + J * ldo + e, ov[J]);
    } else if (a.save_o0) {
      St<T, V>(o + e, ov[0]);
    }
    V xv[kK > 0 ? kK : kMaxK];
    for (int i = 0; i < k; ++i) xv[i] = Ld<T, V>(a.x[i] + e);
    for (int j = 0; j < k; ++j) {
      V y;
      if (a.mix != nullptr) {
        y = Bc<T, V>(T(0));
        for (int i = 0; i < k; ++i) y += Bc<T, V>(a.mix[j * k + i]) * xv[i];
      } else {
        y = xv[j];
      }
      for (int r = 0; r < Kr; ++r) y += Bc<T, V>(a.post[j * Kr + r]) * ov[r];
      St<T, V>(a.x[j] + e, y);
    }
  });
}

template <typename T>
void FusedWriteBack(const WriteBackArgs<T>& a) {
  using residual_internal::Simd;
  const int64_t C = a.C;
  const int k = a.k, Kr = a.Kr, J = a.J;
  T* o = a.o;
  const int64_t ldo = a.ldo;
  T c[kMaxKr][kMaxKr] = {};  // c[m][i]: MGS coefficient of row m against o_i
  T norms[kMaxKr] = {};
  if (J > 0) {
    // The raw convolutions v_m (m = 1..J), one pass per tap (a pass reading all taps at
    // once would stream 2 w_j + J rows together; at widths of 1024 floats those rows lie
    // 4 KiB apart, share their L1 sets and evict each other).
    for (int j = 0; j < J; ++j) ConvRow(a.w[j], C, a.out, C, a.taps[j], C, o + (j + 1) * ldo);
    // Pass 0: o_0 = out, |o_0|^2, <v_m, o_0>.
    Simd<T> vn = {}, vd[kMaxKr] = {};
    T sn = 0, sd[kMaxKr] = {};
    ForElements<T>(C, [&]<typename V>(int64_t e) {
      const V o0 = Ld<T, V>(a.out + e);
      St<T, V>(o + e, o0);
      V dn = o0 * o0;
      V dd[kMaxKr];
      for (int j = 0; j < J; ++j) dd[j] = Ld<T, V>(o + (j + 1) * ldo + e) * o0;
      if constexpr (std::is_same_v<T, V>) {
        sn += dn;
        for (int j = 0; j < J; ++j) sd[j] += dd[j];
      } else {
        vn += dn;
        for (int j = 0; j < J; ++j) vd[j] += dd[j];
      }
    });
    norms[0] = Total<T>(vn) + sn + static_cast<T>(kGramSchmidtEps);
    for (int j = 0; j < J; ++j) c[j + 1][0] = (Total<T>(vd[j]) + sd[j]) / norms[0];
    // Pass i = 0 .. J-2: rows m > i lose c[m][i] o_i; row i+1 is then final.
    for (int i = 0; i + 1 < J; ++i) {
      const T* oi = o + i * ldo;
      T* on = o + (i + 1) * ldo;
      Simd<T> vq = {}, vm[kMaxKr] = {};
      T sq = 0, sm[kMaxKr] = {};
      ForElements<T>(C, [&]<typename V>(int64_t e) {
        const V x = Ld<T, V>(oi + e);
        const V n = Ld<T, V>(on + e) + Bc<T, V>(-c[i + 1][i]) * x;
        St<T, V>(on + e, n);
        V dq = n * n;
        V dm[kMaxKr];
        for (int m = i + 2; m <= J; ++m) {
          const V v = Ld<T, V>(o + m * ldo + e) + Bc<T, V>(-c[m][i]) * x;
          St<T, V>(o + m * ldo + e, v);
          dm[m] = v * n;
        }
        if constexpr (std::is_same_v<T, V>) {
          sq += dq;
          for (int m = i + 2; m <= J; ++m) sm[m] += dm[m];
        } else {
          vq += dq;
          for (int m = i + 2; m <= J; ++m) vm[m] += dm[m];
        }
      });
      norms[i + 1] = Total<T>(vq) + sq + static_cast<T>(kGramSchmidtEps);
      for (int m = i + 2; m <= J; ++m) c[m][i + 1] = (Total<T>(vm[m]) + sm[m]) / norms[i + 1];
    }
  }
  // Last pass: finish row J (MLP), then the write-back of the k stream rows.
  const T cJ = J > 0 ? c[J][J - 1] : T(0);
  if (k == 4 && Kr == 1) return WriteBackLastPass<T, 4, 1>(a, cJ);
  if (k == 4 && Kr == 4) return WriteBackLastPass<T, 4, 4>(a, cJ);
  WriteBackLastPass<T, 0, 0>(a, cJ);
}

// Backward of the write-back for one token, one sweep over C: from the stream gradients
// G_j (the k rows of dX), the saved active rows A and basis O it writes dA_i = sum_j
// H_res[j][i] G_j (or G_i without mixing) and dO_r = sum_j p_j H_post[j][r] G_j, and
// returns <G_j, A_i> (dh_res, k x k, with mixing) and <G_j, O_r> (go, k x Kr). Per element
// the sums run in the order of the sequential form; the dots are summed per vector lane in
// element order, then across lanes. The sweep runs over tiles of kTile elements: the tile's
// G and A rows are first copied to `tile` (rows kTileRow apart) and its O rows to `o_copy`
// (rows ldp apart, kept for the Gram-Schmidt backward), one row at a time; then one pass
// over the tile writes dA and dO and one pass per row j sums its k + Kr dot products, all
// from L1 (the stream and saved rows are 4 KiB apart at widths that are multiples of 1024
// floats: read in place, the tile's 12-20 rows would share L1 sets and evict each other).
// Tiles are multiples of the vector width, so the result does not depend on the tiling.
template <typename T>
struct WriteBackGradArgs {
  int64_t C = 0;
  int k = 0;
  int Kr = 1;
  const T* g[kMaxK] = {};   // the k rows of dX
  const T* a = nullptr;     // k x C saved active rows
  const T* o = nullptr;     // Kr x C saved basis (after a)
  const T* mix = nullptr;   // k x k H_res or null
  const T* post = nullptr;  // k x Kr: p_j H_post[j][r]
  T* da = nullptr;          // k x C, written
  T* d_o = nullptr;         // Kr x ldp, written
  T* o_copy = nullptr;      // Kr x ldp: O, written
  int64_t ldp = 0;          // row stride of d_o and o_copy
  T* tile = nullptr;        // 2k x kTileRow scratch
  // The next token's G rows and saved rows (A, O: (k + Kr) x C), prefetched into L2 tile by
  // tile (null for the last token).
  const T* next_g[kMaxK] = {};
  const T* next_rows = nullptr;
  T* dh_res = nullptr;  // k x k (with mixing)
  T* go = nullptr;      // k x Kr
};

// kK, kKR: k and Kr as compile-time constants (0: read from the arguments), so the loops
// over rows unroll and the per-row values stay in registers (with run-time bounds they are
// arrays on the stack, loaded and stored at every element).
template <typename T, int kK, int kKR>
void FusedWriteBackBackwardImpl(const WriteBackGradArgs<T>& a) {
  using residual_internal::Simd;
  const int64_t C = a.C;
  const int k = kK > 0 ? kK : a.k;
  const int Kr = kKR > 0 ? kKR : a.Kr;
  const bool mix = a.mix != nullptr;
  Simd<T> vh[kMaxK * kMaxK], vo[kMaxK * kMaxKr];
  T sh[kMaxK * kMaxK], so[kMaxK * kMaxKr];
  for (int i = 0; i < k * k; ++i) {
    vh[i] = Simd<T>{};
    sh[i] = 0;
  }
  for (int i = 0; i < k * Kr; ++i) {
    vo[i] = Simd<T>{};
    so[i] = 0;
  }
  T mixc[kMaxK * kMaxK] = {}, postc[kMaxK * kMaxKr];
  if (mix) std::copy(a.mix, a.mix + k * k, mixc);
  std::copy(a.post, a.post + k * Kr, postc);
  const T* gt[kMaxK];
  const T* at[kMaxK];
  const T* ot[kMaxKr];
  T* dat[kMaxK];
  T* dot[kMaxKr];
  for (int64_t e0 = 0; e0 < C; e0 += kTile) {
    const int64_t n = std::min(kTile, C - e0);
    if (a.next_rows != nullptr) {
      constexpr int64_t kLine = 64 / sizeof(T);
      for (int64_t e = 0; e < n; e += kLine) {
        for (int j = 0; j < k; ++j) __builtin_prefetch(a.next_g[j] + e0 + e, 0, 2);
        for (int r = 0; r < k + Kr; ++r) __builtin_prefetch(a.next_rows + r * C + e0 + e, 0, 2);
      }
    }
    for (int j = 0; j < k; ++j) {
      T* dst = a.tile + j * kTileRow;
      std::memcpy(dst, a.g[j] + e0, sizeof(T) * n);
      gt[j] = dst;
      dat[j] = a.da + j * C + e0;
    }
    for (int i = 0; mix && i < k; ++i) {
      T* dst = a.tile + (k + i) * kTileRow;
      std::memcpy(dst, a.a + i * C + e0, sizeof(T) * n);
      at[i] = dst;
    }
    for (int r = 0; r < Kr; ++r) {
      T* dst = a.o_copy + r * a.ldp + e0;
      std::memcpy(dst, a.o + r * C + e0, sizeof(T) * n);
      ot[r] = dst;
      dot[r] = a.d_o + r * a.ldp + e0;
    }
    // dA and dO: no sums over elements.
    ForElements<T>(n, [&]<typename V>(int64_t e) {
      V gv[kMaxK];
      for (int j = 0; j < k; ++j) gv[j] = Ld<T, V>(gt[j] + e);
      if (mix) {
        for (int i = 0; i < k; ++i) {
          V d = Bc<T, V>(T(0));
          for (int j = 0; j < k; ++j) d += Bc<T, V>(mixc[j * k + i]) * gv[j];
          St<T, V>(dat[i] + e, d);
        }
      } else {
        for (int i = 0; i < k; ++i) St<T, V>(dat[i] + e, gv[i]);
      }
      for (int r = 0; r < Kr; ++r) {
        V d = Bc<T, V>(T(0));
        for (int j = 0; j < k; ++j) d += Bc<T, V>(postc[j * Kr + r]) * gv[j];
        St<T, V>(dot[r] + e, d);
      }
    });
    // The dot products of G_j with every A_i and O_r, one row j at a time over the tile
    // (k + Kr partial sums in registers; the tile's rows are in L1).
    for (int j = 0; j < k; ++j) {
      // Zeroed: GCC cannot tell that `mix` is the same in both loops.
      Simd<T> ah[kMaxK] = {}, ao[kMaxKr] = {};
      for (int i = 0; mix && i < k; ++i) ah[i] = vh[j * k + i];
      for (int r = 0; r < Kr; ++r) ao[r] = vo[j * Kr + r];
      ForElements<T>(n, [&]<typename V>(int64_t e) {
        const V g = Ld<T, V>(gt[j] + e);
        if constexpr (std::is_same_v<T, V>) {
          for (int i = 0; mix && i < k; ++i) sh[j * k + i] += g * at[i][e];
          for (int r = 0; r < Kr; ++r) so[j * Kr + r] += g * ot[r][e];
        } else {
          for (int i = 0; mix && i < k; ++i) ah[i] += g * Ld<T, V>(at[i] + e);
          for (int r = 0; r < Kr; ++r) ao[r] += g * Ld<T, V>(ot[r] + e);
        }
      });
      for (int i = 0; mix && i < k; ++i) vh[j * k + i] = ah[i];
      for (int r = 0; r < Kr; ++r) vo[j * Kr + r] = ao[r];
    }
  }
  if (mix)
    for (int i = 0; i < k * k; ++i) a.dh_res[i] = Total<T>(vh[i]) + sh[i];
  for (int i = 0; i < k * Kr; ++i) a.go[i] = Total<T>(vo[i]) + so[i];
}

template <typename T>
void FusedWriteBackBackward(const WriteBackGradArgs<T>& a) {
  if (a.k == 4 && a.Kr == 1) return FusedWriteBackBackwardImpl<T, 4, 1>(a);
  if (a.k == 4 && a.Kr == 4) return FusedWriteBackBackwardImpl<T, 4, 4>(a);
  FusedWriteBackBackwardImpl<T, 0, 0>(a);
}

template <typename T>
class XhcImpl final : public ResidualStreams<T>::Impl {
 public:
  using Base = typename ResidualStreams<T>::Impl;

  explicit XhcImpl(const ResidualConfig& c)
      : Base(c),
        k_(c.active),
        m_(c.fixed),
        g_(c.group_size()),
        J_(static_cast<int>(c.conv_widths.size())),
        sinkhorn_(c.active, c.sinkhorn_iters) {}

  void DeclareParameters() override;
  void InitParameters(uint64_t seed) override;
  void Reserve() override;
  void Read(int l, T* u) override;
  void Write(int l, const T* out) override;
  void WriteBackward(int l, T* d_out) override;
  void ReadBackward(int l, const T* d_u) override;
  SublayerMaps<T> Maps(int l, int t) const override {
    const Sublayer& sl = Sub(l);
    const Group& gr = GroupOf(l);
    const T* rec = gr.Rec(t);
    const int32_t* idx = gr.Active(t);
    const T* coef = sl.Coef(t);
    SublayerMaps<T> m;
    m.active.assign(idx, idx + k_);
    m.gates.assign(rec + kGate, rec + kGate + k_);
    m.h_pre.assign(rec + HpreOff(sl.s), rec + HpreOff(sl.s) + this->nstreams);
    if (sl.last) m.h_res.assign(coef + HresOff(sl), coef + HresOff(sl) + k_ * k_);
    m.h_post.assign(coef + HpostOff(sl), coef + HpostOff(sl) + k_ * sl.Kr);
    return m;
  }

 private:
  struct Sublayer {
    bool mlp = false;
    bool last = false;  // last in its group: mixes with H_res
    int s = 0;          // position in the group
    int Kr = 1;         // write-back basis size
    int P2 = 0;         // active projection outputs: (last ? k*k : 0) + k*Kr
    int64_t w_pre = 0, a_pre = 0, b_pre = 0;
    int64_t w2 = 0;  // P2 x kC: [res rows (if last) | post rows]
    int64_t a_res = 0, b_res = 0, a_post = 0, b_post = 0;
    std::vector<int64_t> conv;  // conv_widths[j] x C each
    int64_t row_stride = 0;     // (k + Kr) * C
    int64_t coef_stride = 0;    // 1 + P2 + k*k + k*Kr
    std::vector<T> rows;        // tokens x row_stride: A_(s-1) then O (saved for backward)
    std::vector<T> coef;        // tokens x coef_stride: ra, q, H_res, H_post
    // Token t's coefficient record and its saved rows.
    T* Coef(int t) { return coef.data() + static_cast<int64_t>(t) * coef_stride; }
    const T* Coef(int t) const { return coef.data() + static_cast<int64_t>(t) * coef_stride; }
    T* Saved(int t) { return rows.data() + static_cast<int64_t>(t) * row_stride; }
    const T* Saved(int t) const { return rows.data() + static_cast<int64_t>(t) * row_stride; }
  };
  struct Group {
    int64_t w1 = 0;  // (N + g*N) x NC: router rows, then each sublayer's pre rows
    int P1 = 0;
    int k = 0;                 // active streams per token
    int64_t rec_stride = 0;    // RecStride()
    std::vector<int32_t> idx;  // tokens x k, ascending
    std::vector<T> rec;        // tokens x rec_stride
    std::vector<T> colsum;     // N: router row sums (LayerNorm centring), per forward
    // Token t's record (norm statistics, gates, logits, every H_pre) and its active set.
    T* Rec(int t) { return rec.data() + static_cast<int64_t>(t) * rec_stride; }
    const T* Rec(int t) const { return rec.data() + static_cast<int64_t>(t) * rec_stride; }
    int32_t* Active(int t) { return idx.data() + static_cast<int64_t>(t) * k; }
    const int32_t* Active(int t) const { return idx.data() + static_cast<int64_t>(t) * k; }
  };
  Sublayer& Sub(int l) { return sub_[static_cast<size_t>(l)]; }
  const Sublayer& Sub(int l) const { return sub_[static_cast<size_t>(l)]; }
  Group& GroupOf(int l) { return groups_[static_cast<size_t>(l / g_)]; }
  const Group& GroupOf(int l) const { return groups_[static_cast<size_t>(l / g_)]; }

  // Group record layout.
  int64_t RecStride() const { return 3 + k_ + this->nstreams + 2 * g_ * this->nstreams; }
  static constexpr int kMu = 0, kSd = 1, kRms = 2, kGate = 3;
  int YrOff() const { return 3 + k_; }
  int YpreOff(int s) const { return 3 + k_ + this->nstreams + s * this->nstreams; }
  int HpreOff(int s) const {
    return 3 + k_ + this->nstreams + g_ * this->nstreams + s * this->nstreams;
  }
  // Sublayer coefficient layout.
  static constexpr int kRa = 0;
  static int QOff() { return 1; }
  int HresOff(const Sublayer& sl) const { return 1 + sl.P2; }
  int HpostOff(const Sublayer& sl) const { return 1 + sl.P2 + k_ * k_; }

  int KrMax() const { return 1 + J_; }
  int P2Max() const { return k_ * k_ + k_ * KrMax(); }

  // Scratch layout per thread (the all-token projections use z_, q_ and act_).
  int64_t OffOne() const { return 0; }
  int64_t OffO() const { return OffOne() + static_cast<int64_t>(k_) * this->width; }
  // Rows of the per-token basis in scratch are padded by one cache line: at widths that are
  // multiples of 1024 floats, rows 4 KiB apart map to the same L1 sets and their loads
  // alias the stores of the fused passes.
  int64_t ScratchRow() const { return this->width + kRowPad; }
  // The backward's padded copy of the saved basis, the Gram-Schmidt levels and the tiles.
  int64_t OffOCopy() const { return OffO() + static_cast<int64_t>(KrMax()) * ScratchRow(); }
  int64_t OffLevels() const { return OffOCopy() + static_cast<int64_t>(KrMax()) * ScratchRow(); }
  int64_t OffTile() const {
    return OffLevels() + static_cast<int64_t>(std::max(J_ + 1, J_ * (J_ + 1) / 2)) * ScratchRow();
  }
  int64_t OffSmall() const { return OffTile() + 2 * k_ * kTileRow; }
  // WriteBackward's gradient w.r.t. the block's active rows A_(s-1), kTokenBlock x kC: it
  // lives only while its block is processed, so it stays in cache (a whole-batch buffer sent
  // tokens x kC of dirty rows back to memory that nothing read again).
  int64_t OffDa() const {
    return (OffSmall() + sinkhorn_.tape_size() + (4 * kTokenBlock + 8) * k_ * k_ + 64 + 15) / 16 *
           16;
  }
  int64_t ScratchSize() const {
    return OffDa() + static_cast<int64_t>(kTokenBlock) * k_ * this->width;
  }

  // ---- ReadInput's stages ----
  // Group entry, token t (its z_ row projected): the LayerNorm / RMSNorm statistics, the
  // router scores, active set and gates, H_pre of every sublayer of the group, the dense
  // read u_t of sublayer l and the non-active bases of the group's later sublayers.
  void EntryToken(int l, int t, T* u);
  // A later sublayer of a flash group, token t: u_t = base_s + sum_j H_pre^s_(I_j) A_(s-1),j.
  void BaseToken(int l, int t, T* u);
  void TopK(const T* score, int32_t* idx) const;
  // Gathers token t's active rows (the backward's saved A) and stores ra = RMS(vec A).
  void GatherActive(Sublayer& sl, const Group& gr, int t);
  // The active mappings of tokens [t0, t1) from their H_res / H_post logits (q_,
  // projected by Read): RMSNorm scaling, then the maps (H_res's Sinkhorns batched by
  // kTokenBlock tokens). `small`: kTokenBlock * k * k elements of scratch.
  void ActiveMaps(Sublayer& sl, int t0, int t1, T* small);
  // Packs the P x K mapping weight w into `packed` for ProjectRows (K x PaddedOutputs(P)).
  static const T* PackWeight(const T* w, int P, int64_t K, std::vector<T>* packed);
  // Tokens per block of Read's fused pass: the block's rows of the state stay in cache
  // between its projection and its per-token work.
  int ReadBlock() const;
  T* ActiveRows(Sublayer& sl, int64_t* ld) {
    if (this->save) {
      *ld = sl.row_stride;
      return sl.rows.data();
    }
    *ld = static_cast<int64_t>(k_) * this->width;
    return act_.data();
  }

  // ---- shared by the forward and the backward ----
  // logits = a_res q + b_res (k x k) from a token's scaled logits q: H_res = Sinkhorn(logits).
  void ResLogits(const Sublayer& sl, const T* q, T* logits) const;
  // Sum of row j of a k x k H_res (the row-sum clamp divides rows whose sum exceeds 1).
  T ResRowSum(const T* h, int j) const;
  // post[j * Kr + r] = p_j H_post[j][r]: token t's gated write-back weights.
  void GatedPost(const Sublayer& sl, const Group& gr, int t, T* post) const;
  // Valid taps of each causal convolution at token t (not reaching before its segment).
  void CausalTaps(int t, int* taps) const;

  // ---- WriteOutputBackward's stages, per block of kTokenBlock tokens ----
  // A block of tokens and its views of the thread's scratch.
  struct GradBlock {
    int t0 = 0, tb = 0;
    T* da = nullptr;       // tb x kC: dL/dA_(s-1) of the block's active rows
    T* d_o = nullptr;      // Kr padded rows: the current token's basis gradient (MLP)
    T* o_copy = nullptr;   // Kr padded rows: its saved basis (FusedWriteBackBackward)
    T* tile = nullptr;     // FusedWriteBackBackward's tiles
    T* levels = nullptr;   // the Gram-Schmidt backward's recomputed levels
    T* sk_tape = nullptr;  // the block's Sinkhorn tape (one token per vector lane)
    T* logits = nullptr;   // per token, k * k apart: the H_res logits,
    T* hraw = nullptr;     //   H_res before the row-sum clamp (recomputed),
    T* dh = nullptr;       //   dL/dH_res,
    T* dz = nullptr;       //   dL/dlogits
    T dhpost[kTokenBlock][kMaxK * kMaxKr];  // per token: dL/dH_post
  };
  void BeginGradBlock(int t0, int thread, GradBlock* b);
  // Token i of the block: the write-back's stream and basis gradients (FusedWriteBackBackward:
  // b.da, dO, dL/dH_res into b.dh), the gate gradients dp_, dL/dH_post, the MLP basis back
  // through Gram-Schmidt into d_out and dg_, and the H_res logits for MixingBackward.
  void WriteBackTokenBackward(const Sublayer& sl, const Group& gr, GradBlock& b, int i, T* d_out);
  // The block's H_res (last sublayer of a group): Sinkhorn recomputed, the row-sum clamp's
  // backward in b.dh, then the Sinkhorn backward into b.dz.
  void MixingBackward(const Sublayer& sl, GradBlock& b) const;
  // Token i of the block: H_res / H_post logit gradients into c2_ (divided by ra) and the
  // scalar parameters' into scal_; RMSNorm(vec A)'s direct term into b.da.
  void ActiveMapsBackward(const Sublayer& sl, GradBlock& b, int i);
  // The block: b.da += c2 W2 (wp2_), then dA into the active rows of dX, and the state's
  // active rows walked back to this sublayer's input.
  void ScatterActiveGrad(const Sublayer& sl, const Group& gr, const GradBlock& b);
  // MLP sublayers, all tokens: the convolutions' input gradients into d_out (from dg_) and
  // their weight gradients.
  void ConvolutionsBackward(const Sublayer& sl, T* d_out);
  // All tokens: the [w_res | w_post] weight gradient from c2_ and the saved rows, and the
  // scalar parameters' from scal_ in token order.
  void ActiveParamGrads(const Sublayer& sl);
  void GramSchmidtBackward(const Sublayer& sl, const T* out, int64_t ld, int t, const T* o, T* d_o,
                           int64_t lp, T* d_out_t, T* dg_t, T* levels) const;
  // kJ: J as a compile-time constant (0: J_).
  template <int kJ>
  void GramSchmidtBackwardImpl(const Sublayer& sl, const T* out, int64_t ld, int t, const T* o,
                               T* d_o, int64_t lp, T* d_out_t, T* dg_t, T* levels) const;
  // GramSchmidtBackwardImpl's state between its passes: |o_r|^2 + eps, the coefficients
  // c(m, i) and their gradients dc(m, i).
  struct GramSchmidtCoefs {
    T norms[kMaxKr];
    T c[kMaxKr][kMaxKr] = {};
    T dc[kMaxKr][kMaxKr] = {};
  };
  // The J passes that recompute the levels W(m, i) and the coefficients.
  template <int kJ>
  void GramSchmidtLevels(const Sublayer& sl, const T* out, int64_t ld, int t, const T* o,
                         const T* d_o, int64_t lp, T* levels, GramSchmidtCoefs& coefs) const;
  // The J passes that undo the steps i = J-1 .. 0 into d_o, d_out_t and dg_t.
  template <int kJ>
  void GramSchmidtUndo(const T* o, T* d_o, int64_t lp, T* d_out_t, T* dg_t, const T* levels,
                       GramSchmidtCoefs& coefs) const;

  // ---- ReadInputBackward's stages ----
  // Token t (its row of d_u): dX += H_pre du over the current rows; the H_pre logit
  // gradients into dypre_ and scal_.
  void DenseReadBackward(const Sublayer& sl, const Group& gr, int t, const T* d_u);
  // Group entry, token t: the router and pre-mapping logit gradients of the whole group
  // into c1_ (divided by the norm scales) and the norm statistics' terms into dX.
  void EntryTokenBackward(const Group& gr, int t);
  // Group entry, all tokens: dX += c1 W1 and dW1 += c1^T X, with the router rows'
  // LayerNorm centring.
  void EntryWeightGrads(const Group& gr);

  const T* Param(int64_t offset) const { return this->values.data() + offset; }
  int64_t ScalStride() const { return std::max(1 + this->nstreams, 2 + k_ * k_ + k_ * KrMax()); }

  int k_, m_, g_, J_;
  SinkhornProjection<T> sinkhorn_;
  std::vector<Sublayer> sub_;
  std::vector<Group> groups_;
  std::vector<T> base_;  // tokens x (g-1) x C: non-active parts of the group's reads
  std::vector<T> z_;     // tokens x P1: router and pre-mapping projections (group entry)
  std::vector<T> q_;     // tokens x P2max: active projections
  std::vector<T> act_;   // tokens x kC: gathered active rows when not saving
  std::vector<T> wt1_;   // the group's router + pre-mapping weight, packed for ProjectRows
  std::vector<T> wt2_;   // the sublayer's H_res / H_post weight, packed for ProjectRows
  std::vector<T> wp2_;   // the same weight panel-packed for the backward's dA += c2 W2
  // Backward workspaces.
  std::vector<T> dp_;     // tokens x k (accumulated over the group's sublayers)
  std::vector<T> dypre_;  // tokens x g x N
  std::vector<T> c1_;     // tokens x P1
  std::vector<T> c2_;     // tokens x P2max
  std::vector<T> dg_;     // tokens x J x C
  std::vector<T> scal_;   // tokens x per-token scalar-parameter gradients
};

template <typename T>
void XhcImpl<T>::DeclareParameters() {
  const int N = this->nstreams;
  const int64_t C = this->width;
  const int L = this->nsub;
  sub_.resize(static_cast<size_t>(L));
  groups_.resize(static_cast<size_t>(L / g_));
  for (int gi = 0; gi < L / g_; ++gi) {
    Group& gr = groups_[static_cast<size_t>(gi)];
    gr.P1 = N + g_ * N;
    gr.k = k_;
    gr.rec_stride = RecStride();
    const std::string router = g_ == 1 ? absl::StrCat("sublayer", gi, ".w_router")
                                       : absl::StrCat("group", gi, ".w_router");
    gr.w1 = this->AddParam(router, N * N * C);
    for (int s = 0; s < g_; ++s) {
      const int l = gi * g_ + s;
      sub_[static_cast<size_t>(l)].w_pre =
          this->AddParam(absl::StrCat("sublayer", l, ".w_pre"), N * N * C);
    }
  }
  for (int l = 0; l < L; ++l) {
    Sublayer& sl = sub_[static_cast<size_t>(l)];
    const std::string p = absl::StrCat("sublayer", l, ".");
    sl.mlp = this->config.sublayers[static_cast<size_t>(l)] == SublayerKind::kMlp;
    sl.s = l % g_;
    sl.last = sl.s == g_ - 1;
    sl.Kr = sl.mlp ? 1 + J_ : 1;
    sl.P2 = (sl.last ? k_ * k_ : 0) + k_ * sl.Kr;
    sl.a_pre = this->AddParam(p + "a_pre", 1);
    sl.b_pre = this->AddParam(p + "b_pre", N);
    // w_res and w_post are adjacent so one projection computes both.
    const int64_t kc = k_ * C;
    if (sl.last) sl.w2 = this->AddParam(p + "w_res", k_ * k_ * kc);
    const int64_t post = this->AddParam(p + "w_post", k_ * sl.Kr * kc);
    if (!sl.last) sl.w2 = post;
    if (sl.last) {
      sl.a_res = this->AddParam(p + "a_res", 1);
      sl.b_res = this->AddParam(p + "b_res", k_ * k_);
    }
    sl.a_post = this->AddParam(p + "a_post", 1);
    sl.b_post = this->AddParam(p + "b_post", k_ * sl.Kr);
    if (sl.mlp)
      for (int j = 0; j < J_; ++j)
        sl.conv.push_back(this->AddParam(absl::StrCat(p, "conv", j),
                                         this->config.conv_widths[static_cast<size_t>(j)] * C));
    sl.row_stride = (k_ + sl.Kr) * C;
    sl.coef_stride = 1 + sl.P2 + k_ * k_ + k_ * sl.Kr;
  }
}

template <typename T>
void XhcImpl<T>::InitParameters(uint64_t seed) {
  // Router W_r ~ N(0, 0.02) so TopK starts without ties; every other weight, bias and the
  // convolutions start at 0 (the MLP write-back starts as [out]); gating scalars 0.01.
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 0.02);
  const int64_t rows = static_cast<int64_t>(this->nstreams) * this->nstreams * this->width;
  for (const Group& gr : groups_)
    for (int64_t i = 0; i < rows; ++i) *this->value(gr.w1 + i) = static_cast<T>(normal(rng));
  for (const Sublayer& sl : sub_) {
    *this->value(sl.a_pre) = T(0.01);
    *this->value(sl.a_post) = T(0.01);
    if (sl.last) *this->value(sl.a_res) = T(0.01);
  }
}

template <typename T>
void XhcImpl<T>::Reserve() {
  const size_t cap = static_cast<size_t>(this->capacity);
  const int N = this->nstreams;
  const int64_t C = this->width;
  for (Sublayer& sl : sub_) {
    sl.coef.resize(cap * static_cast<size_t>(sl.coef_stride));
    if (this->reserved_save) sl.rows.resize(cap * static_cast<size_t>(sl.row_stride));
  }
  for (Group& gr : groups_) {
    gr.idx.resize(cap * static_cast<size_t>(k_));
    gr.rec.resize(cap * static_cast<size_t>(RecStride()));
    gr.colsum.resize(static_cast<size_t>(N));
  }
  base_.resize(cap * static_cast<size_t>(g_ - 1) * static_cast<size_t>(C));
  z_.resize(cap * static_cast<size_t>(PaddedOutputs<T>(groups_[0].P1)));
  q_.resize(cap * static_cast<size_t>(PaddedOutputs<T>(P2Max())));
  // act_ holds the gathered rows only in forwards without saving (sized on first use).
  if (this->reserved_save) {
    dp_.resize(cap * static_cast<size_t>(k_));
    dypre_.resize(cap * static_cast<size_t>(g_ * N));
    c1_.resize(cap * static_cast<size_t>(groups_[0].P1));
    c2_.resize(cap * static_cast<size_t>(P2Max()));
    dg_.resize(cap * static_cast<size_t>(J_) * static_cast<size_t>(C));
    scal_.resize(cap * static_cast<size_t>(ScalStride()));
  }
  this->scratch_per_thread = ScratchSize();
  this->scratch.resize(static_cast<size_t>(this->scratch_per_thread) *
                       static_cast<size_t>(this->threads));
}

template <typename T>
void XhcImpl<T>::TopK(const T* score, int32_t* idx) const {
  const int N = this->nstreams;
  const int want = k_ - m_;
  int sel[kMaxN];
  int count = 0;
  for (int i = m_; i < N; ++i) {
    // Insert by descending score; equal scores keep the lower index first.
    int pos = count;
    while (pos > 0 && score[i] > score[sel[pos - 1]]) --pos;
    if (pos >= want) continue;
    const int end = std::min(count, want - 1);
    for (int q = end; q > pos; --q) sel[q] = sel[q - 1];
    sel[pos] = i;
    count = std::min(count + 1, want);
  }
  std::sort(sel, sel + count);
  for (int j = 0; j < m_; ++j) idx[j] = j;
  for (int j = 0; j < count; ++j) idx[m_ + j] = sel[j];
}

template <typename T>
void XhcImpl<T>::GatherActive(Sublayer& sl, const Group& gr, int t) {
  const int64_t C = this->width;
  const int64_t kc = k_ * C;
  int64_t lda;
  T* a = ActiveRows(sl, &lda) + static_cast<int64_t>(t) * lda;
  const int32_t* idx = gr.Active(t);
  const T* x = this->X.data() + static_cast<int64_t>(t) * this->nstreams * C;
  for (int j = 0; j < k_; ++j) std::memcpy(a + j * C, x + idx[j] * C, sizeof(T) * C);
  T sum, sq;
  Moments(a, kc, &sum, &sq);
  sl.Coef(t)[kRa] = RmsOf(sq, kc);
}

template <typename T>
const T* XhcImpl<T>::PackWeight(const T* w, int P, int64_t K, std::vector<T>* packed) {
  const size_t need = static_cast<size_t>(K) * static_cast<size_t>(PaddedOutputs<T>(P));
  if (packed->size() < need) packed->resize(need);
  PackTransposed(w, K, P, K, packed->data());
  return packed->data();
}

template <typename T>
int XhcImpl<T>::ReadBlock() const {
  // About 2 MiB of state rows per block: they are still in L2/L3 when the block's per-token
  // pass reads them again; the packed weights (streamed once per block) stay in L3.
  const int64_t row_bytes =
      static_cast<int64_t>(this->nstreams) * this->width * static_cast<int64_t>(sizeof(T));
  const int64_t rows = (int64_t{2} << 20) / row_bytes;
  return static_cast<int>(std::clamp<int64_t>(rows & ~int64_t{1}, 2, 256));
}

template <typename T>
void XhcImpl<T>::ResLogits(const Sublayer& sl, const T* q, T* logits) const {
  const T a = *Param(sl.a_res);
  const T* b = Param(sl.b_res);
  for (int i = 0; i < k_ * k_; ++i) logits[i] = a * q[i] + b[i];
}

template <typename T>
T XhcImpl<T>::ResRowSum(const T* h, int j) const {
  T s = 0;
  for (int i = 0; i < k_; ++i) s += h[j * k_ + i];
  return s;
}

template <typename T>
void XhcImpl<T>::GatedPost(const Sublayer& sl, const Group& gr, int t, T* post) const {
  const T* rec = gr.Rec(t);
  const T* hpost = sl.Coef(t) + HpostOff(sl);
  for (int j = 0; j < k_; ++j)
    for (int r = 0; r < sl.Kr; ++r) post[j * sl.Kr + r] = rec[kGate + j] * hpost[j * sl.Kr + r];
}

template <typename T>
void XhcImpl<T>::CausalTaps(int t, int* taps) const {
  const int seg = this->segment_of[static_cast<size_t>(t)];
  for (int j = 0; j < J_; ++j)
    taps[j] = std::min(this->config.conv_widths[static_cast<size_t>(j)], t - seg + 1);
}

template <typename T>
void XhcImpl<T>::ActiveMaps(Sublayer& sl, int t0, int t1, T* small) {
  const int kk = k_ * k_;
  const int ldq = PaddedOutputs<T>(sl.P2);
  for (int b0 = t0; b0 < t1; b0 += kTokenBlock) {
    const int nb = std::min(kTokenBlock, t1 - b0);
    // RMSNorm scaling of the logits.
    for (int t = b0; t < b0 + nb; ++t) {
      T* coef = sl.Coef(t);
      const T ra = coef[kRa];
      const T* q = q_.data() + static_cast<int64_t>(t) * ldq;
      for (int p = 0; p < sl.P2; ++p) coef[QOff() + p] = q[p] / ra;
    }
    if (sl.last) {
      // H_res = Sinkhorn(a_res q + b_res), the batch's tokens one per vector lane, then
      // each row divided by max(row sum, 1).
      const T* zs[kTokenBlock];
      T* hs[kTokenBlock];
      for (int i = 0; i < nb; ++i) {
        T* coef = sl.Coef(b0 + i);
        T* logits = small + i * kk;
        ResLogits(sl, coef + QOff(), logits);
        zs[i] = logits;
        hs[i] = coef + HresOff(sl);
      }
      sinkhorn_.ForwardBatch(nb, zs, hs, nullptr);
      for (int i = 0; i < nb; ++i) {
        T* h = hs[i];
        for (int j = 0; j < k_; ++j) {
          const T s = ResRowSum(h, j);
          if (s > T(1))
            for (int i2 = 0; i2 < k_; ++i2) h[j * k_ + i2] /= s;
        }
      }
    }
    const int off = sl.last ? kk : 0;
    const T a = *Param(sl.a_post);
    const T* b = Param(sl.b_post);
    for (int t = b0; t < b0 + nb; ++t) {
      T* coef = sl.Coef(t);
      const T* q = coef + QOff();
      T* hp = coef + HpostOff(sl);
      for (int i = 0; i < k_ * sl.Kr; ++i) hp[i] = T(2) * Sigmoid(a * q[off + i] + b[i]);
    }
  }
}

template <typename T>
void XhcImpl<T>::EntryToken(int l, int t, T* u) {
  const int N = this->nstreams;
  const int64_t C = this->width;
  const int64_t nc = N * C;
  Group& gr = GroupOf(l);
  const T* x = this->X.data() + static_cast<int64_t>(t) * nc;
  T* rec = gr.Rec(t);
  T sum, sq;
  Moments(x, nc, &sum, &sq);
  const T D = static_cast<T>(nc);
  const T mu = sum / D;
  const T var = std::max(sq / D - mu * mu, T(0));
  const T sd = std::sqrt(var + static_cast<T>(kNormEps));
  const T r = RmsOf(sq, nc);
  rec[kMu] = mu;
  rec[kSd] = sd;
  rec[kRms] = r;
  const T* z = z_.data() + static_cast<int64_t>(t) * PaddedOutputs<T>(gr.P1);
  T score[kMaxN];
  for (int p = 0; p < N; ++p) {
    rec[YrOff() + p] = (z[p] - mu * gr.colsum[static_cast<size_t>(p)]) / sd;
    score[p] = Sigmoid(rec[YrOff() + p]);
  }
  for (int s = 0; s < g_; ++s) {
    const Sublayer& sub = Sub(l + s);
    const T a = *this->value(sub.a_pre);
    const T* b = this->value(sub.b_pre);
    for (int p = 0; p < N; ++p) {
      const T y = z[N + s * N + p] / r;
      rec[YpreOff(s) + p] = y;
      rec[HpreOff(s) + p] = Sigmoid(a * y + b[p]);
    }
  }
  int32_t* idx = gr.Active(t);
  TopK(score, idx);
  for (int j = 0; j < k_; ++j) rec[kGate + j] = j < m_ ? T(1) : score[idx[j]];
  Combine(rec + HpreOff(0), N, x, C, C, u + t * C);
  for (int s = 1; s < g_; ++s) {
    T coefs[kMaxN];
    std::memcpy(coefs, rec + HpreOff(s), sizeof(T) * N);
    for (int j = 0; j < k_; ++j) coefs[idx[j]] = 0;
    Combine(coefs, N, x, C, C, base_.data() + (static_cast<int64_t>(t) * (g_ - 1) + s - 1) * C);
  }
}

template <typename T>
void XhcImpl<T>::BaseToken(int l, int t, T* u) {
  const int64_t C = this->width;
  const Sublayer& sl = Sub(l);
  const Group& gr = GroupOf(l);
  const T* rec = gr.Rec(t);
  const int32_t* idx = gr.Active(t);
  const T* x = this->X.data() + static_cast<int64_t>(t) * this->nstreams * C;
  T* ut = u + t * C;
  std::memcpy(ut, base_.data() + (static_cast<int64_t>(t) * (g_ - 1) + sl.s - 1) * C,
              sizeof(T) * C);
  for (int j = 0; j < k_; ++j) Axpy(rec[HpreOff(sl.s) + idx[j]], x + idx[j] * C, ut, C);
}

template <typename T>
void XhcImpl<T>::Read(int l, T* u) {
  const int N = this->nstreams;
  const int64_t C = this->width;
  const int64_t nc = N * C;
  const int64_t kc = k_ * C;
  Sublayer& sl = Sub(l);
  Group& gr = GroupOf(l);
  const int tokens = this->ntok;
  if (!this->save && act_.size() < static_cast<size_t>(this->capacity) * static_cast<size_t>(kc))
    act_.resize(static_cast<size_t>(this->capacity) * static_cast<size_t>(kc));
  const bool entry = sl.s == 0;
  // Group entry: one pass over the full state for routing, every pre-mapping of the group
  // (one GEMM over the flattened state; the LayerNorm / RMSNorm statistics are applied
  // per token after it), the dense read of sublayer 0 and the non-active bases of the
  // others. Later sublayers of a flash group read from those bases.
  const T* wt1 = nullptr;
  if (entry) {
    const T* w1 = this->value(gr.w1);
    for (int p = 0; p < N; ++p) {
      T s, sq;
      Moments(w1 + p * nc, nc, &s, &sq);
      gr.colsum[static_cast<size_t>(p)] = s;
    }
    wt1 = PackWeight(w1, gr.P1, nc, &wt1_);
  }
  const T* wt2 = PackWeight(Param(sl.w2), sl.P2, kc, &wt2_);
  const int ldz = PaddedOutputs<T>(gr.P1);
  const int ldq = PaddedOutputs<T>(sl.P2);
  int64_t lda;
  const T* ablock = ActiveRows(sl, &lda);

  // One fused pass per block of tokens: the block's projections stream its rows from
  // memory, its per-token work and the projection of its gathered active rows find them
  // in cache. Every token's results are those of the unblocked computation, bit for bit
  // (ProjectRows sums each output in index order whatever the rows), so any block size
  // and any thread count give the same values.
  const int block = ReadBlock();
  const int blocks = (tokens + block - 1) / block;
#pragma omp parallel for schedule(static) if (this->Parallel())
  for (int b = 0; b < blocks; ++b) {
    const int t0 = b * block;
    const int t1 = std::min(tokens, t0 + block);
    if (entry) {
      ProjectRows(this->X.data() + t0 * nc, nc, t1 - t0, wt1, ldz, nc, z_.data() + t0 * ldz, ldz);
      for (int t = t0; t < t1; ++t) EntryToken(l, t, u);
    } else {
      for (int t = t0; t < t1; ++t) BaseToken(l, t, u);
    }
    for (int t = t0; t < t1; ++t) GatherActive(sl, gr, t);
    ProjectRows(ablock + t0 * lda, lda, t1 - t0, wt2, ldq, kc, q_.data() + t0 * ldq, ldq);
    T* small = this->Scratch(omp_get_thread_num()) + OffSmall();
    ActiveMaps(sl, t0, t1, small);
  }
  if (entry) {
    this->Count("mapping generation (full state)", static_cast<double>(nc), 0,
                static_cast<double>(nc), 0);
    this->Count("dense read", static_cast<double>(nc), static_cast<double>(g_ * C), 0,
                static_cast<double>(g_ * C));
    this->Count("gather active streams", static_cast<double>(kc), static_cast<double>(kc), 0, 0);
  } else {
    this->Count("read from bases", static_cast<double>(kc + C), static_cast<double>(C),
                static_cast<double>(kc + C), static_cast<double>(C));
  }
  this->Count("active mapping generation", static_cast<double>(kc), 0, 0, 0);
  if (this->save) this->Count("save for backward", 0, 0, 0, static_cast<double>(kc));
}

template <typename T>
void XhcImpl<T>::Write(int l, const T* out) {
  const int N = this->nstreams;
  const int64_t C = this->width;
  const int64_t nc = N * C;
  const int64_t kc = k_ * C;
  Sublayer& sl = Sub(l);
  const Group& gr = GroupOf(l);
  const int tokens = this->ntok;
  const T* w[kMaxKr] = {};
  for (int j = 0; sl.mlp && j < J_; ++j) w[j] = Param(sl.conv[static_cast<size_t>(j)]);
#pragma omp parallel for schedule(static) if (this->Parallel())
  for (int t = 0; t < tokens; ++t) {
    const int32_t* idx = gr.Active(t);
    const T* coef = sl.Coef(t);
    T* x = this->X.data() + static_cast<int64_t>(t) * nc;
    WriteBackArgs<T> args;
    args.C = C;
    args.k = k_;
    args.Kr = sl.Kr;
    args.J = sl.mlp ? J_ : 0;
    for (int j = 0; j < k_; ++j) args.x[j] = x + idx[j] * C;
    args.mix = sl.last ? coef + HresOff(sl) : nullptr;
    T post[kMaxK * kMaxKr];
    GatedPost(sl, gr, t, post);
    args.post = post;
    args.out = out + t * C;
    // The basis O goes to the saved rows (after A) or to this thread's scratch.
    args.o = this->save ? sl.Saved(t) + kc : this->Scratch(omp_get_thread_num()) + OffO();
    args.ldo = this->save ? C : ScratchRow();
    args.save_o0 = this->save;
    if (sl.mlp) {
      CausalTaps(t, args.taps);
      std::copy(w, w + J_, args.w);
    }
    FusedWriteBack(args);
  }
  const double Kr = sl.Kr;
  if (sl.last) this->Count("mix", static_cast<double>(kc), static_cast<double>(kc), 0, 0);
  this->Count("post write-back", Kr * C, static_cast<double>(kc), static_cast<double>(C), 0);
  this->Count("merge + scatter", 2.0 * kc, static_cast<double>(kc), static_cast<double>(kc),
              static_cast<double>(kc));
  if (sl.mlp) this->Count("convolutions", static_cast<double>(C), (Kr - 1) * C, 0, 0);
  if (this->save) this->Count("save for backward", 0, 0, 0, Kr * C);
}

// Backward of the MLP basis (FusedWriteBack) for token t: d_o (Kr rows, consumed) ->
// d_out_t (= dv1, written) and dg_t (J x C, the gradients w.r.t. the raw convolution
// outputs). `out` rows are at stride `ld` (the saved v1 rows); the basis o, d_o and the
// levels are padded scratch rows `lp` apart. Recomputes the Gram-Schmidt
// levels W(m, i) (row m before its step against o_i, J (J + 1) / 2 rows in `levels`) in J
// passes over C, then undoes the steps i = J-1 .. 0 of all rows m > i in one pass per i
// (rows in descending order, as the sequential form; the pass also sums the dot products
// the next step needs): 2 J passes in all.
template <typename T>
void XhcImpl<T>::GramSchmidtBackward(const Sublayer& sl, const T* out, int64_t ld, int t,
                                     const T* o, T* d_o, int64_t lp, T* d_out_t, T* dg_t,
                                     T* levels) const {
  if (J_ == 3) {
    GramSchmidtBackwardImpl<3>(sl, out, ld, t, o, d_o, lp, d_out_t, dg_t, levels);
  } else {
    GramSchmidtBackwardImpl<0>(sl, out, ld, t, o, d_o, lp, d_out_t, dg_t, levels);
  }
}

template <typename T>
template <int kJ>
void XhcImpl<T>::GramSchmidtLevels(const Sublayer& sl, const T* out, int64_t ld, int t, const T* o,
                                   const T* d_o, int64_t lp, T* levels,
                                   GramSchmidtCoefs& coefs) const {
  using residual_internal::Simd;
  const int64_t C = this->width;
  const int J = kJ > 0 ? kJ : J_;  // compile-time when known: the row loops unroll
  int taps[kMaxKr];
  CausalTaps(t, taps);
  const T* w[kMaxKr];
  for (int j = 0; j < J; ++j) w[j] = Param(sl.conv[static_cast<size_t>(j)]);
  auto lev = [&](int m, int i) { return levels + (m * (m - 1) / 2 + i) * lp; };
  const T* out_t = out + t * ld;
  {
    // W(m, 0) = raw convolution m - 1 (as the forward, one pass per tap); then one pass
    // for <W(m, 0), o_0>, |o_r|^2 and <d_o[J], o_(J-1)>.
    for (int m = 1; m <= J; ++m) ConvRow(w[m - 1], C, out_t, ld, taps[m - 1], C, lev(m, 0));
    Simd<T> vn[kMaxKr] = {}, vd[kMaxKr] = {}, vg = {};
    T sn[kMaxKr] = {}, sd[kMaxKr] = {}, sg = 0;
    ForElements<T>(C, [&]<typename V>(int64_t e) {
      const V o0 = Ld<T, V>(o + e);
      V dn[kMaxKr], dd[kMaxKr];
      for (int r = 0; r <= J; ++r) {
        const V x = Ld<T, V>(o + r * lp + e);
        dn[r] = x * x;
      }
      for (int m = 1; m <= J; ++m) dd[m] = Ld<T, V>(lev(m, 0) + e) * o0;
      const V dg = Ld<T, V>(d_o + J * lp + e) * Ld<T, V>(o + (J - 1) * lp + e);
      if constexpr (std::is_same_v<T, V>) {
        for (int r = 0; r <= J; ++r) sn[r] += dn[r];
        for (int m = 1; m <= J; ++m) sd[m] += dd[m];
        sg += dg;
      } else {
        for (int r = 0; r <= J; ++r) vn[r] += dn[r];
        for (int m = 1; m <= J; ++m) vd[m] += dd[m];
        vg += dg;
      }
    });
    for (int r = 0; r <= J; ++r)
      coefs.norms[r] = Total<T>(vn[r]) + sn[r] + static_cast<T>(kGramSchmidtEps);
    for (int m = 1; m <= J; ++m) coefs.c[m][0] = (Total<T>(vd[m]) + sd[m]) / coefs.norms[0];
    coefs.dc[J][J - 1] = -(Total<T>(vg) + sg);
  }
  // W(m, i) = W(m, i-1) - c(m, i-1) o_(i-1) for m > i; c(m, i) = <W(m, i), o_i> / |o_i|^2.
  for (int i = 1; i < J; ++i) {
    Simd<T> vd[kMaxKr] = {};
    T sd[kMaxKr] = {};
    ForElements<T>(C, [&]<typename V>(int64_t e) {
      const V x = Ld<T, V>(o + (i - 1) * lp + e);
      const V oi = Ld<T, V>(o + i * lp + e);
      V dd[kMaxKr];
      for (int m = i + 1; m <= J; ++m) {
        const V v = Ld<T, V>(lev(m, i - 1) + e) + Bc<T, V>(-coefs.c[m][i - 1]) * x;
        St<T, V>(lev(m, i) + e, v);
        dd[m] = v * oi;
      }
      if constexpr (std::is_same_v<T, V>) {
        for (int m = i + 1; m <= J; ++m) sd[m] += dd[m];
      } else {
        for (int m = i + 1; m <= J; ++m) vd[m] += dd[m];
      }
    });
    for (int m = i + 1; m <= J; ++m) coefs.c[m][i] = (Total<T>(vd[m]) + sd[m]) / coefs.norms[i];
  }
}

template <typename T>
template <int kJ>
void XhcImpl<T>::GramSchmidtUndo(const T* o, T* d_o, int64_t lp, T* d_out_t, T* dg_t,
                                 const T* levels, GramSchmidtCoefs& coefs) const {
  using residual_internal::Simd;
  const int64_t C = this->width;
  const int J = kJ > 0 ? kJ : J_;  // compile-time when known: the row loops unroll
  auto lev = [&](int m, int i) { return levels + (m * (m - 1) / 2 + i) * lp; };
  // Undo step i of every row m > i: W(m, i+1) = W(m, i) - c v_i, c = <W(m, i), v_i> /
  // (<v_i, v_i> + eps); dW(m, i+1) is d_o[m] (complete: rows above were undone first).
  for (int i = J - 1; i >= 0; --i) {
    T s1[kMaxKr], s2[kMaxKr], s3[kMaxKr];
    for (int m = i + 1; m <= J; ++m) {
      s1[m] = -coefs.c[m][i];
      s2[m] = coefs.dc[m][i] / coefs.norms[i];
      s3[m] = -T(2) * coefs.c[m][i] * coefs.dc[m][i] / coefs.norms[i];
    }
    Simd<T> vd[kMaxKr] = {};
    T sd[kMaxKr] = {};
    ForElements<T>(C, [&]<typename V>(int64_t e) {
      const V v = Ld<T, V>(o + i * lp + e);
      V di = Ld<T, V>(d_o + i * lp + e);
      V dm[kMaxKr];
      for (int m = J; m > i; --m) {
        V d = Ld<T, V>(d_o + m * lp + e);
        di = di + Bc<T, V>(s1[m]) * d;
        di = di + Bc<T, V>(s2[m]) * Ld<T, V>(lev(m, i) + e);
        di = di + Bc<T, V>(s3[m]) * v;
        dm[m] = d + Bc<T, V>(s2[m]) * v;
      }
      if (i > 0) {
        const V vp = Ld<T, V>(o + (i - 1) * lp + e);
        dm[i] = di;
        V dd[kMaxKr];
        for (int m = i; m <= J; ++m) {
          St<T, V>(d_o + m * lp + e, dm[m]);
          dd[m] = dm[m] * vp;
        }
        if constexpr (std::is_same_v<T, V>) {
          for (int m = i; m <= J; ++m) sd[m] += dd[m];
        } else {
          for (int m = i; m <= J; ++m) vd[m] += dd[m];
        }
      } else {
        for (int m = 1; m <= J; ++m) St<T, V>(dg_t + (m - 1) * C + e, dm[m]);
        St<T, V>(d_out_t + e, di);
      }
    });
    if (i > 0)
      for (int m = i; m <= J; ++m) coefs.dc[m][i - 1] = -(Total<T>(vd[m]) + sd[m]);
  }
}

template <typename T>
template <int kJ>
void XhcImpl<T>::GramSchmidtBackwardImpl(const Sublayer& sl, const T* out, int64_t ld, int t,
                                         const T* o, T* d_o, int64_t lp, T* d_out_t, T* dg_t,
                                         T* levels) const {
  const int64_t C = this->width;
  const int J = kJ > 0 ? kJ : J_;  // compile-time when known: the row loops unroll
  if (J == 0) {
    std::memcpy(d_out_t, d_o, sizeof(T) * C);
    return;
  }
  GramSchmidtCoefs coefs;
  GramSchmidtLevels<kJ>(sl, out, ld, t, o, d_o, lp, levels, coefs);
  GramSchmidtUndo<kJ>(o, d_o, lp, d_out_t, dg_t, levels, coefs);
}

// The write-back's backward in stages: per block of kTokenBlock tokens (while the block's
// rows are in cache) the write-back's own gradients token by token, H_res's Sinkhorn
// backward for the block, the active mappings' logit gradients token by token, then dA
// into dX; after all blocks the convolutions' gradients (MLP) and the weight gradients.
template <typename T>
void XhcImpl<T>::WriteBackward(int l, T* d_out) {
  const int64_t kc = k_ * this->width;
  const Sublayer& sl = Sub(l);
  const Group& gr = GroupOf(l);
  const int tokens = this->ntok;
  if (sl.last) std::fill(dp_.begin(), dp_.begin() + static_cast<int64_t>(tokens) * k_, T(0));
  if (wp2_.size() < static_cast<size_t>(PanelSize<T>(sl.P2, kc)))
    wp2_.resize(static_cast<size_t>(PanelSize<T>(sl.P2, kc)));
  PackPanels(Param(sl.w2), kc, sl.P2, kc, wp2_.data());
#pragma omp parallel for schedule(static) if (this->Parallel())
  for (int t0 = 0; t0 < tokens; t0 += kTokenBlock) {
    GradBlock b;
    BeginGradBlock(t0, omp_get_thread_num(), &b);
    for (int i = 0; i < b.tb; ++i) WriteBackTokenBackward(sl, gr, b, i, d_out);
    if (sl.last) MixingBackward(sl, b);
    for (int i = 0; i < b.tb; ++i) ActiveMapsBackward(sl, b, i);
    ScatterActiveGrad(sl, gr, b);
  }
  if (sl.mlp) ConvolutionsBackward(sl, d_out);
  ActiveParamGrads(sl);
}

template <typename T>
void XhcImpl<T>::BeginGradBlock(int t0, int thread, GradBlock* b) {
  const int kk = k_ * k_;
  b->t0 = t0;
  b->tb = std::min(kTokenBlock, this->ntok - t0);
  T* sc = this->Scratch(thread);
  b->da = sc + OffDa();
  b->d_o = sc + OffO();
  b->o_copy = sc + OffOCopy();
  b->tile = sc + OffTile();
  b->levels = sc + OffLevels();
  b->sk_tape = sc + OffSmall();
  b->logits = b->sk_tape + sinkhorn_.tape_size();
  b->hraw = b->logits + kTokenBlock * kk;
  b->dh = b->hraw + kTokenBlock * kk;
  b->dz = b->dh + kTokenBlock * kk;
}

template <typename T>
void XhcImpl<T>::WriteBackTokenBackward(const Sublayer& sl, const Group& gr, GradBlock& b, int i,
                                        T* d_out) {
  const int64_t C = this->width;
  const int64_t nc = this->nstreams * C;
  const int64_t kc = k_ * C;
  const int kk = k_ * k_;
  const int t = b.t0 + i;
  const T* rec = gr.Rec(t);
  const int32_t* idx = gr.Active(t);
  const T* coef = sl.Coef(t);
  const T* hpost = coef + HpostOff(sl);
  const T* a = sl.Saved(t);
  const T* dx = this->dX.data() + static_cast<int64_t>(t) * nc;
  T* scal = scal_.data() + static_cast<int64_t>(t) * ScalStride();
  std::fill(scal, scal + 2 + kk + k_ * sl.Kr, T(0));
  // Direct path of A and the write-back path (A' += diag(p) H_post O): one pass.
  T* dp = dp_.data() + static_cast<int64_t>(t) * k_;
  T go[kMaxK * kMaxKr];
  T post[kMaxK * kMaxKr];
  GatedPost(sl, gr, t, post);
  WriteBackGradArgs<T> args;
  args.C = C;
  args.k = k_;
  args.Kr = sl.Kr;
  for (int j = 0; j < k_; ++j) args.g[j] = dx + idx[j] * C;
  args.a = a;
  args.o = a + kc;
  args.mix = sl.last ? coef + HresOff(sl) : nullptr;
  args.post = post;
  args.da = b.da + i * kc;
  args.d_o = sl.mlp ? b.d_o : d_out + t * C;
  args.o_copy = b.o_copy;
  args.ldp = ScratchRow();
  args.tile = b.tile;
  if (t + 1 < this->ntok) {
    const int32_t* nidx = idx + k_;
    for (int j = 0; j < k_; ++j) args.next_g[j] = dx + nc + nidx[j] * C;
    args.next_rows = a + sl.row_stride;
  }
  args.dh_res = b.dh + i * kk;
  args.go = go;
  FusedWriteBackBackward(args);
  for (int j = 0; j < k_; ++j) {
    const T p = rec[kGate + j];
    T acc = 0;
    for (int r = 0; r < sl.Kr; ++r) {
      acc += hpost[j * sl.Kr + r] * go[j * sl.Kr + r];
      b.dhpost[i][j * sl.Kr + r] = p * go[j * sl.Kr + r];
    }
    dp[j] += acc;
  }
  if (sl.mlp) {
    // v1 = out rows, at stride row_stride.
    GramSchmidtBackward(sl, sl.rows.data() + kc, sl.row_stride, t, b.o_copy, b.d_o, ScratchRow(),
                        d_out + t * C, dg_.data() + static_cast<int64_t>(t) * J_ * C, b.levels);
  }
  if (sl.last) ResLogits(sl, coef + QOff(), b.logits + i * kk);
}

template <typename T>
void XhcImpl<T>::MixingBackward(const Sublayer& sl, GradBlock& b) const {
  const int kk = k_ * k_;
  const T* zs[kTokenBlock];
  const T* dhs[kTokenBlock];
  T* hs[kTokenBlock];
  T* dzs[kTokenBlock];
  for (int i = 0; i < b.tb; ++i) {
    zs[i] = b.logits + i * kk;
    hs[i] = b.hraw + i * kk;
    dhs[i] = b.dh + i * kk;
    dzs[i] = b.dz + i * kk;
  }
  sinkhorn_.ForwardBatch(b.tb, zs, hs, b.sk_tape);
  // The row-sum clamp's backward: identity for rows whose sum is <= 1 (the usual case).
  for (int i = 0; i < b.tb; ++i) {
    const T* hres = sl.Coef(b.t0 + i) + HresOff(sl);
    T* dhi = b.dh + i * kk;
    const T* hi = b.hraw + i * kk;
    for (int j = 0; j < k_; ++j) {
      const T s = ResRowSum(hi, j);
      if (s > T(1)) {
        T gy = 0;
        for (int i2 = 0; i2 < k_; ++i2) gy += dhi[j * k_ + i2] * hres[j * k_ + i2];
        for (int i2 = 0; i2 < k_; ++i2) dhi[j * k_ + i2] = (dhi[j * k_ + i2] - gy) / s;
      }
    }
  }
  sinkhorn_.BackwardBatch(b.tb, zs, b.sk_tape, dhs, dzs);
}

template <typename T>
void XhcImpl<T>::ActiveMapsBackward(const Sublayer& sl, GradBlock& b, int i) {
  const int64_t kc = k_ * this->width;
  const int kk = k_ * k_;
  const int t = b.t0 + i;
  const T* coef = sl.Coef(t);
  const T* q = coef + QOff();
  const T* hpost = coef + HpostOff(sl);
  const T* a = sl.Saved(t);
  T* da = b.da + i * kc;
  T* scal = scal_.data() + static_cast<int64_t>(t) * ScalStride();
  T* c2 = c2_.data() + static_cast<int64_t>(t) * P2Max();
  T sum_dq_q = 0;
  if (sl.last) {
    const T a_res = *Param(sl.a_res);
    const T* dzi = b.dz + i * kk;
    for (int i2 = 0; i2 < kk; ++i2) {
      scal[0] += dzi[i2] * q[i2];
      scal[1 + i2] += dzi[i2];
      const T dq = a_res * dzi[i2];
      c2[i2] = dq;
      sum_dq_q += dq * q[i2];
    }
  }
  const T a_post = *Param(sl.a_post);
  const int off = sl.last ? kk : 0;
  for (int i2 = 0; i2 < k_ * sl.Kr; ++i2) {
    const T h = hpost[i2] / T(2);
    const T dlogit = b.dhpost[i][i2] * T(2) * h * (T(1) - h);
    scal[1 + kk] += dlogit * q[off + i2];
    scal[2 + kk + i2] += dlogit;
    const T dq = a_post * dlogit;
    c2[off + i2] = dq;
    sum_dq_q += dq * q[off + i2];
  }
  const T ra = coef[kRa];
  for (int p = 0; p < sl.P2; ++p) c2[p] /= ra;
  Axpy(-sum_dq_q / (static_cast<T>(kc) * ra * ra), a, da, kc);
}

template <typename T>
void XhcImpl<T>::ScatterActiveGrad(const Sublayer& sl, const Group& gr, const GradBlock& b) {
  const int64_t C = this->width;
  const int64_t nc = this->nstreams * C;
  const int64_t kc = k_ * C;
  // Input gradient of the [w_res | w_post] projection, dA += c2 W2, for the block while
  // its dA rows are in cache; then dA goes to the stream rows of dX.
  ProjectTransposeAddPacked(c2_.data() + static_cast<int64_t>(b.t0) * P2Max(), P2Max(), b.tb,
                            wp2_.data(), sl.P2, kc, b.da, kc);
  for (int i = 0; i < b.tb; ++i) {
    const int t = b.t0 + i;
    const int32_t* idx = gr.Active(t);
    const T* a = sl.Saved(t);
    T* dx = this->dX.data() + static_cast<int64_t>(t) * nc;
    T* x = this->X.data() + static_cast<int64_t>(t) * nc;
    for (int j = 0; j < k_; ++j) {
      std::memcpy(dx + idx[j] * C, b.da + i * kc + j * C, sizeof(T) * C);
      // Walk the state back to this sublayer's input.
      std::memcpy(x + idx[j] * C, a + j * C, sizeof(T) * C);
    }
  }
}

template <typename T>
void XhcImpl<T>::ConvolutionsBackward(const Sublayer& sl, T* d_out) {
  const int64_t C = this->width;
  const int tokens = this->ntok;
  const T* saved_out = sl.rows.data() + static_cast<int64_t>(k_) * C;  // v1 = out rows
  // Convolutions: d_out[t] += sum_j sum_i w_j[i] * dg_j[t + i] (same segment), one pass
  // per tap (as the forward's convolutions), and dw_j[i] += sum_t dg_j[t] * out[t - i] in
  // token order.
  const int32_t* seg = this->segment_of.data();
  const T* dg = dg_.data();
  const T* w[kMaxKr] = {};
  for (int j = 0; j < J_; ++j) w[j] = Param(sl.conv[static_cast<size_t>(j)]);
#pragma omp parallel for schedule(static) if (this->Parallel())
  for (int t = 0; t < tokens; ++t) {
    int taps[kMaxKr];
    for (int j = 0; j < J_; ++j) {
      const int kw = this->config.conv_widths[static_cast<size_t>(j)];
      int i = 0;
      while (i < kw && t + i < tokens && seg[t + i] <= t) ++i;
      taps[j] = i;
    }
    for (int j = 0; j < J_; ++j)
      for (int i = 0; i < taps[j]; ++i)
        MulAdd(w[j] + i * C, dg + (static_cast<int64_t>(t + i) * J_ + j) * C, d_out + t * C, C);
  }
  // Weight gradients: each thread owns a range of channels (a multiple of 16 elements, so
  // the vector/scalar split of every element is that of the serial loop) and walks the
  // tokens in order with one full-range MulAdd per (token, convolution, tap): every
  // element is summed over tokens in ascending order whatever the thread count, from rows
  // streamed contiguously (a loop over tokens per 64-channel block strided 12-32 KiB per
  // token and missed the TLB at every step).
#pragma omp parallel if (this->Parallel())
  {
    const int nth = omp_get_num_threads();
    const int64_t per = ((C + nth - 1) / nth + 15) / 16 * 16;
    const int64_t c0 = std::min<int64_t>(C, omp_get_thread_num() * per);
    const int64_t cn = std::min<int64_t>(C, c0 + per) - c0;
    T* dw[kMaxKr];
    for (int j = 0; j < J_; ++j) dw[j] = this->grad(sl.conv[static_cast<size_t>(j)]);
    for (int t = 0; cn > 0 && t < tokens; ++t)
      for (int j = 0; j < J_; ++j) {
        const int kw = this->config.conv_widths[static_cast<size_t>(j)];
        const T* dgj = dg + (static_cast<int64_t>(t) * J_ + j) * C + c0;
        for (int i = 0; i < kw && t - i >= seg[t]; ++i)
          MulAdd(dgj, saved_out + static_cast<int64_t>(t - i) * sl.row_stride + c0,
                 dw[j] + i * C + c0, cn);
      }
  }
}

template <typename T>
void XhcImpl<T>::ActiveParamGrads(const Sublayer& sl) {
  const int64_t kc = k_ * this->width;
  const int tokens = this->ntok;
  const int kk = k_ * k_;
  const int64_t ss = ScalStride();
  // Weight gradient of [w_res | w_post] over the saved active rows.
  BatchGemm(this->Parallel(), true, false, sl.P2, static_cast<int>(kc), tokens, T(1), c2_.data(),
            P2Max(), sl.rows.data(), sl.row_stride, T(1), this->grad(sl.w2), kc);
  // Scalar parameters, summed over tokens in order.
  T* g_post_a = this->grad(sl.a_post);
  T* g_post_b = this->grad(sl.b_post);
  for (int t = 0; t < tokens; ++t) {
    const T* scal = scal_.data() + static_cast<int64_t>(t) * ss;
    if (sl.last) {
      *this->grad(sl.a_res) += scal[0];
      T* gb = this->grad(sl.b_res);
      for (int i2 = 0; i2 < kk; ++i2) gb[i2] += scal[1 + i2];
    }
    *g_post_a += scal[1 + kk];
    for (int i2 = 0; i2 < k_ * sl.Kr; ++i2) g_post_b[i2] += scal[2 + kk + i2];
  }
}

template <typename T>
void XhcImpl<T>::ReadBackward(int l, const T* d_u) {
  const int N = this->nstreams;
  const Sublayer& sl = Sub(l);
  const Group& gr = GroupOf(l);
  const int tokens = this->ntok;
  const int64_t ss = ScalStride();
#pragma omp parallel for schedule(static) if (this->Parallel())
  for (int t0 = 0; t0 < tokens; t0 += kTokenBlock) {
    const int tb = std::min(kTokenBlock, tokens - t0);
    for (int i = 0; i < tb; ++i) DenseReadBackward(sl, gr, t0 + i, d_u);
    if (sl.s != 0) continue;
    // Group entry: router and every pre-mapping of the group, through LayerNorm / RMSNorm
    // of the full entry state.
    for (int i = 0; i < tb; ++i) EntryTokenBackward(gr, t0 + i);
  }
  T* ga = this->grad(sl.a_pre);
  T* gb = this->grad(sl.b_pre);
  for (int t = 0; t < tokens; ++t) {
    const T* scal = scal_.data() + static_cast<int64_t>(t) * ss;
    *ga += scal[0];
    for (int r = 0; r < N; ++r) gb[r] += scal[1 + r];
  }
  if (sl.s == 0) EntryWeightGrads(gr);
}

template <typename T>
void XhcImpl<T>::DenseReadBackward(const Sublayer& sl, const Group& gr, int t, const T* d_u) {
  const int N = this->nstreams;
  const int64_t C = this->width;
  const int64_t nc = N * C;
  const T a_pre = *Param(sl.a_pre);
  const T* rec = gr.Rec(t);
  const T* x = this->X.data() + static_cast<int64_t>(t) * nc;
  T* dx = this->dX.data() + static_cast<int64_t>(t) * nc;
  const T* du = d_u + t * C;
  T* scal = scal_.data() + static_cast<int64_t>(t) * ScalStride();
  T* dypre = dypre_.data() + (static_cast<int64_t>(t) * g_ + sl.s) * N;
  scal[0] = 0;
  // The read is dense over the current rows: active rows hold A_(s-1), the others the
  // group-entry state (they do not change inside the group).
  for (int r = 0; r < N; ++r) {
    const T h = rec[HpreOff(sl.s) + r];
    const T dh = Dot(du, x + r * C, C);
    Axpy(h, du, dx + r * C, C);
    const T dlogit = dh * h * (T(1) - h);
    scal[0] += dlogit * rec[YpreOff(sl.s) + r];
    scal[1 + r] = dlogit;
    dypre[r] = a_pre * dlogit;
  }
}

template <typename T>
void XhcImpl<T>::EntryTokenBackward(const Group& gr, int t) {
  const int N = this->nstreams;
  const int64_t nc = N * this->width;
  const int P1 = gr.P1;
  const T* rec = gr.Rec(t);
  const int32_t* idx = gr.Active(t);
  const T* x = this->X.data() + static_cast<int64_t>(t) * nc;
  T* dx = this->dX.data() + static_cast<int64_t>(t) * nc;
  T* c1 = c1_.data() + static_cast<int64_t>(t) * P1;
  const T* dp = dp_.data() + static_cast<int64_t>(t) * k_;
  const T mu = rec[kMu], sd = rec[kSd], r = rec[kRms];
  const T D = static_cast<T>(nc);
  std::fill(c1, c1 + N, T(0));
  // Gates of routed streams are their router scores; fixed gates carry no gradient.
  T sum_dy_y_r = 0, sum_dy_cs = 0;
  for (int j = m_; j < k_; ++j) {
    const int p = idx[j];
    const T y = rec[YrOff() + p];
    const T sgm = Sigmoid(y);
    const T dy = dp[j] * sgm * (T(1) - sgm);
    c1[p] = dy / sd;
    sum_dy_y_r += dy * y;
    sum_dy_cs += dy * gr.colsum[static_cast<size_t>(p)];
  }
  T sum_dy_y_pre = 0;
  for (int s = 0; s < g_; ++s) {
    const T* dypre = dypre_.data() + (static_cast<int64_t>(t) * g_ + s) * N;
    for (int p = 0; p < N; ++p) {
      c1[N + s * N + p] = dypre[p] / r;
      sum_dy_y_pre += dypre[p] * rec[YpreOff(s) + p];
    }
  }
  const T alpha = -sum_dy_y_pre / (D * r * r) - sum_dy_y_r / (D * sd * sd);
  const T beta = -sum_dy_cs / (D * sd) + sum_dy_y_r * mu / (D * sd * sd);
  Axpy(alpha, x, dx, nc);
  if (beta != T(0))
    for (int64_t e = 0; e < nc; ++e) dx[e] += beta;
}

template <typename T>
void XhcImpl<T>::EntryWeightGrads(const Group& gr) {
  const int N = this->nstreams;
  const int64_t nc = N * this->width;
  const int tokens = this->ntok;
  const int P1 = gr.P1;
  // Input and weight gradients of the group's router + pre-mapping projection, each one
  // GEMM over all tokens: dX += c1 W1, dW1 += c1^T X (X is the group-entry state here).
  BatchGemm(this->Parallel(), false, false, tokens, static_cast<int>(nc), P1, T(1), c1_.data(), P1,
            Param(gr.w1), nc, T(1), this->dX.data(), nc);
  T* dw1 = this->grad(gr.w1);
  BatchGemm(this->Parallel(), true, false, P1, static_cast<int>(nc), tokens, T(1), c1_.data(), P1,
            this->X.data(), nc, T(1), dw1, nc);
  // LayerNorm centring of the router rows: dW_r[p][e] -= sum_t c1[t][p] mu_t.
  T corr[kMaxN];
  for (int p = 0; p < N; ++p) {
    T s = 0;
    for (int t = 0; t < tokens; ++t) s += c1_[static_cast<size_t>(t) * P1 + p] * gr.Rec(t)[kMu];
    corr[p] = s;
  }
#pragma omp parallel for schedule(static) if (this->Parallel())
  for (int p = 0; p < N; ++p)
    for (int64_t e = 0; e < nc; ++e) dw1[p * nc + e] -= corr[p];
}

}  // namespace

template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeXhcImpl(const ResidualConfig& c) {
  return std::make_unique<XhcImpl<T>>(c);
}

template std::unique_ptr<ResidualStreams<float>::Impl> MakeXhcImpl<float>(const ResidualConfig&);
template std::unique_ptr<ResidualStreams<double>::Impl> MakeXhcImpl<double>(const ResidualConfig&);

}  // namespace rackrun::runtime
