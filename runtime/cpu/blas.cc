#include "runtime/cpu/blas.h"

#include <dlfcn.h>
#include <strings.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#ifndef RACKRUN_OPENBLAS_OPENMP_LIBRARY
#define RACKRUN_OPENBLAS_OPENMP_LIBRARY ""
#endif

namespace rackrun::runtime::cpu {
namespace {

// OpenBLAS's extensions (cblas_* are looked up by name too).
using CoreName = char* (*)();
using Parallel = int (*)();
using SetThreads = void (*)(int);

std::string FeatureSummary(const CpuVectorFeatures& f) {
  if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl && f.avx512cd) {
    return f.avx512bf16 ? "AVX-512 with BF16" : "AVX-512";
  }
  if (f.avx2 && f.fma) return "AVX2 and FMA";
  if (f.avx) return "AVX";
  return "SSE only";
}

template <typename F>
F Symbol(void* handle, const char* name) {
  return reinterpret_cast<F>(dlsym(handle, name));
}

BlasLibrary Load() {
  BlasLibrary lib;
  const CpuVectorFeatures features = DetectCpuVectorFeatures();
  const std::string best = CoreForFeatures(features);
  const char* user_core = std::getenv("OPENBLAS_CORETYPE");
  lib.user_core = user_core != nullptr && *user_core != '\0';
  // Runs from a static initializer (below), before main and before any other thread, so
  // setting and restoring the variable races with no getenv. It is restored so that child
  // processes choose for themselves.
  if (!lib.user_core && !best.empty()) {
    setenv("OPENBLAS_CORETYPE", best.c_str(), 1);
    lib.requested = best;
  }
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("RACKRUN_OPENBLAS"); path != nullptr && *path != '\0') {
    candidates.emplace_back(path);
  } else {
    if (*RACKRUN_OPENBLAS_OPENMP_LIBRARY != '\0') {
      candidates.emplace_back(RACKRUN_OPENBLAS_OPENMP_LIBRARY);
    }
    candidates.emplace_back("libopenblas.so.0");
  }
  void* handle = nullptr;
  std::string errors;
  for (const std::string& path : candidates) {
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      lib.path = path;
      break;
    }
    const char* error = dlerror();
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", error != nullptr ? error : path);
  }
  if (!lib.requested.empty()) unsetenv("OPENBLAS_CORETYPE");
  if (handle != nullptr) {
    lib.sgemm = Symbol<BlasLibrary::Sgemm>(handle, "cblas_sgemm");
    lib.dgemm = Symbol<BlasLibrary::Dgemm>(handle, "cblas_dgemm");
  }
  const auto core_name =
      handle != nullptr ? Symbol<CoreName>(handle, "openblas_get_corename") : nullptr;
  if (lib.sgemm == nullptr || lib.dgemm == nullptr || core_name == nullptr) {
    std::fprintf(stderr,
                 "rackrun: cannot load OpenBLAS (%s): install Debian's libopenblas0-openmp "
                 "(tools/setup does), or set RACKRUN_OPENBLAS to a libopenblas.so.0 file\n",
                 handle == nullptr ? errors.c_str()
                                   : absl::StrCat(lib.path,
                                                  " lacks cblas_sgemm, cblas_dgemm "
                                                  "or openblas_get_corename")
                                         .c_str());
    std::exit(1);
  }
  lib.core = core_name();
  const auto parallel = Symbol<Parallel>(handle, "openblas_get_parallel");
  lib.openmp = parallel != nullptr && parallel() == 2;
  if (!lib.openmp) {
    // The pthread build would start its own pool beside OpenMP's: the runtime threads
    // around it instead (gemm.h).
    if (const auto set_threads = Symbol<SetThreads>(handle, "openblas_set_num_threads")) {
      set_threads(1);
    }
  }
  if (!best.empty() && CoreLevel(lib.core) < CoreLevel(best)) {
    lib.warning = absl::StrCat(
        "rackrun: OpenBLAS runs its ", lib.core, " kernels, older than this CPU supports (",
        FeatureSummary(features), "): GEMMs may run several times slower. ",
        lib.user_core ? absl::StrCat("OPENBLAS_CORETYPE=", user_core, " asks for them; unset it")
                      : absl::StrCat("OpenBLAS refused OPENBLAS_CORETYPE=", best,
                                     " (does the OS enable these instructions?)"),
        " to run its ", best, " kernels.");
  }
  return lib;
}

// Loads the library before main (see Load) in every program that links the GEMM.
[[maybe_unused]] const BlasLibrary& g_loaded_at_start = Blas();

}  // namespace

CpuVectorFeatures DetectCpuVectorFeatures() {
  __builtin_cpu_init();  // may run before the runtime's own initialisation of the CPU model
  CpuVectorFeatures f;
  f.amd = __builtin_cpu_is("amd") != 0;
  f.avx = __builtin_cpu_supports("avx") != 0;
  f.avx2 = __builtin_cpu_supports("avx2") != 0;
  f.fma = __builtin_cpu_supports("fma") != 0;
  f.avx512f = __builtin_cpu_supports("avx512f") != 0;
  f.avx512cd = __builtin_cpu_supports("avx512cd") != 0;
  f.avx512bw = __builtin_cpu_supports("avx512bw") != 0;
  f.avx512dq = __builtin_cpu_supports("avx512dq") != 0;
  f.avx512vl = __builtin_cpu_supports("avx512vl") != 0;
  f.avx512bf16 = __builtin_cpu_supports("avx512bf16") != 0;
  return f;
}

std::string CoreForFeatures(const CpuVectorFeatures& f) {
  if (f.avx512f && f.avx512cd && f.avx512bw && f.avx512dq && f.avx512vl) {
    return f.avx512bf16 ? "Cooperlake" : "SkylakeX";
  }
  if (f.avx2 && f.fma) return f.amd ? "Zen" : "Haswell";
  if (f.avx) return "Sandybridge";
  return "";
}

int CoreLevel(std::string_view core) {
  const auto is = [core](const char* name) {
    return core.size() == std::string_view(name).size() &&
           strncasecmp(core.data(), name, core.size()) == 0;
  };
  if (is("SkylakeX") || is("Cooperlake") || is("SapphireRapids")) return 4;
  if (is("Haswell") || is("Zen") || is("Excavator")) return 3;
  if (is("Sandybridge") || is("Bulldozer") || is("Piledriver") || is("Steamroller")) return 2;
  return 1;
}

const BlasLibrary& Blas() {
  static const BlasLibrary library = Load();
  return library;
}

std::string BlasDescription() {
  const BlasLibrary& lib = Blas();
  return absl::StrCat("openblas ", lib.core, " kernels (",
                      lib.openmp ? "OpenMP build" : "single-threaded calls",
                      lib.user_core           ? ", OPENBLAS_CORETYPE set by the user"
                      : lib.requested.empty() ? ", OpenBLAS's own choice"
                                              : ", chosen for this CPU's features",
                      ")");
}

}  // namespace rackrun::runtime::cpu
