#include "runtime/spec.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/file.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"
#include "yaml-cpp/yaml.h"

namespace rackrun::runtime {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using rackrun::v1::JobSpec;

absl::Status FieldError(absl::string_view path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
}

std::string Join(absl::string_view parent, absl::string_view name) {
  return parent.empty() ? std::string(name) : absl::StrCat(parent, ".", name);
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

absl::Status UnknownField(const google::protobuf::Descriptor& type, absl::string_view path,
                          absl::string_view name) {
  std::vector<std::string> known;
  std::string closest;
  size_t best = std::numeric_limits<size_t>::max();
  for (int i = 0; i < type.field_count(); ++i) {
    const std::string& candidate = type.field(i)->name();
    known.push_back(candidate);
    const size_t d = EditDistance(std::string_view(name.data(), name.size()), candidate);
    if (d < best) {
      best = d;
      closest = candidate;
    }
  }
  std::string hint = best <= 3 ? absl::StrCat("did you mean '", closest, "'? ") : "";
  return FieldError(path, absl::StrCat("unknown field; ", hint,
                                       "known fields here: ", absl::StrJoin(known, ", ")));
}

// Whether `s` is well-formed UTF-8 (no overlongs, surrogates or code points above
// U+10FFFF). Protobuf string fields must hold UTF-8: a spec with other bytes would fail
// to parse on the coordinator after it was sent (found by tests/fuzz fuzz_job_spec).
bool IsUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i <= n) return false;
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

absl::Status CheckUtf8(std::string_view text, const std::string& path) {
  if (IsUtf8(text)) return absl::OkStatus();
  return FieldError(path, "is not valid UTF-8 text; write the value in UTF-8");
}

// Sets one scalar field from a YAML scalar.
absl::Status SetScalar(const YAML::Node& node, const FieldDescriptor& field, Message& message,
                       const std::string& path) {
  if (!node.IsScalar()) {
    return FieldError(
        path, absl::StrCat("expected a ", field.cpp_type_name(), " value, got a list or mapping"));
  }
  const google::protobuf::Reflection& r = *message.GetReflection();
  const std::string& text = node.Scalar();
  try {
    switch (field.cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        r.SetInt32(&message, &field, node.as<int32_t>());
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        r.SetInt64(&message, &field, node.as<int64_t>());
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        r.SetUInt32(&message, &field, node.as<uint32_t>());
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        if (!text.empty() && text[0] == '-') throw YAML::BadConversion(node.Mark());
        r.SetUInt64(&message, &field, node.as<uint64_t>());
        break;
      case FieldDescriptor::CPPTYPE_DOUBLE:
        r.SetDouble(&message, &field, node.as<double>());
        break;
      case FieldDescriptor::CPPTYPE_FLOAT:
        r.SetFloat(&message, &field, node.as<float>());
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        r.SetBool(&message, &field, node.as<bool>());
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        if (absl::Status s = CheckUtf8(text, path); !s.ok()) return s;
        r.SetString(&message, &field, text);
        break;
      default:
        return FieldError(path, "this field type cannot be set from a spec file");
    }
  } catch (const YAML::Exception&) {
    return FieldError(path, absl::StrCat("'", text, "' is not a valid ", field.cpp_type_name(),
                                         " value; write a ", field.cpp_type_name()));
  }
  return absl::OkStatus();
}

// Sets a list of strings (the only lists in JobSpec) from a YAML sequence, or from one
// comma-separated scalar (what `--set restart.on=worker_lost,hang` produces).
absl::Status SetList(const YAML::Node& node, const FieldDescriptor& field, Message& message,
                     const std::string& path) {
  if (field.cpp_type() != FieldDescriptor::CPPTYPE_STRING) {
    return FieldError(path, "lists of this type cannot be set from a spec file");
  }
  const google::protobuf::Reflection& r = *message.GetReflection();
  r.ClearField(&message, &field);
  if (node.IsNull()) return absl::OkStatus();
  std::vector<std::string> items;
  if (node.IsSequence()) {
    for (const YAML::Node& item : node) {
      if (!item.IsScalar()) {
        return FieldError(path, "expected a list of words, e.g. [worker_lost, hang]");
      }
      items.push_back(item.Scalar());
    }
  } else if (node.IsScalar()) {
    for (absl::string_view part : absl::StrSplit(node.Scalar(), ',', absl::SkipEmpty())) {
      items.emplace_back(absl::StripAsciiWhitespace(part));
    }
  } else {
    return FieldError(path, "expected a list of words, e.g. [worker_lost, hang]");
  }
  for (const std::string& item : items) {
    if (absl::Status s = CheckUtf8(item, path); !s.ok()) return s;
    r.AddString(&message, &field, item);
  }
  return absl::OkStatus();
}

absl::Status MapNode(const YAML::Node& node, Message& message, const std::string& path) {
  const google::protobuf::Descriptor& type = *message.GetDescriptor();
  if (node.IsNull()) return absl::OkStatus();
  if (!node.IsMap()) {
    return FieldError(path.empty() ? "spec" : path,
                      absl::StrCat("expected a mapping of fields (", type.name(), ")"));
  }
  for (const auto& entry : node) {
    if (!entry.first.IsScalar()) {
      // as<std::string>() would throw (found by tests/fuzz fuzz_job_spec).
      return FieldError(path.empty() ? "spec" : path,
                        "a field name must be a word, not a list or mapping");
    }
    const std::string name = entry.first.as<std::string>();
    const std::string field_path = Join(path, name);
    const FieldDescriptor* field = type.FindFieldByName(name);
    if (field == nullptr) field = type.FindFieldByCamelcaseName(name);
    if (field == nullptr) return UnknownField(type, field_path, name);
    if (field->is_repeated()) {
      if (absl::Status s = SetList(entry.second, *field, message, field_path); !s.ok()) return s;
      continue;
    }
    if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (!entry.second.IsNull() && !entry.second.IsMap()) {
        return FieldError(field_path, absl::StrCat("expected a mapping of fields (",
                                                   field->message_type()->name(), ")"));
      }
      Message* child = message.GetReflection()->MutableMessage(&message, field);
      if (absl::Status s = MapNode(entry.second, *child, field_path); !s.ok()) return s;
    } else if (!entry.second.IsNull()) {
      if (absl::Status s = SetScalar(entry.second, *field, message, field_path); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Applies "a.b.c=value" to the YAML tree, creating mappings on the way.
absl::Status ApplyOverride(YAML::Node& root, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--set '", assignment, "': expected FIELD=VALUE, for example training.steps=50"));
  }
  const std::string key = assignment.substr(0, eq);
  const std::vector<std::string> parts = absl::StrSplit(key, '.');
  for (const std::string& part : parts) {
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set '", assignment, "': empty component in field path '", key, "'"));
    }
  }
  if (!root.IsMap() && !root.IsNull()) {
    return absl::InvalidArgumentError("spec: the top level must be a mapping of fields");
  }
  YAML::Node node = root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node child = node[parts[i]];
    if (!child.IsDefined() || child.IsNull()) {
      node[parts[i]] = YAML::Node(YAML::NodeType::Map);
      child = node[parts[i]];
    } else if (!child.IsMap()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--set '", assignment, "': '",
                       absl::StrJoin(parts.begin(), parts.begin() + static_cast<long>(i) + 1, "."),
                       "' is a value, not a section"));
    }
    node.reset(child);
  }
  node[parts.back()] = std::string(assignment.substr(eq + 1));
  return absl::OkStatus();
}

bool OneOf(const std::string& value, std::initializer_list<std::string_view> choices) {
  return std::find(choices.begin(), choices.end(), value) != choices.end();
}

}  // namespace

absl::StatusOr<JobSpec> ParseJobSpec(const std::string& text,
                                     const std::vector<std::string>& overrides,
                                     const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ":", e.mark.line + 1, ":", e.mark.column + 1, ": not valid YAML or JSON: ", e.msg));
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  for (const std::string& o : overrides) {
    if (absl::Status s = ApplyOverride(root, o); !s.ok()) return s;
  }
  JobSpec spec;
  absl::Status mapped;
  try {
    mapped = MapNode(root, spec, "");
  } catch (const YAML::Exception& e) {
    // Every expected error is a Status; this is the net under the ones not foreseen.
    mapped = absl::InvalidArgumentError(absl::StrCat(e.mark.line + 1, ":", e.mark.column + 1,
                                                     ": cannot read the spec: ", e.msg));
  }
  if (!mapped.ok()) return absl::InvalidArgumentError(absl::StrCat(origin, ": ", mapped.message()));
  ApplySpecDefaults(spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": ", s.message()));
  }
  return spec;
}

absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path,
                                    const std::vector<std::string>& overrides) {
  absl::StatusOr<std::string> text = base::ReadWholeFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec file '", path,
                     "' cannot be opened; check the path (for example examples/tiny-moe.yaml)"));
  }
  absl::StatusOr<JobSpec> spec = ParseJobSpec(*text, overrides, path);
  if (!spec.ok()) return spec;
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  for (std::string* data_path :
       {spec->mutable_data()->mutable_train(), spec->mutable_data()->mutable_validation()}) {
    if (data_path->empty() || std::filesystem::path(*data_path).is_absolute()) continue;
    std::error_code ec;
    const std::filesystem::path beside = folder / *data_path;
    if (!folder.empty() && std::filesystem::exists(beside, ec) &&
        !std::filesystem::exists(*data_path, ec)) {
      *data_path = beside.string();
    }
  }
  return spec;
}

void ApplySpecDefaults(JobSpec& spec) {
  if (spec.name().empty()) spec.set_name("job");
  rackrun::v1::ModelSpec& m = *spec.mutable_model();
  if (m.residual().empty()) m.set_residual("xhc");
  const bool xhc = m.residual().rfind("xhc", 0) == 0;
  if (m.streams() == 0) {
    m.set_streams(m.residual() == "vanilla" ? 1 : (xhc ? 16 : 4));
  }
  if (xhc) {
    if (m.active() == 0) m.set_active(4);
    if (m.fixed() == 0) m.set_fixed(2);
  }
  if (m.rope_theta() == 0) m.set_rope_theta(10000);
  if (m.init_std() == 0) m.set_init_std(0.02);
  rackrun::v1::MoeSpec& moe = *m.mutable_moe();
  if (moe.top_k() == 0) moe.set_top_k(2);
  if (moe.expert_hidden() == 0) moe.set_expert_hidden(2 * m.width());
  if (moe.shared_expert() && moe.shared_hidden() == 0) moe.set_shared_hidden(moe.expert_hidden());

  rackrun::v1::DataSpec& d = *spec.mutable_data();
  if (d.batch_size() == 0) d.set_batch_size(8);

  rackrun::v1::TrainingSpec& t = *spec.mutable_training();
  if (t.microbatches() == 0) t.set_microbatches(1);
  if (t.lr() == 0) t.set_lr(3e-3);
  if (!t.has_min_lr()) t.set_min_lr(t.lr() / 10);
  if (!t.has_warmup_steps()) t.set_warmup_steps(t.steps() / 20);
  if (t.schedule().empty()) t.set_schedule("cosine");
  if (!t.has_weight_decay()) t.set_weight_decay(0.1);
  if (t.beta1() == 0) t.set_beta1(0.9);
  if (t.beta2() == 0) t.set_beta2(0.95);
  if (t.adam_eps() == 0) t.set_adam_eps(1e-8);
  if (!t.has_grad_clip()) t.set_grad_clip(1.0);
  if (t.eval_batches() == 0) t.set_eval_batches(8);

  rackrun::v1::BalancerSpec& b = *spec.mutable_balancer();
  if (b.policy().empty()) b.set_policy("none");
  if (!b.has_slots()) b.set_slots(2);
  if (b.eps() == 0) b.set_eps(0.01);
  if (b.min_replica_tokens() == 0) b.set_min_replica_tokens(1);
  if (!b.has_locality()) b.set_locality(true);
  if (b.eplb_window() == 0) b.set_eplb_window(16);
  if (b.eplb_interval() == 0) b.set_eplb_interval(16);
  if (b.mode().empty()) b.set_mode("inband");
  if (!b.has_shared_slots()) b.set_shared_slots(b.policy() != "eplb");

  rackrun::v1::CheckpointSpec& c = *spec.mutable_checkpoint();
  if (c.keep() == 0) c.set_keep(2);
  rackrun::v1::LoggingSpec& l = *spec.mutable_logging();
  if (l.interval() == 0) l.set_interval(10);
  rackrun::v1::ResourceSpec& r = *spec.mutable_resources();
  if (r.channel().empty()) r.set_channel("gloo");
  rackrun::v1::RestartSpec& restart = *spec.mutable_restart();
  if (restart.max_attempts() == 0) restart.set_max_attempts(1);
  if (restart.on().empty()) {
    for (const char* kind : {"worker_lost", "hang", "worker_cancelled"}) restart.add_on(kind);
  }
  if (restart.backoff_s() == 0) restart.set_backoff_s(1);
}

absl::Status ValidateJobSpec(const JobSpec& spec) {
  const rackrun::v1::ModelSpec& m = spec.model();
  if (m.vocab() < 0) return FieldError("model.vocab", "must be >= 0 (0 = from the token file)");
  if (m.width() <= 0) return FieldError("model.width", "required; set the model width C, e.g. 128");
  if (m.blocks() <= 0)
    return FieldError("model.blocks", "required; set the number of blocks, e.g. 4");
  if (m.heads() <= 0) return FieldError("model.heads", "required; set the attention heads, e.g. 4");
  if (m.width() % m.heads() != 0) {
    return FieldError("model.heads",
                      absl::StrCat("model.width ", m.width(), " is not divisible by heads ",
                                   m.heads(), "; choose heads that divide the width"));
  }
  if ((m.width() / m.heads()) % 2 != 0) {
    return FieldError("model.heads",
                      absl::StrCat("head width ", m.width() / m.heads(),
                                   " is odd; rotary embeddings need an even head width"));
  }
  if (m.seq_len() <= 0)
    return FieldError("model.seq_len", "required; set the sequence length, e.g. 128");
  if (!OneOf(m.residual(), {"vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"})) {
    return FieldError("model.residual", absl::StrCat("unknown mode '", m.residual(),
                                                     "'; choose vanilla, hc, mhc, xhc, "
                                                     "xhc_flash or xhc_flash4"));
  }
  if (m.streams() < 1) return FieldError("model.streams", "must be >= 1");
  if (m.residual() == "vanilla" && m.streams() != 1) {
    return FieldError("model.streams",
                      "vanilla has exactly 1 stream; remove model.streams or set 1");
  }
  const bool xhc = m.residual().rfind("xhc", 0) == 0;
  if (xhc) {
    if (m.active() < 1 || m.active() > m.streams()) {
      return FieldError("model.active",
                        absl::StrCat("active streams k = ", m.active(),
                                     " must lie in [1, streams N = ", m.streams(),
                                     "]; lower model.active or raise model.streams"));
    }
    if (m.fixed() < 0 || m.fixed() > m.active()) {
      return FieldError("model.fixed", absl::StrCat("fixed streams m = ", m.fixed(),
                                                    " must lie in [0, active k = ", m.active(),
                                                    "]; lower model.fixed"));
    }
  } else if (m.active() != 0 || m.fixed() != 0) {
    return FieldError(m.active() != 0 ? "model.active" : "model.fixed",
                      absl::StrCat("only xhc modes use active/fixed streams, not '", m.residual(),
                                   "'; remove the field"));
  }
  if (m.rope_theta() <= 0) return FieldError("model.rope_theta", "must be positive");
  if (m.init_std() <= 0) return FieldError("model.init_std", "must be positive");
  const rackrun::v1::MoeSpec& moe = m.moe();
  if (moe.experts() <= 0) {
    return FieldError("model.moe.experts", "required; set the number of routed experts, e.g. 16");
  }
  if (moe.top_k() < 1 || moe.top_k() > moe.experts()) {
    return FieldError("model.moe.top_k", absl::StrCat("top_k ", moe.top_k(),
                                                      " must lie in [1, experts = ", moe.experts(),
                                                      "]; lower model.moe.top_k or add experts"));
  }
  if (moe.expert_hidden() <= 0) return FieldError("model.moe.expert_hidden", "must be positive");
  if (moe.shared_hidden() < 0) return FieldError("model.moe.shared_hidden", "must be >= 0");
  if (moe.aux_loss_coef() < 0)
    return FieldError("model.moe.aux_loss_coef", "must be >= 0 (0 = off)");
  if (moe.bias_update_rate() < 0) {
    return FieldError("model.moe.bias_update_rate", "must be >= 0 (0 = off)");
  }

  const rackrun::v1::DataSpec& d = spec.data();
  if (d.train().empty()) {
    return FieldError("data.train", "required; point it at a token file made by `rackrun data`");
  }
  if (d.batch_size() < 1) return FieldError("data.batch_size", "must be >= 1");

  const rackrun::v1::TrainingSpec& t = spec.training();
  if (t.steps() <= 0)
    return FieldError("training.steps", "required; set the optimizer steps, e.g. 300");
  if (t.microbatches() < 1) return FieldError("training.microbatches", "must be >= 1");
  if (t.lr() <= 0) return FieldError("training.lr", "must be positive");
  if (t.min_lr() < 0 || t.min_lr() > t.lr()) {
    return FieldError("training.min_lr", absl::StrCat("must lie in [0, lr = ", t.lr(), "]"));
  }
  if (t.warmup_steps() < 0 || t.warmup_steps() > t.steps()) {
    return FieldError("training.warmup_steps",
                      absl::StrCat("must lie in [0, steps = ", t.steps(), "]"));
  }
  if (!OneOf(t.schedule(), {"cosine", "constant"})) {
    return FieldError("training.schedule", absl::StrCat("unknown schedule '", t.schedule(),
                                                        "'; choose cosine or constant"));
  }
  if (t.weight_decay() < 0) return FieldError("training.weight_decay", "must be >= 0");
  if (t.beta1() < 0 || t.beta1() >= 1) return FieldError("training.beta1", "must lie in [0, 1)");
  if (t.beta2() < 0 || t.beta2() >= 1) return FieldError("training.beta2", "must lie in [0, 1)");
  if (t.adam_eps() <= 0) return FieldError("training.adam_eps", "must be positive");
  if (t.grad_clip() < 0) return FieldError("training.grad_clip", "must be >= 0 (0 = off)");
  if (t.eval_interval() < 0) return FieldError("training.eval_interval", "must be >= 0");
  if (t.eval_batches() < 1) return FieldError("training.eval_batches", "must be >= 1");

  const rackrun::v1::BalancerSpec& b = spec.balancer();
  if (!OneOf(b.policy(), {"none", "ultraep", "eplb"})) {
    return FieldError("balancer.policy", absl::StrCat("unknown policy '", b.policy(),
                                                      "'; choose none, ultraep or eplb"));
  }
  if (b.slots() < 0) return FieldError("balancer.slots", "must be >= 0");
  if (b.eps() <= 0) return FieldError("balancer.eps", "must be positive, e.g. 0.01");
  if (b.min_replica_tokens() < 1) return FieldError("balancer.min_replica_tokens", "must be >= 1");
  if (b.eplb_window() < 1) return FieldError("balancer.eplb_window", "must be >= 1");
  if (b.eplb_interval() < 1) return FieldError("balancer.eplb_interval", "must be >= 1");
  if (!OneOf(b.mode(), {"inband", "coordinator"})) {
    return FieldError("balancer.mode",
                      absl::StrCat("unknown mode '", b.mode(), "'; choose inband or coordinator"));
  }

  if (spec.checkpoint().interval() < 0) return FieldError("checkpoint.interval", "must be >= 0");
  if (spec.checkpoint().keep() < 2) {
    return FieldError("checkpoint.keep",
                      "must be >= 2 so the previous good checkpoint survives; set 2 or more");
  }
  if (spec.logging().interval() < 1) return FieldError("logging.interval", "must be >= 1");
  const rackrun::v1::ResourceSpec& r = spec.resources();
  if (r.threads() < 0) return FieldError("resources.threads", "must be >= 0 (0 = all cores)");
  if (r.ranks() < 0) return FieldError("resources.ranks", "must be >= 0 (0 = as launched)");
  if (!OneOf(r.channel(), {"gloo", "nccl"})) {
    return FieldError("resources.channel", absl::StrCat("unknown data channel '", r.channel(),
                                                        "'; choose gloo (CPU) or nccl (GPU)"));
  }
  const rackrun::v1::RestartSpec& restart = spec.restart();
  if (restart.max_attempts() < 1) {
    return FieldError("restart.max_attempts", "must be >= 1 (1 = never restart)");
  }
  for (const std::string& kind : restart.on()) {
    if (!OneOf(kind, {"worker_lost", "hang", "error", "worker_cancelled"})) {
      return FieldError("restart.on",
                        absl::StrCat("unknown failure kind '", kind,
                                     "'; choose from worker_lost, hang, error, worker_cancelled"));
    }
  }
  if (restart.backoff_s() < 0 || !std::isfinite(restart.backoff_s())) {
    return FieldError("restart.backoff_s", "must be a finite number of seconds >= 0");
  }
  if (r.ranks() > 0 && moe.experts() % r.ranks() != 0) {
    return FieldError("model.moe.experts",
                      absl::StrCat(moe.experts(), " experts cannot be split evenly over ",
                                   r.ranks(), " ranks; use a multiple of resources.ranks"));
  }
  return absl::OkStatus();
}

void MakeSpecPathsAbsolute(JobSpec& spec, const std::string& base_dir) {
  const auto absolute = [&](std::string* path) {
    if (path->empty() || std::filesystem::path(*path).is_absolute()) return;
    *path = (std::filesystem::path(base_dir) / *path).lexically_normal().string();
  };
  absolute(spec.mutable_data()->mutable_train());
  absolute(spec.mutable_data()->mutable_validation());
  absolute(spec.mutable_checkpoint()->mutable_dir());
  absolute(spec.mutable_logging()->mutable_json());
  absolute(spec.mutable_logging()->mutable_load_trace());
}

std::string JobSpecToJson(const JobSpec& spec) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(spec, &json, options);
  return json;
}

}  // namespace rackrun::runtime
