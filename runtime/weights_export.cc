#include "runtime/weights_export.h"

#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "data/safetensors.h"
#include "google/protobuf/util/json_util.h"
#include "jobspec/spec.h"
#include "nlohmann/json.hpp"
#include "rackrun/v1/job_spec.pb.h"
#include "runtime/checkpoint.h"
#include "runtime/job_config.h"
#include "runtime/model.h"
#include "runtime/trainer.h"

namespace rackrun::runtime {
namespace {

namespace fs = std::filesystem;

// `spec` as JSON with the proto's field names (jobspec's one message -> JSON path).
nlohmann::json ModelSpecJson(const rackrun::v1::ModelSpec& spec) {
  rackrun::v1::JobSpec job;
  *job.mutable_model() = spec;
  return nlohmann::json::parse(jobspec::JobSpecToJson(job))["model"];
}

// A model of `spec` (all experts here), for its tensors' names, sizes and shapes.
absl::StatusOr<std::unique_ptr<Model<float>>> ModelOf(const rackrun::v1::ModelSpec& spec) {
  rackrun::v1::JobSpec job;
  *job.mutable_model() = spec;
  return Model<float>::Create(ModelConfigFromSpec(job), /*seed=*/0);
}

// Every tensor of the model: parameters, then buffers (the checkpoint's section prefixes).
struct WeightTensor {
  std::string name;
  std::string section;
  int64_t size = 0;
  std::vector<int64_t> shape;
};
std::vector<WeightTensor> TensorsOf(Model<float>& model) {
  std::vector<WeightTensor> out;
  const auto add = [&](const std::vector<ParamRef<float>>& refs, const char* prefix) {
    for (const ParamRef<float>& p : refs) {
      out.push_back({p.name, prefix + p.name, p.size,
                     p.shape.empty() ? std::vector<int64_t>{p.size} : p.shape});
    }
  };
  add(model.Parameters(), "param/");
  add(model.Buffers(), "buffer/");
  return out;
}

}  // namespace

absl::StatusOr<ExportedWeights> ExportSafetensors(const std::string& checkpoint,
                                                  const std::string& out_dir) {
  ExportedWeights result;
  absl::StatusOr<Checkpoint> c = LoadCheckpointForResume(checkpoint, &result.checkpoint);
  if (!c.ok()) return c.status();
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", result.checkpoint, "' cannot be exported: ", why));
  };
  const CheckpointSection* model_section = c->Find("spec/model");
  rackrun::v1::ModelSpec spec;
  if (model_section == nullptr || !spec.ParseFromString(model_section->payload)) {
    return bad("it has no model spec (section spec/model)");
  }
  absl::StatusOr<std::unique_ptr<Model<float>>> model = ModelOf(spec);
  if (!model.ok()) return bad(model.status().message());
  std::vector<data::SafeTensor> tensors;
  nlohmann::json names = nlohmann::json::array();
  for (const WeightTensor& t : TensorsOf(**model)) {
    const CheckpointSection* s = c->Find(t.section);
    if (s == nullptr) return bad(absl::StrCat("section '", t.section, "' is missing"));
    if (s->payload.size() != static_cast<size_t>(t.size) * sizeof(float)) {
      return bad(absl::StrCat("section '", t.section, "' holds ", s->payload.size(),
                              " bytes, the model's tensor ", t.size, " floats"));
    }
    tensors.push_back({.name = t.name, .dtype = "F32", .shape = t.shape, .bytes = s->payload});
    names.push_back(t.name);
    result.parameters += t.size;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec)
    return absl::InvalidArgumentError(
        absl::StrCat("--output: cannot create '", out_dir, "': ", ec.message()));
  result.step = c->step;
  result.tensors = static_cast<int64_t>(tensors.size());
  result.safetensors = (fs::path(out_dir) / "model.safetensors").string();
  result.config = (fs::path(out_dir) / "config.json").string();
  if (absl::Status s = data::WriteSafetensors(
          result.safetensors, tensors,
          {{"format", "pt"}, {"producer", "rackrun export"}, {"step", std::to_string(c->step)}});
      !s.ok()) {
    return s;
  }
  const rackrun::v1::MoeSpec& moe = spec.moe();
  nlohmann::json config = {
      {"architecture", "rackrun-moe"},
      {"format_version", 1},
      {"dtype", "float32"},
      {"step", c->step},
      {"vocab_size", spec.vocab()},
      {"width", spec.width()},
      {"blocks", spec.blocks()},
      {"heads", spec.heads()},
      {"seq_len", spec.seq_len()},
      {"experts", moe.experts()},
      {"top_k", moe.top_k()},
      {"expert_hidden", moe.expert_hidden()},
      {"shared_expert", moe.shared_expert()},
      {"shared_hidden", moe.shared_hidden()},
      {"residual", spec.residual()},
      {"streams", spec.streams()},
      {"active", spec.active()},
      {"fixed", spec.fixed()},
      {"rope_theta", spec.rope_theta()},
      {"tensors", names},
      {"model_spec", ModelSpecJson(spec)},
  };
  const CheckpointSection* tokenizer = c->Find("data/tokenizer");
  config["tokenizer"] = tokenizer != nullptr
                            ? nlohmann::json::parse(tokenizer->payload, nullptr, false)
                            : nlohmann::json(nullptr);
  const CheckpointSection* job = c->Find("spec/json");
  config["job_spec"] = job != nullptr ? nlohmann::json::parse(job->payload, nullptr, false)
                                      : nlohmann::json(nullptr);
  if (absl::Status s = base::WriteFileAtomically(result.config, config.dump(2) + "\n"); !s.ok()) {
    return s;
  }
  return result;
}

absl::StatusOr<std::string> ImportSafetensors(const std::string& dir,
                                              const std::string& checkpoint_dir, int64_t step) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const std::string weights_path = (fs::path(dir) / "model.safetensors").string();
  absl::StatusOr<std::string> text = base::ReadWholeFile(config_path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read '", config_path,
                                                   "'; import reads DIR/config.json and "
                                                   "DIR/model.safetensors (as rackrun export "
                                                   "writes them)"));
  }
  const nlohmann::json config = nlohmann::json::parse(*text, nullptr, false);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("'", config_path, "': ", why));
  };
  if (!config.is_object() || config.value("architecture", "") != "rackrun-moe" ||
      !config.contains("model_spec") || !config["model_spec"].is_object()) {
    return bad("not a rackrun-moe config (architecture and model_spec are needed)");
  }
  rackrun::v1::ModelSpec spec;
  if (!google::protobuf::util::JsonStringToMessage(config["model_spec"].dump(), &spec).ok()) {
    return bad("model_spec is not a model spec");
  }
  absl::StatusOr<data::SafetensorsFile> weights = data::SafetensorsFile::Open(weights_path);
  if (!weights.ok()) return weights.status();
  absl::StatusOr<std::unique_ptr<Model<float>>> model = ModelOf(spec);
  if (!model.ok()) return bad(model.status().message());

  Checkpoint c;
  c.step = step;
  c.sections.push_back({"trainer/state", TrainerStateSection(step, /*adam_step=*/0)});
  c.sections.push_back({"spec/model", spec.SerializeAsString()});
  if (config.contains("job_spec") && config["job_spec"].is_object()) {
    c.sections.push_back({"spec/json", config["job_spec"].dump()});
  }
  if (config.contains("tokenizer") && config["tokenizer"].is_object()) {
    c.sections.push_back({"data/tokenizer", config["tokenizer"].dump()});
  }
  for (const WeightTensor& t : TensorsOf(**model)) {
    const data::SafeTensor* w = weights->Find(t.name);
    if (w == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", weights_path, "' has no tensor '", t.name, "' that the model needs"));
    }
    if (w->dtype != "F32" || w->shape != t.shape) {
      std::string want, got;
      for (const int64_t d : t.shape) absl::StrAppend(&want, want.empty() ? "" : ",", d);
      for (const int64_t d : w->shape) absl::StrAppend(&got, got.empty() ? "" : ",", d);
      return absl::InvalidArgumentError(absl::StrCat("'", weights_path, "': tensor '", t.name,
                                                     "' is ", w->dtype, " [", got,
                                                     "], the model needs F32 [", want, "]"));
    }
    c.sections.push_back({t.section, std::string(w->bytes)});
    if (t.section.rfind("param/", 0) == 0) {
      const std::string zeros = PackFloats(std::vector<float>(static_cast<size_t>(t.size), 0.0f));
      c.sections.push_back({"adam_m/" + t.name, zeros});
      c.sections.push_back({"adam_v/" + t.name, zeros});
    }
  }
  return SaveCheckpoint(checkpoint_dir, c, /*keep=*/2);
}

}  // namespace rackrun::runtime
