// XhcStreams: the xhc residual streams (runtime/residual/residual_streams.h, modes xhc,
// xhc_flash and xhc_flash4), and modes hc and mhc, on a GPU, forward and backward, with the CPU
// component's parameters (same names, sizes, order and initialisation: it builds a CPU
// ResidualStreams<float> once to take them) and its call sequence:
//
//   BeginBatch(tokens, segment_starts)    SetState(host state) or Expand(device embedding)
//   for l: ReadInput(l, u); out = F_l(u); WriteOutput(l, out)        (u, out on the device)
//   Collapse(y)
//   CollapseBackward(dy)
//   for l = L-1..0: WriteOutputBackward(l, d_out); d_u = F_l^T(d_out); ReadInputBackward(l, d_u)
//   StateGradToHost(...) or ExpandBackward(device embedding gradient)
//
// Any other order is a FailedPrecondition. Gradients accumulate until ZeroGrad.
//
// S is the state's element type: float, or __nv_bfloat16 (the state X and the rows saved for
// the backward in bf16; coefficients, u, out, the state gradient and every sum in fp32).
//
// Kernels per sublayer (runtime/cuda/xhc_kernels.h), with groups of g sublayers (xhc g = 1:
// every sublayer is a group's entry and mixes; xhc_flash 2, xhc_flash4 4): ReadInput = at a
// group's entry GEMM z = X W1^T (router + every pre-mapping's logits of the group) +
// ReadEntry (one pass over each token's N x C state: moments, routing, every H_pre, the
// dense read u, the non-active bases of the group's later sublayers, the gather of the k
// active rows); in a later sublayer of a flash group ReadBase (u from its base and the
// current active rows, the gather); then GEMM q = A W2^T + ActiveMaps. WriteOutput = Write
// (convolutions, Gram-Schmidt, mixing in a group's last sublayer only, write-back and
// scatter, in place; of the basis only its first row, out, is saved). The backward mirrors
// them (an MLP sublayer's basis rebuilt from the saved out rows first, RebuildBasis, into
// scratch the sublayers share): the gate gradients accumulate over a group,
// and the entry's ReadInputBackward takes the router's and every pre-mapping's logit
// gradients through the norms and the GEMMs dX += c1 W1, dW1 += c1^T X. traffic() counts the
// bytes each kernel moves to or from device memory (arrays read again from L1/L2 within a
// kernel are counted once), for comparison with docs/design.md's accounting.
//
// hc and mhc (the CPU's hyper_connections.cc; "dense": every sublayer reads, mixes and writes
// the full state) take their own path through the same calls, buffers and parameter
// handling: per sublayer GEMM z = X W^T (hc per stream, mhc over the whole state) + DenseRead
// (the norms, the maps (mhc's H_res by Sinkhorn), the dense read, the input state saved),
// DenseWrite (X' = H_res X + H_post^T out in place); backward DenseWriteBackward,
// DenseReadBackward (mhc's Sinkhorn recomputed), GEMMs dX += c W, dW += c^T X.
//
// Supported: modes xhc, xhc_flash and xhc_flash4 with N <= 32, k <= 4, at most 3
// convolutions, C <= 4096; hc and mhc with N <= 32, C <= 4096; other shapes are an
// InvalidArgument naming the field.
// Not run on a GPU yet (hc, mhc, xhc_flash and xhc_flash4 have never run on one): checked
// against the CPU engine by runtime/cuda/xhc_test.cc, which skips without one.
#ifndef RACKRUN_RUNTIME_CUDA_XHC_H_
#define RACKRUN_RUNTIME_CUDA_XHC_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/cuda/device.h"
#include "runtime/cuda/gemm.h"
#include "runtime/cuda/xhc_kernels.h"
#include "runtime/residual/residual_streams.h"

namespace rackrun::runtime::cuda {

// Bytes one kernel (or GEMM) moved, summed over calls since ResetTraffic.
struct KernelTraffic {
  std::string name;  // "fwd ReadEntry", "bwd GEMM dX += c1 W1", ...
  int64_t read = 0;
  int64_t written = 0;
  int64_t calls = 0;
};

template <typename S>
class XhcStreams {
 public:
  // `gemm`: precision of the GEMMs over fp32 operands (kFp32 or kTf32); the projections of
  // a bf16 state run in bf16 with fp32 accumulation.
  static absl::StatusOr<std::unique_ptr<XhcStreams>> Create(
      Device* device, const ResidualConfig& config, uint64_t seed,
      GemmPrecision gemm = GemmPrecision::kFp32);
  ~XhcStreams();

  const ResidualConfig& config() const { return config_; }
  // Device pointers, in the CPU component's order and names.
  std::vector<ParamRef<float>> Parameters();
  // Every parameter value from a CPU component of the same configuration (by name).
  absl::Status CopyParametersFrom(ResidualStreams<float>& cpu);
  // Every parameter gradient, in Parameters() order, concatenated.
  absl::Status GradientsToHost(std::vector<float>* grads);
  absl::Status ZeroGrad();

  absl::Status BeginBatch(int tokens, std::span<const int32_t> segment_starts);
  absl::Status SetState(std::span<const float> state);  // host, tokens x N x C
  // Instead of SetState: every stream a copy of the embedding (device, tokens x C), as
  // ResidualStreams::Expand.
  absl::Status Expand(const float* embedded);
  // After a complete backward: d_embedded (device, tokens x C, overwritten) = the state
  // gradient summed over the streams (ResidualStreams::ExpandBackward).
  absl::Status ExpandBackward(float* d_embedded);
  // After a complete backward the state is walked back to the batch's input: run the same
  // batch again from it (a benchmark's repetitions) without copying a state in.
  absl::Status RestartFromInputState();
  absl::Status ReadInput(int sublayer, float* u);  // device, tokens x C
  absl::Status WriteOutput(int sublayer, const float* out);
  absl::Status Collapse(float* y);
  absl::Status CollapseBackward(const float* dy);
  absl::Status WriteOutputBackward(int sublayer, float* d_out);
  absl::Status ReadInputBackward(int sublayer, const float* d_u);

  absl::Status StateToHost(std::vector<float>* state);
  absl::Status StateGradToHost(std::vector<float>* d_state);
  // The mappings of `sublayer` for every token (host copies), as ResidualStreams::Maps.
  absl::StatusOr<std::vector<SublayerMaps<float>>> Maps(int sublayer);

  const std::vector<KernelTraffic>& traffic() const { return traffic_; }
  void ResetTraffic() { traffic_.clear(); }
  // Bytes of all kernels in traffic() (read + written).
  int64_t TrafficBytes() const;

 private:
  struct Sublayer;
  XhcStreams(Device* device, const ResidualConfig& config, GemmPrecision gemm);
  absl::Status Init(uint64_t seed);
  // The parameter offset of "sublayer<l>.<what>" (of `what` itself for l < 0); -1 if none.
  int64_t OffsetOf(int sublayer, const std::string& what) const;
  // A sublayer's parameter offsets, checked against the layout the kernels read.
  absl::Status InitXhcSublayer(int sublayer, Sublayer& s);
  absl::Status InitDenseSublayer(int sublayer, Sublayer& s);
  absl::Status Reserve(int tokens);
  // The first sublayer of `sublayer`'s group (it holds the group's records and active sets).
  Sublayer& EntryOf(int sublayer);
  // ReadInput at a group's entry: the projections of the full state and ReadEntry.
  absl::Status ReadGroupEntry(int sublayer, float* u);
  // An MLP sublayer's basis rows (RebuildBasis, from its saved out rows) in basis_; null for an
  // attention sublayer, which has none beyond out.
  absl::StatusOr<const S*> RebuiltBasis(int sublayer);
  // ReadInputBackward at a group's entry: dX += c1 W1, dW1 += c1^T X, the router centring.
  absl::Status EntryWeightGrads(int sublayer);
  // Modes hc and mhc ("dense": every sublayer updates the full state): their layout, buffers,
  // four calls (after the order checks) and Maps.
  bool Dense() const {
    return config_.mode == ResidualMode::kHc || config_.mode == ResidualMode::kMhc;
  }
  xhc::DenseLayout DenseLayoutOf() const;
  absl::Status ReserveDense(int tokens);
  absl::Status DenseReadInput(int sublayer, float* u);
  absl::Status DenseWriteOutput(int sublayer, const float* out);
  absl::Status DenseWriteOutputBackward(int sublayer, float* d_out);
  absl::Status DenseReadInputBackward(int sublayer, const float* d_u);
  absl::StatusOr<std::vector<SublayerMaps<float>>> DenseMaps(int sublayer);
  xhc::Layout LayoutOf(int sublayer) const;
  xhc::MapParams MapsOf(int sublayer);
  absl::Status Check(cudaError_t e, const char* what) const;
  absl::Status Order(bool ok, const char* call, int sublayer) const;
  void Count(const char* name, int64_t read, int64_t written);
  // The bf16 copy of `n` parameters at `offset` (bf16 states' GEMMs).
  absl::StatusOr<const bf16*> ShadowOf(int64_t offset, int64_t n);
  // out = rows W^T for the weight at parameter offset `weight` (shape.n x shape.k): in the
  // fp32 GEMMs' precision, or bf16 x bf16 (the weight's shadow) for a bf16 state.
  absl::Status Project(const GemmShape& shape, const S* rows, int64_t weight, float* out);
  // grads[grad] += coeffs^T rows: coeffs (coeff_count fp32 values) copied to bf16 first
  // for a bf16 state.
  absl::Status WeightGrad(const GemmShape& shape, const float* coeffs, int64_t coeff_count,
                          const S* rows, int64_t grad);

  Device* device_;
  ResidualConfig config_;
  GemmPrecision gemm_precision_;
  Gemm gemm_;
  int N_ = 0, C_ = 0, k_ = 0, m_ = 0, J_ = 0, L_ = 0;
  std::vector<std::string> names_;
  std::vector<int64_t> offsets_, sizes_;
  std::vector<std::vector<int64_t>> shapes_;  // the CPU component's (ParamRef::shape)
  std::map<std::string, int64_t> offset_of_;
  int64_t param_count_ = 0;
  DeviceTensor<float> values_, grads_;
  DeviceTensor<bf16> shadow_;  // bf16 states: bf16 copies of W1 and W2 per call
  std::vector<std::unique_ptr<Sublayer>> sub_;

  int tokens_ = 0, capacity_ = 0;
  std::vector<int32_t> segment_host_;
  DeviceTensor<int32_t> segment_;
  DeviceTensor<S> x_;
  DeviceTensor<float> dx_;
  // Scratch shared by the sublayers.
  DeviceTensor<float> z_, q_, da_, dg_, dp_, c2_, wscal_, rscal_, c1_, base_, dypre_, tape_,
      partial_, corr_;
  DeviceTensor<bf16> c_bf16_;
  // An MLP sublayer's basis rows, rebuilt in its backward from its saved out rows.
  DeviceTensor<S> basis_;
  int forward_pos_ = -1, backward_pos_ = -1;
  std::vector<KernelTraffic> traffic_;
};

extern template class XhcStreams<float>;
extern template class XhcStreams<bf16>;

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_XHC_H_
