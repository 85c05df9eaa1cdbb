#include "runtime/weights_export.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/file.h"
#include "data/prepare.h"
#include "data/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "jobspec/spec.h"
#include "nlohmann/json.hpp"
#include "runtime/checkpoint.h"
#include "runtime/trainer.h"

namespace rackrun::runtime {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

fs::path FreshDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / "weights_export_test" / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A tiny MoE job with a shared expert and the aux-loss-free bias (so every kind of tensor,
// buffers included, is exported), trained 3 steps into `dir`/ckpt.
rackrun::v1::JobSpec TrainTiny(const fs::path& dir, int64_t steps = 3) {
  const std::unique_ptr<data::Tokenizer> bytes = *data::OpenTokenizer("bytes");
  const std::string sample = std::string(RACKRUN_SOURCE_DIR) + "/tests/data/brown-sample.txt";
  EXPECT_TRUE(data::PrepareDataset(sample, (dir / "brown").string(), "",
                                   {.tokenizer = bytes.get(), .threads = 1})
                  .ok());
  absl::StatusOr<rackrun::v1::JobSpec> spec = jobspec::ParseJobSpec(
      "model: {width: 16, blocks: 2, heads: 2, seq_len: 16, residual: xhc, streams: 4, active: 2,\n"
      "        fixed: 1, moe: {experts: 4, top_k: 2, expert_hidden: 16, shared_expert: true,\n"
      "        bias_update_rate: 0.01}}\n"
      "data: {batch_size: 2}\n"
      "training: {steps: " +
          std::to_string(steps) +
          ", seed: 5}\n"
          "resources: {threads: 1}\n",
      {"data.train=" + (dir / "brown").string(), "checkpoint.dir=" + (dir / "ckpt").string()});
  EXPECT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(*spec);
  EXPECT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE((*t)->Run().ok());
  return (*t)->spec();
}

TEST(WeightsExportTest, CheckpointToSafetensorsToCheckpointKeepsEveryWeightAndResumes) {
  const fs::path dir = FreshDir("round_trip");
  const rackrun::v1::JobSpec spec = TrainTiny(dir);
  absl::StatusOr<ExportedWeights> e =
      ExportSafetensors((dir / "ckpt").string(), (dir / "export").string());
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->step, 3);
  absl::StatusOr<data::SafetensorsFile> file = data::SafetensorsFile::Open(e->safetensors);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(static_cast<int64_t>(file->tensors().size()), e->tensors);
  // Shapes as the model holds them.
  EXPECT_THAT(file->Find("embed")->shape, ::testing::ElementsAre(257, 16));
  EXPECT_THAT(file->Find("lm_head")->shape, ::testing::ElementsAre(16, 257));
  ASSERT_NE(file->Find("blocks.1.moe.router_bias"), nullptr);  // a buffer

  absl::StatusOr<std::string> imported =
      ImportSafetensors((dir / "export").string(), (dir / "imported").string(), 0);
  ASSERT_TRUE(imported.ok()) << imported.status();
  const Checkpoint original = *LoadCheckpoint(CheckpointPath((dir / "ckpt").string(), 3));
  const Checkpoint back = *LoadCheckpoint(*imported);
  int compared = 0;
  for (const CheckpointSection& s : original.sections) {
    if (s.name.rfind("param/", 0) != 0 && s.name.rfind("buffer/", 0) != 0 &&
        s.name != "spec/model" && s.name != "data/tokenizer") {
      continue;
    }
    const CheckpointSection* b = back.Find(s.name);
    ASSERT_NE(b, nullptr) << s.name;
    EXPECT_EQ(b->payload, s.payload) << s.name << " differs after the round trip";
    ++compared;
  }
  EXPECT_EQ(compared, static_cast<int>(e->tensors) + 2);
  // The imported checkpoint resumes: same weights, fresh optimizer, data from its start.
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::Create(spec);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->Resume(*imported).ok());
  EXPECT_THAT((*t)->resume_note(), HasSubstr("the training data starts from its first sample"));
  EXPECT_TRUE((*t)->Step().ok());

  // A tensor of the wrong shape is refused naming it.
  data::SafeTensor embed = *file->Find("embed");
  embed.shape = {16, 257};
  std::vector<data::SafeTensor> tensors = file->tensors();
  for (data::SafeTensor& x : tensors) {
    if (x.name == "embed") x = embed;
  }
  fs::create_directories(dir / "bad");
  fs::copy_file(dir / "export" / "config.json", dir / "bad" / "config.json");
  ASSERT_TRUE(
      data::WriteSafetensors((dir / "bad" / "model.safetensors").string(), tensors, {}).ok());
  imported = ImportSafetensors((dir / "bad").string(), (dir / "imported2").string(), 0);
  ASSERT_FALSE(imported.ok());
  EXPECT_THAT(imported.status().message(),
              HasSubstr("tensor 'embed' is F32 [16,257], the model needs F32 [257,16]"));
}

// Another reader than ours: Python with only json and numpy reads the file as the format
// says, and finds the checkpoint's values.
TEST(WeightsExportTest, PythonWithJsonAndNumpyReadsTheExport) {
  if (std::system("/usr/bin/python3 -c 'import json, numpy' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "/usr/bin/python3 with numpy is missing (tools/setup installs python3 and "
                    "python3-numpy)";
  }
  const fs::path dir = FreshDir("python");
  TrainTiny(dir);
  absl::StatusOr<ExportedWeights> e =
      ExportSafetensors((dir / "ckpt").string(), (dir / "export").string());
  ASSERT_TRUE(e.ok()) << e.status();
  const fs::path script = dir / "read.py";
  std::ofstream(script) << R"(import json, sys
import numpy as np
path, config_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
raw = open(path, 'rb').read()
n = int.from_bytes(raw[:8], 'little')
header = json.loads(raw[8:8 + n].decode('utf-8'))
data = raw[8 + n:]
result = {'metadata': header.pop('__metadata__', {}), 'tensors': {}}
for name, t in header.items():
    assert t['dtype'] == 'F32', name
    begin, end = t['data_offsets']
    a = np.frombuffer(data[begin:end], dtype='<f4').reshape(t['shape'])
    result['tensors'][name] = {'shape': list(a.shape), 'first': float(a.flat[0]),
                               'last': float(a.flat[-1]), 'sum': float(a.astype(np.float64).sum())}
config = json.load(open(config_path))
result['config'] = {k: config[k] for k in ('architecture', 'vocab_size', 'width', 'blocks', 'heads',
                                           'experts', 'top_k', 'residual', 'streams', 'tokenizer')}
json.dump(result, open(out, 'w'))
)";
  const fs::path out = dir / "python.json";
  const std::string command = "/usr/bin/python3 " + script.string() + " " + e->safetensors + " " +
                              e->config + " " + out.string();
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  const nlohmann::json seen = nlohmann::json::parse(*base::ReadWholeFile(out.string()));
  EXPECT_EQ(seen["metadata"]["format"], "pt");
  const nlohmann::json& config = seen["config"];
  EXPECT_EQ(config["architecture"], "rackrun-moe");
  EXPECT_EQ(config["vocab_size"], 257);
  EXPECT_EQ(config["width"], 16);
  EXPECT_EQ(config["blocks"], 2);
  EXPECT_EQ(config["heads"], 2);
  EXPECT_EQ(config["experts"], 4);
  EXPECT_EQ(config["top_k"], 2);
  EXPECT_EQ(config["residual"], "xhc");
  EXPECT_EQ(config["streams"], 4);
  EXPECT_EQ(config["tokenizer"]["kind"], "bytes");
  // Every tensor against the checkpoint's own bytes.
  const Checkpoint c = *LoadCheckpoint(CheckpointPath((dir / "ckpt").string(), 3));
  ASSERT_EQ(static_cast<int64_t>(seen["tensors"].size()), e->tensors);
  for (const auto& [name, t] : seen["tensors"].items()) {
    const CheckpointSection* s = c.Find("param/" + name);
    if (s == nullptr) s = c.Find("buffer/" + name);
    ASSERT_NE(s, nullptr) << name;
    std::vector<float> v(s->payload.size() / sizeof(float));
    std::memcpy(v.data(), s->payload.data(), s->payload.size());
    int64_t elements = 1;
    for (const nlohmann::json& d : t["shape"]) elements *= d.get<int64_t>();
    EXPECT_EQ(elements, static_cast<int64_t>(v.size())) << name;
    EXPECT_EQ(t["first"].get<double>(), static_cast<double>(v.front())) << name;
    EXPECT_EQ(t["last"].get<double>(), static_cast<double>(v.back())) << name;
    double sum = 0;
    for (const float x : v) sum += x;
    EXPECT_NEAR(t["sum"].get<double>(), sum, 1e-9 * std::max(1.0, std::abs(sum))) << name;
  }
}

}  // namespace
}  // namespace rackrun::runtime
