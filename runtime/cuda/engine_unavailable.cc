// GpuEngineFactory in a build without the GPU engine (no nvcc, or RACKRUN_WITH_CUDA=OFF): no
// factory, so the trainer refuses resources.device: cuda naming the cause.
#include "runtime/cuda/engine.h"

namespace rackrun::runtime::cuda {

DeviceEngineFactory GpuEngineFactory() { return {}; }

}  // namespace rackrun::runtime::cuda
