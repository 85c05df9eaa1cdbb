#include "data/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/file.h"
#include "data/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace rackrun::data {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::TestDir;

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST(SafetensorsTest, WritesTheDocumentedLayoutAndReadsItBack) {
  const std::string path = (TestDir() / "m.safetensors").string();
  const std::string a = Floats({1, 2, 3, 4, 5, 6}), b = Floats({-1.5f});
  ASSERT_TRUE(WriteSafetensors(path,
                               {{.name = "embed", .dtype = "F32", .shape = {2, 3}, .bytes = a},
                                {.name = "norm", .dtype = "F32", .shape = {1}, .bytes = b}},
                               {{"format", "pt"}})
                  .ok());
  // By hand: 8-byte little-endian length, the JSON padded to 8 bytes, then the data.
  const std::string file = *base::ReadWholeFile(path);
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, n));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["embed"]["dtype"], "F32");
  EXPECT_EQ(header["embed"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(header["embed"]["data_offsets"], nlohmann::json({0, 24}));
  EXPECT_EQ(header["norm"]["data_offsets"], nlohmann::json({24, 28}));
  EXPECT_EQ(file.substr(8 + n), a + b);

  absl::StatusOr<SafetensorsFile> read = SafetensorsFile::Open(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->tensors().size(), 2u);
  EXPECT_EQ(read->tensors()[0].name, "embed");
  EXPECT_THAT(read->Find("embed")->shape, ElementsAre(2, 3));
  EXPECT_EQ(read->Find("norm")->bytes, b);
  EXPECT_EQ(read->metadata().at("format"), "pt");
  EXPECT_EQ(read->Find("missing"), nullptr);
}

TEST(SafetensorsTest, RefusesInconsistentFilesNamingThem) {
  const std::string path = (TestDir() / "bad.safetensors").string();
  const auto write = [&](const std::string& header, const std::string& data) {
    std::string n(8, '\0');
    const uint64_t size = header.size();
    std::memcpy(n.data(), &size, 8);
    std::ofstream(path, std::ios::binary) << n << header << data;
  };
  const auto expect = [&](const std::string& text) {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    ASSERT_FALSE(f.ok());
    EXPECT_THAT(f.status().message(), HasSubstr(path));
    EXPECT_THAT(f.status().message(), HasSubstr(text));
  };
  write(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", "12345678");
  expect("offsets [0, 4) do not fit its shape");
  // 2^62 eight-byte elements: their byte count overflows (it wrapped to 0 and matched the
  // empty range; the fuzzer found it).
  write(R"({"a": {"dtype": "F64", "shape": [2147483648, 2147483648], "data_offsets": [0, 0]}})",
        "");
  expect("offsets [0, 0) do not fit its shape");
  write(R"({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}})", "1234");
  expect("unknown dtype Q7");
  write(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", "12345678");
  expect("leaves a gap");
  write(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", "12345678");
  expect("bytes after the last tensor");
  write("[1, 2]", "");
  expect("not a JSON object");
  std::ofstream(path) << "abc";
  expect("shorter than its 8-byte header length");
  EXPECT_FALSE(
      WriteSafetensors(path, {{.name = "x", .dtype = "F32", .shape = {3}, .bytes = "1234"}}, {})
          .ok());
  EXPECT_FALSE(WriteSafetensors(path,
                                {{.name = "x",
                                  .dtype = "F64",
                                  .shape = {int64_t{1} << 31, int64_t{1} << 31},
                                  .bytes = ""}},
                                {})
                   .ok());
}

}  // namespace
}  // namespace rackrun::data
