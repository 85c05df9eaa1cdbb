// Start-up check that the CPU has the instruction set extensions the binary was compiled
// for (RACKRUN_ARCH, cmake/cpu_arch.cmake: "native" by default, i.e. the CPU of the
// machine that built it). Every executable links it (rackrun_target_defaults): before any
// static initializer of the program runs, a binary started on a CPU that lacks one of them
// (built on an AVX-512 node, started on an AVX2 one) prints what is missing and how to
// build for both, and exits with status 1, instead of dying of SIGILL somewhere later.
//
// The check's own code is compiled for the baseline x86-64 instruction set, so it runs on
// any x86-64 CPU. RACKRUN_CPU_HIDE_FEATURES=avx512f,avx2 makes it treat the named features
// as absent: it shows what would happen on an older CPU (the tests use it).
#ifndef RACKRUN_BASE_CPU_CHECK_H_
#define RACKRUN_BASE_CPU_CHECK_H_

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace rackrun::base {

// The features (names of __builtin_cpu_supports: "avx2", "fma", "avx512f", ...) the
// build's flags let the compiler use; empty for RACKRUN_ARCH=default.
std::vector<std::string_view> BuildCpuFeatures();

// RACKRUN_ARCH and the compile flags it resolved to, as the build recorded them.
std::string_view BuildArch();
std::string_view BuildArchFlags();

// Those of `required` that `has(name)` denies or that `hidden` (a comma-separated list,
// as in RACKRUN_CPU_HIDE_FEATURES) names, in the order of `required`.
std::vector<std::string_view> MissingCpuFeatures(const std::vector<std::string_view>& required,
                                                 const std::function<bool(std::string_view)>& has,
                                                 std::string_view hidden);

// Whether this CPU has `feature` (one of BuildCpuFeatures()'s names); false for a name the
// check does not know.
bool CpuHasFeature(std::string_view feature);

// The message the start-up check prints for `missing` (non-empty).
std::string CpuCheckMessage(const std::vector<std::string_view>& missing);

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_CPU_CHECK_H_
