// Private: the per-mode kernel interface behind ResidualStreams (see residual_streams.h)
// and the state every mode shares. Each mode lives in its own .cc file.
#ifndef RACKRUN_RUNTIME_RESIDUAL_RESIDUAL_IMPL_H_
#define RACKRUN_RUNTIME_RESIDUAL_RESIDUAL_IMPL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/residual/residual_streams.h"

namespace rackrun::runtime {

template <typename T>
struct ResidualStreams<T>::Impl {
  explicit Impl(const ResidualConfig& c);
  virtual ~Impl() = default;

  // ---- per-mode hooks (all shapes validated by the caller) ----
  // Declares parameters with AddParam, then sets their values (docs/design.md section 5.6).
  virtual void DeclareParameters() = 0;
  virtual void InitParameters(uint64_t seed) = 0;
  // Grows workspaces to `capacity` tokens; called only when it grows (or save turns on).
  virtual void Reserve() = 0;
  virtual void Read(int l, T* u) = 0;
  virtual void Write(int l, const T* out) = 0;
  virtual void WriteBackward(int l, T* d_out) = 0;
  virtual void ReadBackward(int l, const T* d_u) = 0;
  virtual SublayerMaps<T> Maps(int l, int t) const = 0;

  // Appends a zero-initialised parameter; returns its offset into values/grads.
  int64_t AddParam(std::string name, int64_t size);
  T* value(int64_t offset) { return values.data() + offset; }
  T* grad(int64_t offset) { return grads.data() + offset; }
  // Adds per-token element counts times `tokens` to the named traffic step.
  void Count(std::string_view step, double paper_read, double paper_written, double fused_read,
             double fused_written);
  // Whether a batch is large enough for OpenMP to pay (tiny test batches run serially;
  // results do not depend on it: per-token work and per-slice weight sums are the same).
  bool Parallel() const { return static_cast<int64_t>(ntok) * nstreams * width >= (1 << 15); }
  // Runs body(t) for every token t, over the OpenMP threads (static schedule) when
  // Parallel().
  template <typename Body>
  void ForEachToken(Body&& body) const {
#pragma omp parallel for schedule(static) if (Parallel())
    for (int t = 0; t < ntok; ++t) body(t);
  }
  // Per-thread scratch of scratch_per_thread elements.
  T* Scratch(int thread) {
    return scratch.data() + static_cast<int64_t>(thread) * scratch_per_thread;
  }

  ResidualConfig config;
  int nstreams = 1;  // N
  int width = 0;     // C
  int nsub = 0;      // L, sublayers

  struct ParamSlot {
    std::string name;
    int64_t offset = 0;
    int64_t size = 0;
  };
  std::vector<T> values;
  std::vector<T> grads;
  std::vector<ParamSlot> slots;

  int ntok = 0;      // tokens of the current batch
  int capacity = 0;  // tokens the workspaces hold
  bool save = true;
  bool reserved_save = false;       // whether the backward workspaces exist at `capacity`
  std::vector<int32_t> segment_of;  // per token: the first token of its segment
  std::vector<T> X;                 // tokens x N x C
  std::vector<T> dX;                // tokens x N x C (backward)
  std::vector<T> scratch;
  int64_t scratch_per_thread = 0;
  // Panel-packed copy of one weight matrix for the backward's input gradient; grows on
  // first use only.
  std::vector<T> packed;
  const T* Pack(const T* w, int P, int64_t K);
  int threads = 1;

  ResidualTraffic traffic;

  // Call-sequence check: forward positions 0 (Expand), 1 + 2l (Read), 2 + 2l (Write),
  // 2L + 1 (Collapse); the backward walks them down from 2L + 1.
  bool batch_ready = false;
  int forward_pos = -1;
  int backward_pos = -1;
};

// Mode factories (one per .cc file).
template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeVanillaImpl(const ResidualConfig& c);
template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeHcImpl(const ResidualConfig& c);
template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeMhcImpl(const ResidualConfig& c);
template <typename T>
std::unique_ptr<typename ResidualStreams<T>::Impl> MakeXhcImpl(const ResidualConfig& c);

}  // namespace rackrun::runtime

#endif  // RACKRUN_RUNTIME_RESIDUAL_RESIDUAL_IMPL_H_
