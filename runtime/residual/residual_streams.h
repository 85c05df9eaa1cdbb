// ResidualStreams: the widened residual stream of a transformer (docs/design.md section 5).
//
// One component implements every residual mode: vanilla, hc (Hyper-Connections), mhc
// (Manifold-Constrained HC), xhc (Expanded HC: router + dense read + active-set Sinkhorn
// mixing + temporally augmented write-back), and the cheaper schedules xhc_flash (group
// of g=2 sublayers) and xhc_flash4 (g=4). The caller owns the sublayer bodies F
// (attention, MoE/MLP, each including its own pre-norm); this component owns everything
// outside F, forward and backward, including the gradients of all mapping parameters.
//
// Call sequence for one microbatch (L = config.sublayers.size()):
//
//   BeginBatch(tokens, segment_starts)          // shape; allocates only when it grows
//   Expand(embedding)   (or SetState(state))    // tokens x C -> state tokens x N x C
//   for l in 0..L-1:
//     ReadInput(l, u)                           // u: tokens x C, the body input
//     out = F_l(u)                              // caller
//     WriteOutput(l, out)                       // out: tokens x C, written into the streams
//   Collapse(y)                                 // y = sum of the N streams (caller applies
//                                               // the final RMSNorm and LM head)
//   --- backward: exactly the reverse order ---
//   CollapseBackward(dy)                        // starts the state gradient
//   for l in L-1..0:
//     WriteOutputBackward(l, d_out)             // gives dL/d out
//     d_u = F_l backward(d_out)                 // caller, through F
//     ReadInputBackward(l, d_u)                 // takes dL/d u
//   ExpandBackward(d_embedding)  (or StateBackward(d_state))
//
// Any other order is a FailedPrecondition error (the sequence is checked per call), and
// every shape mismatch is an InvalidArgument naming the argument; nothing crashes.
//
// Saved state. The forward keeps what the backward needs inside the component, per
// sublayer, for the current microbatch (when BeginBatch's save_for_backward is true):
// mhc/hc the full pre-update state, xhc the k pre-update active rows plus the write-back
// basis O, flash modes the active block before each sublayer. During the backward the
// component walks the state back to each sublayer's input by restoring the saved rows, so
// the full N x C state is never stored per sublayer in xhc modes. The next BeginBatch
// invalidates the saved state.
//
// Flash modes. A group is g consecutive sublayers (g = 2 or 4) starting at a multiple of g;
// its last sublayer must be an MLP. Routing and all pre-mappings are computed from the
// group-entry state at the group's first ReadInput; the active block lives in the state's
// active rows between the group's ReadInput/WriteOutput calls (so state() mid-group is
// not the xhc state).
//
// Gradients accumulate (+=) into the parameter grad buffers across microbatches until
// ZeroGrad(). Results are deterministic for a fixed OpenMP thread count (static
// schedules, fixed reduction orders). T is float (training) or double (gradient checks):
// the same code is instantiated for both.
//
// Thread safety: none; one instance per worker thread group, calls from one thread (the
// kernels use OpenMP internally).
#ifndef RACKRUN_RUNTIME_RESIDUAL_RESIDUAL_STREAMS_H_
#define RACKRUN_RUNTIME_RESIDUAL_RESIDUAL_STREAMS_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::runtime {

enum class ResidualMode { kVanilla, kHc, kMhc, kXhc, kXhcFlash, kXhcFlash4 };

// "vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"; InvalidArgument otherwise.
absl::StatusOr<ResidualMode> ParseResidualMode(std::string_view name);
std::string_view ResidualModeName(ResidualMode mode);

enum class SublayerKind { kAttention, kMlp };

struct ResidualConfig {
  ResidualMode mode = ResidualMode::kXhc;
  int width = 0;                              // C
  int streams = 16;                           // N
  int active = 4;                             // k: streams updated per sublayer (xhc modes)
  int fixed = 2;                              // m: always-active streams 0..m-1 (xhc modes)
  int sinkhorn_iters = 20;                    // mhc and xhc modes
  std::vector<int> conv_widths = {4, 8, 12};  // xhc MLP write-back: K_r = 1 + size
  std::vector<SublayerKind> sublayers;        // the model's sublayers in order

  // The papers' defaults for `mode`: vanilla N=1; hc and mhc N=4; xhc modes N=16, k=4,
  // m=2; 20 Sinkhorn iterations; convolutions 4, 8, 12.
  static ResidualConfig ForMode(ResidualMode mode, int width, std::vector<SublayerKind> sublayers);
  // `blocks` transformer blocks: attn, mlp, attn, mlp, ... (2 * blocks sublayers).
  static std::vector<SublayerKind> Transformer(int blocks);

  // OK, or InvalidArgument naming the field and the fix (non-positive width, k > N,
  // m > k, vanilla with N != 1, empty sublayers, flash groups not ending in an MLP, ...).
  absl::Status Validate() const;

  int group_size() const;  // 1; 2 for xhc_flash; 4 for xhc_flash4
};

// One parameter tensor of the residual mappings and its gradient buffer (same size).
// Names look like "sublayer3.w_pre" or "group1.w_router". Matrices are row-major with one
// row per output, each row over the flattened input:
//  - hc:  sublayerL.w (N + 2) x C, rows [m | r_0..r_(N-1) | b]; s_a, s_b; a_m0 N;
//         a_r0 N x N; b0 N.
//  - mhc: sublayerL.w (2N + N*N) x (N*C), rows [pre | post | res]; a_pre, a_post, a_res;
//         b_pre N; b_post N; b_res N x N.
//  - xhc modes: w_router N x (N*C) (per sublayer for xhc, "groupG.w_router" per flash
//         group); w_pre N x (N*C); a_pre, b_pre N; w_res k*k x (k*C) and a_res, b_res k x k
//         (only in sublayers that mix: all for xhc, a group's last for flash); w_post
//         (k*K_r) x (k*C), a_post, b_post k x K_r; MLP sublayers conv0.. (width_j x C).
// Router weights start ~ N(0, 0.02) (seeded); everything else as docs/design.md section 5.6 says.
template <typename T>
struct ParamRef {
  std::string name;
  T* value = nullptr;
  T* grad = nullptr;
  int64_t size = 0;
  // Its dimensions, outermost first (exported weights keep them); empty: a vector of `size`.
  std::vector<int64_t> shape;
};

// Memory traffic of the forward kernels, in elements (multiply by sizeof(T) for bytes),
// summed over tokens since ResetTraffic(). Expand/Collapse are not counted (they are not
// per-sublayer work). Two accountings of the same calls:
//  - paper: the xHC paper's row-by-row accounting, each step an unfused pass (docs/design.md
//    section 5.8); for flash modes the same style applied to our schedule;
//  - fused: what our kernels actually move to or from memory: an array is counted once
//    per kernel call even when a per-token block is revisited from cache, and the
//    rows saved for the backward are counted as their own step.
struct TrafficStep {
  std::string name;
  int64_t paper_read = 0;
  int64_t paper_written = 0;
  int64_t fused_read = 0;
  int64_t fused_written = 0;
};
struct ResidualTraffic {
  std::vector<TrafficStep> steps;  // in first-seen order
  int64_t sublayer_tokens = 0;     // sum over WriteOutput calls of tokens
  // Totals in units of C per token per sublayer (0 when nothing ran).
  double PaperPerSublayer(int width) const;
  double FusedPerSublayer(int width) const;
};

// The mappings one sublayer applied to one token (introspection for tests and metrics).
// Streams are ordered as the mode uses them: xhc modes list the active set (fixed streams
// first, then routed ones ascending) and its gates; hc/mhc list all N streams, gates 1.
template <typename T>
struct SublayerMaps {
  std::vector<int> active;  // k stream indices
  std::vector<T> gates;     // k gates p_j
  std::vector<T> h_pre;     // N read weights (hc: A_m)
  std::vector<T> h_res;     // k x k mixing (hc: A_r, N x N); empty when the sublayer does not mix
  std::vector<T> h_post;    // k x K_r write-back weights (hc: B)
};

template <typename T>
class ResidualStreams {
 public:
  // Validates `config` and initialises the mapping parameters exactly as docs/design.md
  // section 5.6 says (random draws only for xhc routers, from `seed`).
  static absl::StatusOr<ResidualStreams> Create(const ResidualConfig& config, uint64_t seed);

  ResidualStreams(ResidualStreams&&) noexcept;
  ResidualStreams& operator=(ResidualStreams&&) noexcept;
  ~ResidualStreams();

  const ResidualConfig& config() const;
  int streams() const;  // N

  // Every mapping parameter with its grad buffer; pointers stay valid for the object's
  // lifetime (also across moves). Empty for vanilla.
  std::vector<ParamRef<T>> Parameters();
  void ZeroGrad();

  // Sets the microbatch shape: `tokens` rows and the segment starts (token indices where
  // a sequence or document begins; token 0 always begins one; temporal convolutions never
  // cross a start). Starts must be increasing and in [0, tokens).
  absl::Status BeginBatch(int tokens, std::span<const int32_t> segment_starts,
                          bool save_for_backward = true);

  absl::Status Expand(std::span<const T> embedding);           // tokens x C
  absl::Status SetState(std::span<const T> state);             // tokens x N x C, instead of Expand
  absl::Status ReadInput(int sublayer, std::span<T> body_in);  // tokens x C
  absl::Status WriteOutput(int sublayer, std::span<const T> body_out);  // tokens x C
  absl::Status Collapse(std::span<T> out);                              // tokens x C

  absl::Status CollapseBackward(std::span<const T> d_out);
  absl::Status WriteOutputBackward(int sublayer, std::span<T> d_body_out);
  absl::Status ReadInputBackward(int sublayer, std::span<const T> d_body_in);
  absl::Status ExpandBackward(std::span<T> d_embedding);  // overwrites
  absl::Status StateBackward(std::span<T> d_state);       // overwrites, tokens x N x C

  // The current state, tokens x N x C (token-major, then stream, then channel).
  std::span<const T> state() const;

  // The mappings of `sublayer` for `token` in the current batch; FailedPrecondition before
  // that sublayer's ReadInput ran, InvalidArgument for indices out of range.
  absl::StatusOr<SublayerMaps<T>> Maps(int sublayer, int token) const;

  const ResidualTraffic& traffic() const;
  void ResetTraffic();

  struct Impl;  // per-mode kernels, defined in the .cc files

 private:
  explicit ResidualStreams(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

extern template class ResidualStreams<float>;
extern template class ResidualStreams<double>;

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_RESIDUAL_RESIDUAL_STREAMS_H_
