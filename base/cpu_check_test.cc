#include "base/cpu_check.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/shell.h"

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
  // RACKRUN_TUNE adds " -mtune=CPU" after the architecture's flag (CI's Intel-tuned stage).
  std::string_view flags = BuildArchFlags();
  if (const size_t tune = flags.find("-mtune="); tune != std::string_view::npos) {
    EXPECT_GT(flags.size(), tune + 7) << flags;
    flags = flags.substr(0, tune);
    while (!flags.empty() && flags.back() == ' ') flags.remove_suffix(1);
  }
  if (BuildArch() == "native") {
    EXPECT_EQ(flags, "-march=native");
  } else if (BuildArch() == "default" || BuildArch().empty()) {
    EXPECT_EQ(flags, "");
    EXPECT_TRUE(features.empty());  // x86-64's baseline (SSE2) needs no check
  } else {
    EXPECT_EQ(flags, "-march=" + std::string(BuildArch()));
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
  EXPECT_EQ(MissingCpuFeatures(required, has, ""), (std::vector<std::string_view>{"avx512f"}));
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

// Runs this test binary again (listing its tests) with `env` prepended, through the
// end-to-end tests' shell helper.
testing::ShellResult RunSelf(const std::string& env) {
  const std::filesystem::path dir = ::testing::TempDir();
  return testing::Shell(env + " '" + std::filesystem::read_symlink("/proc/self/exe").string() +
                            "' --gtest_list_tests",
                        dir / "cpu_check_self.out", dir / "cpu_check_self.err");
}

TEST(CpuCheckTest, AProcessOnACpuWithoutABuildFeatureStopsBeforeMainWithTheReason) {
  const std::vector<std::string_view> features = BuildCpuFeatures();
  if (features.empty()) GTEST_SKIP() << "RACKRUN_ARCH=default build: no feature to miss";
  const std::string hidden(features.back());
  testing::ShellResult r = RunSelf("RACKRUN_CPU_HIDE_FEATURES=" + hidden);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  // The check ran before main: gtest never listed a test.
  EXPECT_EQ((r.out + r.err).find("CpuCheckTest."), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("base_cpu_check_test: this binary was built for RACKRUN_ARCH="),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("this CPU lacks " + hidden + "."), std::string::npos) << r.err;
  // Hiding a feature the build does not use, or none, changes nothing.
  r = RunSelf("RACKRUN_CPU_HIDE_FEATURES=no-such-feature");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("CpuCheckTest."), std::string::npos) << r.out;
}

}  // namespace
}  // namespace rackrun::base
