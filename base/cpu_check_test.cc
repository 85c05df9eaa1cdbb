#include "base/cpu_check.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"

namespace rackrun::base {
namespace {

bool Contains(const std::vector<std::string_view>& v, std::string_view x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Whether this file's compile flags enable each feature (the flags are RACKRUN_ARCH_FLAGS).
#ifdef __SSE4_2__
constexpr bool kSse42 = true;
#else
constexpr bool kSse42 = false;
#endif
#ifdef __AVX2__
constexpr bool kAvx2 = true;
#else
constexpr bool kAvx2 = false;
#endif
#ifdef __FMA__
constexpr bool kFma = true;
#else
constexpr bool kFma = false;
#endif
#ifdef __AVX512F__
constexpr bool kAvx512f = true;
#else
constexpr bool kAvx512f = false;
#endif

TEST(CpuCheckTest, BuildFeaturesMatchWhatThisFileWasCompiledFor) {
  // The list comes from the header cmake/cpu_arch.cmake generated for the same flags.
  const std::vector<std::string_view> features = BuildCpuFeatures();
  EXPECT_EQ(Contains(features, "sse4.2"), kSse42);
  EXPECT_EQ(Contains(features, "avx2"), kAvx2);
  EXPECT_EQ(Contains(features, "fma"), kFma);
  EXPECT_EQ(Contains(features, "avx512f"), kAvx512f);
  if (BuildArch() == "native") {
    EXPECT_EQ(BuildArchFlags(), "-march=native");
  } else if (BuildArch() == "default" || BuildArch().empty()) {
    EXPECT_EQ(BuildArchFlags(), "");
    EXPECT_TRUE(features.empty());  // x86-64's baseline (SSE2) needs no check
  } else if (BuildArch() != "native") {
    EXPECT_EQ(BuildArchFlags(), "-march=" + std::string(BuildArch()));
  }
}

TEST(CpuCheckTest, ThisCpuHasEveryBuildFeature) {
  // The process got here, so the start-up check passed: the same answer through the API.
  for (const std::string_view f : BuildCpuFeatures()) EXPECT_TRUE(CpuHasFeature(f)) << f;
  EXPECT_FALSE(CpuHasFeature("no-such-feature"));
  EXPECT_TRUE(MissingCpuFeatures(BuildCpuFeatures(), CpuHasFeature, "").empty());
}

TEST(CpuCheckTest, MissingListsDeniedAndHiddenFeaturesInOrder) {
  const std::vector<std::string_view> required = {"sse4.2", "avx", "avx2", "fma", "avx512f"};
  const auto has = [](std::string_view f) { return f != "avx512f"; };
  EXPECT_EQ(MissingCpuFeatures(required, has, ""),
            (std::vector<std::string_view>{"avx512f"}));
  EXPECT_EQ(MissingCpuFeatures(required, has, "fma, avx2"),
            (std::vector<std::string_view>{"avx2", "fma", "avx512f"}));
  // Only whole names count; a hidden feature the build does not use changes nothing.
  EXPECT_EQ(MissingCpuFeatures(required, has, "avx5,avx512vl,,sse4"),
            (std::vector<std::string_view>{"avx512f"}));
  EXPECT_TRUE(MissingCpuFeatures({}, has, "avx2").empty());
}

TEST(CpuCheckTest, MessageNamesWhatIsMissingAndWhatToDo) {
  const std::string m = CpuCheckMessage({"avx512f", "avx512bw"});
  EXPECT_NE(m.find("lacks avx512f avx512bw"), std::string::npos) << m;
  EXPECT_NE(m.find("RACKRUN_ARCH=" + std::string(BuildArch())), std::string::npos) << m;
  EXPECT_NE(m.find("-DRACKRUN_ARCH=x86-64-v3"), std::string::npos) << m;
}

// Runs this test binary again (listing its tests) with `env` prepended; returns its exit
// status (-1 if it did not exit) and its output.
int RunSelf(const std::string& env, std::string* output) {
  std::array<char, 4096> self{};
  const ssize_t n = readlink("/proc/self/exe", self.data(), self.size() - 1);
  if (n <= 0) return -1;
  const std::string command = env + " '" + std::string(self.data(), static_cast<size_t>(n)) +
                              "' --gtest_list_tests 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::array<char, 512> buffer{};
  output->clear();
  size_t got = 0;
  while ((got = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) output->append(buffer.data(), got);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(CpuCheckTest, AProcessOnACpuWithoutABuildFeatureStopsBeforeMainWithTheReason) {
  const std::vector<std::string_view> features = BuildCpuFeatures();
  if (features.empty()) GTEST_SKIP() << "RACKRUN_ARCH=default build: no feature to miss";
  const std::string hidden(features.back());
  std::string output;
  EXPECT_EQ(RunSelf("RACKRUN_CPU_HIDE_FEATURES=" + hidden, &output), 1) << output;
  // The check ran before main: gtest never listed a test.
  EXPECT_EQ(output.find("CpuCheckTest."), std::string::npos) << output;
  EXPECT_NE(output.find("base_cpu_check_test: this binary was built for RACKRUN_ARCH="),
            std::string::npos) << output;
  EXPECT_NE(output.find("this CPU lacks " + hidden + "."), std::string::npos) << output;
  // Hiding a feature the build does not use, or none, changes nothing.
  EXPECT_EQ(RunSelf("RACKRUN_CPU_HIDE_FEATURES=no-such-feature", &output), 0) << output;
  EXPECT_NE(output.find("CpuCheckTest."), std::string::npos) << output;
}

}  // namespace
}  // namespace rackrun::base
