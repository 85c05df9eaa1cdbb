// The GPU engine behind the trainer's device seam (runtime/device_engine.h): GpuModel (the
// model on one GPU, in the spec's model.precision) and DeviceAdamW (fp32 moments, one
// launch, the gradient norm and clipping factor on the device). Drivers (`rackrun train`,
// the worker) hand GpuEngineFactory() to the trainer in TrainerOptions::device_engine.
//
// This header needs no CUDA: the library behind it (rackrun_gpu_engine) is built in every
// configuration. Without the GPU engine in the build (no nvcc, RACKRUN_WITH_CUDA=OFF: the
// sanitizer and fuzz builds) GpuEngineFactory() is empty and the trainer refuses a cuda job
// saying so.
//
// Not run on a GPU yet: runtime/cuda/train_test.cc trains a small xhc and vanilla model on the
// GPU and the CPU from the same spec and seed and compares losses and moves checkpoints between
// them.
#ifndef RACKRUN_RUNTIME_CUDA_ENGINE_H_
#define RACKRUN_RUNTIME_CUDA_ENGINE_H_

#include "runtime/device_engine.h"

namespace rackrun::runtime::cuda {

// The factory, or an empty function in a build without the GPU engine.
DeviceEngineFactory GpuEngineFactory();

}  // namespace rackrun::runtime::cuda

#endif  // RACKRUN_RUNTIME_CUDA_ENGINE_H_
