// The libFuzzer entry point every target in tests/fuzz defines. The same source builds two
// ways: with clang and -fsanitize=fuzzer,address,undefined as a fuzzer (RACKRUN_FUZZ=ON,
// tools/fuzz), and with the project's compiler beside replay_main.cc as a CTest that feeds
// every committed seed and regression input through it (fuzz_replay_*), so a fixed crash
// stays fixed without clang. A target aborts (FUZZ_CHECK) when an invariant of the code
// under test breaks; an error status for bad input is the expected outcome, not a finding.
#ifndef RACKRUN_TESTS_FUZZ_FUZZ_TARGET_H_
#define RACKRUN_TESTS_FUZZ_FUZZ_TARGET_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

// Aborts with the condition's text: libFuzzer saves the input as a crash.
#define FUZZ_CHECK(condition)                                                                 \
  do {                                                                                        \
    if (!(condition)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

#endif  // RACKRUN_TESTS_FUZZ_FUZZ_TARGET_H_
