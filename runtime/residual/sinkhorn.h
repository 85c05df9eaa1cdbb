// SinkhornProjection: the entropic projection onto (approximately) doubly stochastic
// matrices used by mhc and xhc mixing (docs/design.md section 5.3), with an unrolled backward.
//
// Forward: M0 = exp(Z - rowmax(Z)); then `iters` times: divide every column by
// (column sum + eps), then every row by (row sum + eps). The output ends with a row
// normalisation, so rows sum to 1 within eps; columns only approximately.
//
// Batches of up to 8 matrices run one per vector lane (the per-token Sinkhorn of 4 x 4
// mixing matrices with 20 iterations is a chain of ~700 scalar divisions otherwise);
// every lane does the scalar algorithm's operations in its order.
//
// Backward unrolls the iterations exactly. For y = x / (s + eps), s = sum(x) over the
// normalised axis: dx = (g - sum(g * y)) / (s + eps). The exp start gives dZ = dM0 * M0
// plus the term through the row max (dZ[a][argmax_a] -= sum_b dM0 * M0), which the design's
// short formula omits: the output is not exactly invariant to a row shift after a finite
// number of iterations, so the exact gradient needs it.
#ifndef RACKRUN_RUNTIME_RESIDUAL_SINKHORN_H_
#define RACKRUN_RUNTIME_RESIDUAL_SINKHORN_H_

#include <cstdint>

namespace rackrun::runtime {

template <typename T>
class SinkhornProjection {
 public:
  static constexpr double kEps = 1e-6;
  static constexpr int kMaxN = 16;
  // Matrices per batch: one per vector lane (8 floats fill an AVX2 register).
  static constexpr int kBatch = 8;

  // n x n matrices, 1 <= n <= kMaxN, `iters` >= 1 iterations (callers validate their
  // configs).
  SinkhornProjection(int n, int iters);

  int n() const { return n_; }
  int iters() const { return iters_; }
  // Elements of the tape a forward fills for the backward (room for a whole batch).
  int64_t tape_size() const {
    return kBatch *
           (static_cast<int64_t>(n_) * n_ + static_cast<int64_t>(iters_) * (n_ * n_ + 2 * n_));
  }

  // Batches of `count` (1..kBatch) independent matrices, matrix i at z[i] -> h[i] (each
  // n x n, row-major), computed one per vector lane: the lanes never mix, so a matrix's
  // result is bitwise the same whatever the batch it is in (and its position in it).
  // `tape` (tape_size() elements) receives the intermediates BackwardBatch needs, or is
  // null when no backward follows.
  void ForwardBatch(int count, const T* const* z, T* const* h, T* tape) const;
  // dz[i] = dL/dz[i] given dh[i] = dL/dh[i], for the batch whose ForwardBatch filled
  // `tape` (same count, same z).
  void BackwardBatch(int count, const T* const* z, const T* tape, const T* const* dh,
                     T* const* dz) const;

  // One matrix: a batch of one.
  void Forward(const T* z, T* h, T* tape) const { ForwardBatch(1, &z, &h, tape); }
  void Backward(const T* z, const T* tape, const T* dh, T* dz) const {
    BackwardBatch(1, &z, tape, &dh, &dz);
  }

 private:
  int n_;
  int iters_;
};

extern template class SinkhornProjection<float>;
extern template class SinkhornProjection<double>;

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_RESIDUAL_SINKHORN_H_
