// SinkhornProjection: the entropic projection onto (approximately) doubly stochastic
// matrices used by mhc and xhc mixing (DESIGN.md section 3), with an unrolled backward.
//
// Forward: M0 = exp(Z - rowmax(Z)); then `iters` times: divide every column by
// (column sum + eps), then every row by (row sum + eps). The output ends with a row
// normalisation, so rows sum to 1 within eps; columns only approximately.
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

  // n x n matrices, `iters` >= 1 iterations (callers validate their configs).
  SinkhornProjection(int n, int iters) : n_(n), iters_(iters) {}

  int n() const { return n_; }
  int iters() const { return iters_; }
  // Elements of the tape Forward fills for Backward.
  int64_t tape_size() const {
    return static_cast<int64_t>(n_) * n_ + static_cast<int64_t>(iters_) * (n_ * n_ + 2 * n_);
  }

  // h = Sinkhorn(z), both n x n row-major. `tape` (tape_size() elements) receives the
  // intermediates Backward needs, or is null when no backward follows.
  void Forward(const T* z, T* h, T* tape) const;

  // dz = dL/dz given dh = dL/dh, for the z whose Forward filled `tape`. Overwrites dz.
  // `work` needs 2 * n * n elements.
  void Backward(const T* z, const T* tape, const T* dh, T* dz, T* work) const;

 private:
  int n_;
  int iters_;
};

extern template class SinkhornProjection<float>;
extern template class SinkhornProjection<double>;

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_RESIDUAL_SINKHORN_H_
