// The CUDA simulator itself: barriers and warp shuffles as CUDA defines them, the stream
// order (work runs when the host waits for it), copies checked against where pointers
// point, launches refused as the GPU refuses them, and the stops for a barrier that cannot
// be passed and a shuffle with a lane that returned; host code touching device memory stops, and so
// does a host write to a pinned copy source before the copy ran; shared memory above 48 KiB by
// opt-in, and a write past it stops; the warp matrix operations (wmma.h) and their alignment stop;
// the census of launches, copies and waits.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "runtime/cuda/sim/kernel.h"
#include "runtime/cuda/sim/runtime.h"
#include "runtime/cuda/sim/wmma.h"

namespace rackrun::runtime::cuda {
namespace {

// Each thread writes its index, the block waits, each reads its mirror's.
__global__ void MirrorKernel(int n, int* out) {
  __shared__ int s[256];
  const int t = static_cast<int>(threadIdx.x);
  s[t] = t + static_cast<int>(blockIdx.x) * 1000;
  __syncthreads();
  out[blockIdx.x * n + t] = s[n - 1 - t];
}

// A warp sum by xor shuffles, then lane 0 of each warp writes it.
__global__ void WarpSumKernel(const float* in, float* out) {
  float v = in[threadIdx.x];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  out[threadIdx.x] = v;
}

__global__ void ShuffleKindsKernel(int* down, int* up, int* bcast) {
  const int lane = static_cast<int>(threadIdx.x);
  down[lane] = __shfl_down_sync(0xffffffffu, lane, 3);
  up[lane] = __shfl_up_sync(0xffffffffu, lane, 2);
  bcast[lane] = __shfl_sync(0xffffffffu, lane * 10, 5);
}

// Half a warp waits at the block's barrier, the other half at a shuffle with the whole
// warp: neither can go on (a hang on a GPU).
__global__ void BarrierInBranchKernel(float* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
  }
}

__global__ void ShuffleAfterReturnKernel(float* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Each thread notes when it ran (a counter every thread increments), before and after a
// barrier.
__global__ void RunOrderKernel(int* counter, int* first, int* second) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  first[i] = atomicAdd(counter, 1);
  __syncthreads();
  second[i] = atomicAdd(counter, 1);
}

// A race between blocks: every block writes the same element.
__global__ void LastBlockWinsKernel(int* out) {
  if (threadIdx.x == 0) out[0] = static_cast<int>(blockIdx.x);
}

__global__ void FillKernel(int n, float value, float* out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = value;
}

__global__ void DynamicSharedKernel(float* out) {
  RACKRUN_DYNAMIC_SHARED(float, s);
  s[threadIdx.x] = static_cast<float>(threadIdx.x) * 2.0f;
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
  return static_cast<T*>(p);
}

template <typename T>
T* PinnedAlloc(size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cudaHostAlloc(&p, n * sizeof(T), 0), cudaSuccess);
  return static_cast<T*>(p);
}

TEST(CudaSimTest, BlockBarrierAndSharedMemory) {
  constexpr int kThreads = 256, kBlocks = 3;
  int* out = DeviceAlloc<int>(kThreads * kBlocks);
  Launch(MirrorKernel, kBlocks, kThreads, 0, nullptr)(kThreads, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<int> host(kThreads * kBlocks);
  ASSERT_EQ(cudaMemcpy(host.data(), out, host.size() * sizeof(int), cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int b = 0; b < kBlocks; ++b)
    for (int t = 0; t < kThreads; ++t)
      EXPECT_EQ(host[b * kThreads + t], kThreads - 1 - t + b * 1000);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
}

// Forward: blocks in order, threads in order between barriers; reverse: both descending, so
// a kernel whose result depends on the order (a race on a GPU) gives another result.
TEST(CudaSimTest, BlocksAndThreadsRunForwardOrInReverse) {
  const sim::ScheduleOrder before = sim::GetScheduleOrder();
  constexpr int kBlocks = 3, kThreads = 4, kAll = kBlocks * kThreads;
  int* counter = DeviceAlloc<int>(1);
  int* first = DeviceAlloc<int>(kAll);
  int* second = DeviceAlloc<int>(kAll);
  int* winner = DeviceAlloc<int>(1);
  for (sim::ScheduleOrder order : {sim::ScheduleOrder::kForward, sim::ScheduleOrder::kReverse}) {
    const bool reverse = order == sim::ScheduleOrder::kReverse;
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    sim::SetScheduleOrder(order);
    ASSERT_EQ(cudaMemset(counter, 0, sizeof(int)), cudaSuccess);
    Launch(RunOrderKernel, kBlocks, kThreads, 0, nullptr)(counter, first, second);
    Launch(LastBlockWinsKernel, kBlocks, 32, 0, nullptr)(winner);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int> got_first(kAll), got_second(kAll), want_first(kAll), want_second(kAll);
    int got_winner = -1;
    ASSERT_EQ(cudaMemcpy(got_first.data(), first, kAll * sizeof(int), cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_second.data(), second, kAll * sizeof(int), cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&got_winner, winner, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int b = 0; b < kBlocks; ++b) {
      for (int t = 0; t < kThreads; ++t) {
        // The block's run position, then the thread's inside it, before and after the barrier.
        const int rb = reverse ? kBlocks - 1 - b : b, rt = reverse ? kThreads - 1 - t : t;
        want_first[b * kThreads + t] = rb * 2 * kThreads + rt;
        want_second[b * kThreads + t] = rb * 2 * kThreads + kThreads + rt;
      }
    }
    EXPECT_EQ(got_first, want_first);
    EXPECT_EQ(got_second, want_second);
    EXPECT_EQ(got_winner, reverse ? 0 : kBlocks - 1);
  }
  sim::SetScheduleOrder(before);
  for (int* p : {counter, first, second, winner}) EXPECT_EQ(cudaFree(p), cudaSuccess);
}

TEST(CudaSimTest, WarpShuffles) {
  constexpr int kThreads = 64;
  std::vector<float> in(kThreads);
  std::iota(in.begin(), in.end(), 1.0f);
  float* din = DeviceAlloc<float>(kThreads);
  float* dout = DeviceAlloc<float>(kThreads);
  ASSERT_EQ(cudaMemcpy(din, in.data(), sizeof(float) * kThreads, cudaMemcpyHostToDevice),
            cudaSuccess);
  Launch(WarpSumKernel, 1, kThreads, 0, nullptr)(din, dout);
  std::vector<float> out(kThreads);
  ASSERT_EQ(cudaMemcpy(out.data(), dout, sizeof(float) * kThreads, cudaMemcpyDeviceToHost),
            cudaSuccess);
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(out[t], t < 32 ? 528.0f : 1552.0f) << t;

  int* d = DeviceAlloc<int>(96);
  Launch(ShuffleKindsKernel, 1, 32, 0, nullptr)(d, d + 32, d + 64);
  std::vector<int> h(96);
  ASSERT_EQ(cudaMemcpy(h.data(), d, sizeof(int) * 96, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(h[l], l + 3 < 32 ? l + 3 : l);  // out of range: the lane's own value
    EXPECT_EQ(h[32 + l], l >= 2 ? l - 2 : l);
    EXPECT_EQ(h[64 + l], 50);
  }
  for (void* p : {static_cast<void*>(din), static_cast<void*>(dout), static_cast<void*>(d)})
    EXPECT_EQ(cudaFree(p), cudaSuccess);
}

TEST(CudaSimTest, DynamicSharedMemory) {
  float* out = DeviceAlloc<float>(64);
  Launch(DynamicSharedKernel, 1, 64, 64 * sizeof(float), nullptr)(out);
  std::vector<float> h(64);
  ASSERT_EQ(cudaMemcpy(h.data(), out, sizeof(float) * 64, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(h[t], static_cast<float>((t + 1) % 64) * 2.0f);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
}

TEST(CudaSimTest, WorkRunsWhenTheHostWaitsForIt) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t e = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  constexpr int kN = 100;
  float* d = DeviceAlloc<float>(kN);
  float* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), sizeof(float) * kN, 0), cudaSuccess);
  std::fill(pinned, pinned + kN, 0.0f);
  Launch(FillKernel, 1, 128, 0, s)(kN, 3.0f, d);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, sizeof(float) * kN, cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  // Nothing has run: a host that reads now reads the old bytes.
  EXPECT_EQ(pinned[0], 0.0f);
  // The legacy stream's cudaMemcpy does not wait for a non-blocking stream: the device
  // memory is still unwritten (all-ones bytes: NaN).
  float first = 0;
  ASSERT_EQ(cudaMemcpy(&first, d, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(first));
  // Polling makes progress and ends.
  int polls = 0;
  cudaError_t q;
  while ((q = cudaEventQuery(e)) == cudaErrorNotReady) ++polls;
  EXPECT_EQ(q, cudaSuccess);
  EXPECT_GT(polls, 0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // not ready is not an error
  EXPECT_EQ(pinned[kN - 1], 3.0f);

  // A stream waiting for an event runs the recorded stream's work first.
  cudaStream_t t = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking), cudaSuccess);
  Launch(FillKernel, 1, 128, 0, s)(kN, 5.0f, d);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(t, e, 0), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, sizeof(float) * kN, cudaMemcpyDeviceToHost, t), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(t), cudaSuccess);
  EXPECT_EQ(pinned[0], 5.0f);

  // A copy to pageable memory returns when it is done.
  std::vector<float> pageable(kN);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), d, sizeof(float) * kN, cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  EXPECT_EQ(pageable[7], 5.0f);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(t), cudaSuccess);
}

// The census counts what the host asked, by kind, and starts again when taken.
TEST(CudaSimTest, TheCensusCountsLaunchesCopiesAndWaits) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t e = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  constexpr int kN = 64;
  sim::TakeCensus();
  float* d = DeviceAlloc<float>(2 * kN);
  float* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), sizeof(float) * kN, 0), cudaSuccess);
  std::vector<float> pageable(kN, 1.0f);
  Launch(FillKernel, 1, 128, 0, s)(kN, 3.0f, d);
  Launch(FillKernel, 1, 128, 0, s)(kN, 4.0f, d + kN);
  ASSERT_EQ(cudaMemcpyAsync(d, pageable.data(), sizeof(float) * kN, cudaMemcpyHostToDevice, s),
            cudaSuccess);  // pageable source: staged, no wait
  ASSERT_EQ(cudaMemcpyAsync(d + kN, d, sizeof(float) * kN, cudaMemcpyDeviceToDevice, s),
            cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(d, 0, sizeof(float) * kN, s), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, sizeof(float) * kN, cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, s), cudaSuccess);
  while (cudaEventQuery(e) == cudaErrorNotReady) {
  }                                                 // polls, not waits
  ASSERT_EQ(cudaEventSynchronize(e), cudaSuccess);  // a wait
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), d + kN, sizeof(float) * kN, cudaMemcpyDeviceToHost, s),
            cudaSuccess);  // a wait
  EXPECT_EQ(pageable[0], 1.0f);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);  // a wait
  float one = 0;
  ASSERT_EQ(cudaMemcpy(&one, d, sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);  // one wait
  ASSERT_EQ(cudaMemset(d, 0, sizeof(float)), cudaSuccess);                             // a wait
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);                                        // a wait
  EXPECT_EQ(cudaFree(d), cudaSuccess);                                                 // a wait
  const sim::Census c = sim::TakeCensus();
  EXPECT_EQ(c.kernels, 2);
  EXPECT_EQ(c.blas, 0);
  EXPECT_EQ(c.copies_to_device, 1);
  EXPECT_EQ(c.copies_on_device, 1);
  EXPECT_EQ(c.copies_to_host, 3);
  EXPECT_EQ(c.pageable_copies, 3);
  EXPECT_EQ(c.memsets, 2);
  EXPECT_EQ(c.host_waits, 7);
  EXPECT_EQ(c.allocations, 2);
  EXPECT_EQ(c.frees, 2);
  // Taken: counting starts again.
  EXPECT_EQ(sim::TakeCensus().kernels, 0);
  EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST(CudaSimTest, CopiesAndLaunchesAreChecked) {
  float* d = DeviceAlloc<float>(4);
  std::vector<float> h(8);
  // Direction against where the pointers point; sizes past an allocation.
  EXPECT_EQ(cudaMemcpy(h.data(), d, 16, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 16, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 32, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  (void)cudaGetLastError();
  // Launch configurations the GPU refuses.
  Launch(FillKernel, 1, 2048, 0, nullptr)(4, 1.0f, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  Launch(FillKernel, 0, 32, 0, nullptr)(4, 1.0f, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  Launch(FillKernel, 1, 32, 64 << 10, nullptr)(4, 1.0f, d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// Dynamic shared memory above 48 KiB needs the kernel's opt-in, up to sm_90's 227 KiB.
TEST(CudaSimTest, SharedMemoryAbove48KiBNeedsTheKernelsOptIn) {
  float* d = DeviceAlloc<float>(64);
  Launch(DynamicSharedKernel, 1, 64, 100 << 10, nullptr)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  const void* kernel = reinterpret_cast<const void*>(DynamicSharedKernel);
  EXPECT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 << 10),
            cudaErrorInvalidValue);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10),
            cudaSuccess);
  Launch(DynamicSharedKernel, 1, 64, 100 << 10, nullptr)(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  Launch(FillKernel, 1, 32, 100 << 10, nullptr)(4, 1.0f, d);  // another kernel: not opted in
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// One warp: C = A B + C on 16 x 16 x 16 bf16 tiles staged in (aligned) dynamic shared
// memory, B read column-major from a transposed copy and row-major, both stored.
__global__ void WmmaKernel(const float* a, const float* b, const float* c, float* out) {
  namespace wmma = nvcuda::wmma;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(unsigned char, smem, 128);
  auto* as = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* bs = as + 256;
  auto* bt = bs + 256;
  for (int x = static_cast<int>(threadIdx.x); x < 256; x += 32) {
    as[x] = __float2bfloat16(a[x]);
    bs[x] = __float2bfloat16(b[x]);
    bt[(x % 16) * 16 + x / 16] = __float2bfloat16(b[x]);  // B^T, row-major
  }
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fbt;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc, acc2;
  wmma::load_matrix_sync(fa, as, 16);
  wmma::load_matrix_sync(fb, bs, 16);
  wmma::load_matrix_sync(fbt, bt, 16);
  wmma::load_matrix_sync(acc, c, 16, wmma::mem_row_major);
  wmma::load_matrix_sync(acc2, c, 16, wmma::mem_col_major);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::mma_sync(acc2, fa, fbt, acc2);
  wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
  wmma::store_matrix_sync(out + 256, acc2, 16, wmma::mem_col_major);
}

__global__ void MisalignedWmmaKernel(const float* c) {
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc;
  nvcuda::wmma::load_matrix_sync(acc, c + 1, 16, nvcuda::wmma::mem_row_major);
}

// Values exact in bf16 with sums exact in float: the products must match to the bit.
TEST(CudaSimTest, WarpMatrixMultiplyAccumulates) {
  std::vector<float> a(256), b(256), c(256);
  for (int i = 0; i < 256; ++i) {
    a[static_cast<size_t>(i)] = static_cast<float>(i % 7 - 3);
    b[static_cast<size_t>(i)] = static_cast<float>(i % 5 - 2) * 0.5f;
    c[static_cast<size_t>(i)] = static_cast<float>(i % 3);
  }
  float* d = DeviceAlloc<float>(4 * 256);
  ASSERT_EQ(cudaMemcpy(d, a.data(), 1024, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d + 256, b.data(), 1024, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d + 512, c.data(), 1024, cudaMemcpyHostToDevice), cudaSuccess);
  float* out = DeviceAlloc<float>(512);
  Launch(WmmaKernel, 1, 32, 3 * 256 * 2, nullptr)(d, d + 256, d + 512, out);
  std::vector<float> got(512);
  ASSERT_EQ(cudaMemcpy(got.data(), out, 2048, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float row = c[static_cast<size_t>(m * 16 + n)], col = c[static_cast<size_t>(n * 16 + m)];
      for (int k = 0; k < 16; ++k) {
        const float p = a[static_cast<size_t>(m * 16 + k)] * b[static_cast<size_t>(k * 16 + n)];
        row += p;
        col += p;
      }
      EXPECT_EQ(got[static_cast<size_t>(m * 16 + n)], row) << m << " " << n;
      EXPECT_EQ(got[static_cast<size_t>(256 + n * 16 + m)], col) << m << " " << n;
    }
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
}

TEST(CudaSimDeathTest, BarriersNoThreadCanPassStop) {
  float* d = DeviceAlloc<float>(64);
  EXPECT_DEATH(
      {
        Launch(BarrierInBranchKernel, 1, 64, 0, nullptr)(d);
        (void)cudaDeviceSynchronize();
      },
      "no thread of the block can go on");
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaSimDeathTest, AShuffleWithALaneThatReturnedStops) {
  float* d = DeviceAlloc<float>(32);
  EXPECT_DEATH(
      {
        Launch(ShuffleAfterReturnKernel, 1, 32, 0, nullptr)(d);
        (void)cudaDeviceSynchronize();
      },
      "names a lane that has returned");
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// Device memory is not the host's: a read or a write through a cudaMalloc pointer faults, as
// on a GPU, before and after the device has worked on it; kernels, copies and memsets reach
// it, and freed memory comes back as garbage.
TEST(CudaSimDeathTest, HostCodeTouchingDeviceMemoryStops) {
  int* d = DeviceAlloc<int>(256);
  ASSERT_EQ(cudaMemset(d, 0, 256 * sizeof(int)), cudaSuccess);
  EXPECT_DEATH(
      {
        volatile int v = d[3];
        (void)v;
      },
      "host code touched device memory");
  Launch(MirrorKernel, 1, 256, 0, nullptr)(256, d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_DEATH(d[200] = 1, "host code touched device memory");
  std::vector<int> got(256);
  ASSERT_EQ(cudaMemcpy(got.data(), d, 256 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[0], 255);
  EXPECT_EQ(got[255], 0);
  ASSERT_EQ(cudaFree(d), cudaSuccess);
  int* again = DeviceAlloc<int>(256);
  ASSERT_EQ(cudaMemcpy(got.data(), again, 256 * sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[0], -1);
  EXPECT_EQ(got[255], -1);
  // Pinned memory is the host's.
  int* pinned = PinnedAlloc<int>(4);
  pinned[2] = 7;
  EXPECT_EQ(pinned[2], 7);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(again), cudaSuccess);
}

// A copy from pinned memory reads it when it runs: a host that writes the source before
// waiting for the copy races the GPU's DMA, and the copy stops the program.
TEST(CudaSimDeathTest, WritingAPinnedSourceBeforeItsCopyRanStops) {
  float* d = DeviceAlloc<float>(8);
  float* pinned = PinnedAlloc<float>(8);
  for (int i = 0; i < 8; ++i) pinned[i] = static_cast<float>(i);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  // Written after the copy ran: fine.
  ASSERT_EQ(cudaMemcpyAsync(d, pinned, 8 * sizeof(float), cudaMemcpyHostToDevice, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  pinned[3] = 30.0f;
  std::vector<float> got(8);
  ASSERT_EQ(cudaMemcpy(got.data(), d, 8 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[3], 3.0f);
  EXPECT_DEATH(
      {
        (void)cudaMemcpyAsync(d, pinned, 8 * sizeof(float), cudaMemcpyHostToDevice, s);
        pinned[5] = 50.0f;  // before the copy ran
        (void)cudaStreamSynchronize(s);
      },
      "wrote the pinned memory .* after a cudaMemcpyAsync from it was issued");
  // Changed in between by the device (a copy into it queued first; a kernel given a pointer
  // into it): not the host, the copies run.
  float* other = DeviceAlloc<float>(8);
  Launch(FillKernel, 1, 8, 0, s)(8, 9.0f, other);
  ASSERT_EQ(cudaMemcpyAsync(pinned, other, 8 * sizeof(float), cudaMemcpyDeviceToHost, s),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d, pinned, 8 * sizeof(float), cudaMemcpyHostToDevice, s), cudaSuccess);
  Launch(FillKernel, 1, 8, 0, s)(8, 11.0f, pinned);
  ASSERT_EQ(cudaMemcpyAsync(other, pinned, 8 * sizeof(float), cudaMemcpyHostToDevice, s),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), d, 8 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[5], 9.0f);
  ASSERT_EQ(cudaMemcpy(got.data(), other, 8 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[5], 11.0f);
  EXPECT_EQ(cudaFree(other), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// A kernel gets device or pinned pointers (or null, or one past an allocation's end); a host
// pointer stops the launch, naming its site and the argument.
TEST(CudaSimDeathTest, AKernelGivenAHostPointerStops) {
  float* d = DeviceAlloc<float>(32);
  float* pinned = PinnedAlloc<float>(32);
  Launch(FillKernel, 1, 32, 0, nullptr)(32, 1.0f, d);
  Launch(FillKernel, 1, 32, 0, nullptr)(32, 2.0f, pinned);
  Launch(FillKernel, 1, 32, 0, nullptr)(0, 3.0f, d + 32);
  Launch(FillKernel, 1, 32, 0, nullptr)(0, 3.0f, pinned + 32);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(pinned[31], 2.0f);
  std::vector<float> host(32, 0.0f);
  EXPECT_DEATH(Launch(FillKernel, 1, 32, 0, nullptr)(32, 4.0f, host.data()),
               "sim_test.cc:[0-9]+ .*kernel argument 2 is a host pointer");
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// A kernel that writes just past an allocation's end, or just before its start, stops the
// program after it ran, naming it and the byte.
TEST(CudaSimDeathTest, AKernelWritingOutsideAnAllocationStops) {
  float* d = DeviceAlloc<float>(32);
  Launch(FillKernel, 1, 32, 0, nullptr)(32, 1.0f, d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_DEATH(
      {
        Launch(FillKernel, 1, 64, 0, nullptr)(33, 1.0f, d);
        (void)cudaDeviceSynchronize();
      },
      "sim_test.cc:[0-9]+ .* wrote outside a cudaMalloc allocation: byte 128 of the 128-byte "
      "allocation .*past its end");
  EXPECT_DEATH(
      {
        Launch(FillKernel, 1, 32, 0, nullptr)(1, 1.0f, d - 1);
        (void)cudaDeviceSynchronize();
      },
      "byte -4 of the 128-byte allocation .*before its start");
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

// TF32 (m16n16k8): operands rounded by __float_to_tf32 (to nearest, ties away from zero)
// multiply exactly; an operand not rounded loses its low 13 mantissa bits, as on the tensor
// cores.
__global__ void Tf32Kernel(const float* a, const float* b, float* out) {
  namespace wmma = nvcuda::wmma;
  RACKRUN_DYNAMIC_SHARED_ALIGNED(float, smem, 128);
  for (int x = static_cast<int>(threadIdx.x); x < 128; x += 32) {
    smem[x] = wmma::__float_to_tf32(a[x]);  // A: 16 x 8
    smem[128 + x] = b[x];                   // B: 8 x 16, not rounded
  }
  __syncwarp();
  wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  wmma::load_matrix_sync(fa, smem, 8);
  wmma::load_matrix_sync(fb, smem + 128, 16);
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}

TEST(CudaSimTest, Tf32OperandsAreRoundedOrTruncated) {
  EXPECT_EQ(nvcuda::wmma::__float_to_tf32(1.0f + 0x1p-11f), 1.0f + 0x1p-10f);  // a tie: away
  EXPECT_EQ(nvcuda::wmma::__float_to_tf32(-1.0f - 0x1p-11f), -1.0f - 0x1p-10f);
  EXPECT_EQ(nvcuda::wmma::__float_to_tf32(1.0f + 0x1p-12f), 1.0f);
  std::vector<float> a(128, 0.0f), b(128, 0.0f);
  a[0] = 1.0f + 0x1p-11f;   // row 0, k = 0: rounds up to 1 + 2^-10
  a[1] = 2.0f;              // row 0, k = 1
  b[0] = 1.0f;              // k = 0, column 0
  b[16] = 1.0f + 0x1p-11f;  // k = 1, column 0: truncated to 1 in the product
  float* d = DeviceAlloc<float>(256);
  ASSERT_EQ(cudaMemcpy(d, a.data(), 512, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d + 128, b.data(), 512, cudaMemcpyHostToDevice), cudaSuccess);
  float* out = DeviceAlloc<float>(256);
  Launch(Tf32Kernel, 1, 32, 256 * sizeof(float), nullptr)(d, d + 128, out);
  std::vector<float> got(256);
  ASSERT_EQ(cudaMemcpy(got.data(), out, 1024, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[0], (1.0f + 0x1p-10f) + 2.0f);
  EXPECT_EQ(got[1], 0.0f);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  EXPECT_EQ(cudaFree(out), cudaSuccess);
}

// Thread 0 writes one float past the dynamic shared memory the launch asked for.
__global__ void SharedOverrunKernel(int n) {
  RACKRUN_DYNAMIC_SHARED(float, smem);
  if (threadIdx.x == 0) smem[n] = 1.0f;
}

TEST(CudaSimDeathTest, AWritePastDynamicSharedMemoryStops) {
  Launch(SharedOverrunKernel, 2, 32, 64 * sizeof(float), nullptr)(63);  // the last: fine
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_DEATH(
      {
        Launch(SharedOverrunKernel, 2, 32, 64 * sizeof(float), nullptr)(64);
        (void)cudaDeviceSynchronize();
      },
      "wrote past the launch's dynamic shared memory");
}

TEST(CudaSimDeathTest, AMisalignedWarpMatrixTileStops) {
  float* d = DeviceAlloc<float>(512);
  EXPECT_DEATH(
      {
        Launch(MisalignedWmmaKernel, 1, 32, 0, nullptr)(d);
        (void)cudaDeviceSynchronize();
      },
      "not 256-bit aligned");
  EXPECT_EQ(cudaFree(d), cudaSuccess);
}

}  // namespace
}  // namespace rackrun::runtime::cuda
