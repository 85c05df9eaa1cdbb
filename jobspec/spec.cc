#include "jobspec/spec.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/edit_distance.h"
#include "base/file.h"
#include "base/string_view.h"
#include "base/utf8.h"
#include "comm/channel_names.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"
#include "jobspec/balancer.h"
#include "jobspec/data_blend.h"
#include "jobspec/field_checks.h"
#include "jobspec/restart_policy.h"
#include "planner/planner.h"
#include "yaml-cpp/depthguard.h"
#include "yaml-cpp/yaml.h"

namespace rackrun::jobspec {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using rackrun::v1::JobSpec;

std::string Join(absl::string_view parent, absl::string_view name) {
  return parent.empty() ? std::string(name) : absl::StrCat(parent, ".", name);
}

absl::Status UnknownField(const google::protobuf::Descriptor& type, absl::string_view path,
                          absl::string_view name) {
  std::vector<std::string> known;
  std::string closest;
  size_t best = std::numeric_limits<size_t>::max();
  for (int i = 0; i < type.field_count(); ++i) {
    const std::string& candidate = type.field(i)->name();
    known.push_back(candidate);
    const size_t d = base::EditDistance(base::AsStd(name), candidate);
    if (d < best) {
      best = d;
      closest = candidate;
    }
  }
  std::string hint = best <= 3 ? absl::StrCat("did you mean '", closest, "'? ") : "";
  return FieldError(path, absl::StrCat("unknown field; ", hint,
                                       "known fields here: ", absl::StrJoin(known, ", ")));
}

// A decimal integer: optional sign, digits (leading zeros allowed: `0100` is 100, as in
// YAML 1.2's core schema), within [min, max]. Explains the forms YAML 1.1 or C would
// read differently (`0x10`, `0o10`) and the ones that are not whole numbers (`1e6`).
// Returns the value's magnitude and sign.
struct Decimal {
  bool negative = false;
  uint64_t magnitude = 0;
};
absl::StatusOr<Decimal> ParseDecimal(const std::string& text, int64_t min, uint64_t max,
                                     absl::string_view type) {
  std::string_view t = text;
  Decimal d;
  if (!t.empty() && (t[0] == '+' || t[0] == '-')) {
    d.negative = t[0] == '-';
    t.remove_prefix(1);
  }
  if (t.size() > 1 && t[0] == '0' && std::string_view("xXoObB").find(t[1]) != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text,
                     "' is a hexadecimal, octal or binary literal; integers in a spec are decimal: "
                     "write the number in decimal digits"));
  }
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (t.empty() || !std::all_of(t.begin(), t.end(), digit)) {
    const bool numeric = !t.empty() && digit(t[0]) && std::all_of(t.begin(), t.end(), [](char c) {
      return (c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '_' || c == '+' ||
             c == '-';
    });
    if (numeric) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", text,
                       "' is not a whole decimal number (no fractions, exponents or '_'); write "
                       "the digits, e.g. 100000"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a valid ", type, " value; write a ", type));
  }
  for (char c : t) {
    const uint64_t v = static_cast<uint64_t>(c - '0');
    if (d.magnitude > (std::numeric_limits<uint64_t>::max() - v) / 10) {
      d.magnitude = std::numeric_limits<uint64_t>::max();
      break;
    }
    d.magnitude = d.magnitude * 10 + v;
  }
  const uint64_t min_magnitude = min < 0 ? static_cast<uint64_t>(-(min + 1)) + 1 : 0;
  if ((d.negative && d.magnitude > min_magnitude) || (!d.negative && d.magnitude > max)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is out of range for a ", type, " (", min, " to ", max, ")"));
  }
  return d;
}

int64_t SignedValue(const Decimal& d) {
  if (!d.negative) return static_cast<int64_t>(d.magnitude);
  return d.magnitude == 0 ? 0 : -static_cast<int64_t>(d.magnitude - 1) - 1;
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
  const auto integer = [&](int64_t min, uint64_t max) -> absl::StatusOr<Decimal> {
    absl::StatusOr<Decimal> v = ParseDecimal(text, min, max, field.cpp_type_name());
    if (!v.ok()) return FieldError(path, v.status().message());
    return v;
  };
  try {
    switch (field.cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32: {
        absl::StatusOr<Decimal> v =
            integer(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
        if (!v.ok()) return v.status();
        r.SetInt32(&message, &field, static_cast<int32_t>(SignedValue(*v)));
        break;
      }
      case FieldDescriptor::CPPTYPE_INT64: {
        absl::StatusOr<Decimal> v =
            integer(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
        if (!v.ok()) return v.status();
        r.SetInt64(&message, &field, SignedValue(*v));
        break;
      }
      case FieldDescriptor::CPPTYPE_UINT32:
      case FieldDescriptor::CPPTYPE_UINT64: {
        const uint64_t max = field.cpp_type() == FieldDescriptor::CPPTYPE_UINT32
                                 ? std::numeric_limits<uint32_t>::max()
                                 : std::numeric_limits<uint64_t>::max();
        absl::StatusOr<Decimal> v = integer(0, max);
        if (!v.ok()) return v.status();
        if (field.cpp_type() == FieldDescriptor::CPPTYPE_UINT32) {
          r.SetUInt32(&message, &field, static_cast<uint32_t>(v->magnitude));
        } else {
          r.SetUInt64(&message, &field, v->magnitude);
        }
        break;
      }
      case FieldDescriptor::CPPTYPE_DOUBLE:
      case FieldDescriptor::CPPTYPE_FLOAT: {
        const double v = node.as<double>();
        if (!std::isfinite(v) || (field.cpp_type() == FieldDescriptor::CPPTYPE_FLOAT &&
                                  std::abs(v) > std::numeric_limits<float>::max())) {
          return FieldError(path, absl::StrCat("'", text, "' is not a finite ",
                                               field.cpp_type_name(), "; write one"));
        }
        if (field.cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE) {
          r.SetDouble(&message, &field, v);
        } else {
          r.SetFloat(&message, &field, static_cast<float>(v));
        }
        break;
      }
      case FieldDescriptor::CPPTYPE_BOOL:
        r.SetBool(&message, &field, node.as<bool>());
        break;
      case FieldDescriptor::CPPTYPE_STRING:
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
    r.AddString(&message, &field, item);
  }
  return absl::OkStatus();
}

// 1-based line and column of byte `offset` of `text`.
std::string LineColumn(std::string_view text, size_t offset) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return absl::StrCat(line, ":", column);
}

// A string value or key: no NUL bytes, valid UTF-8.
absl::Status CheckText(const std::string& text, const std::string& path, absl::string_view what) {
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    return FieldError(path, absl::StrCat(what, " contains a NUL byte (at offset ", nul,
                                         "); remove it (a \\0 escape?)"));
  }
  if (const size_t bad = base::FirstInvalidUtf8(text); bad != std::string_view::npos) {
    return FieldError(
        path, absl::StrCat(what, " is not valid UTF-8 (byte 0x",
                           absl::Hex(static_cast<unsigned char>(text[bad]), absl::kZeroPad2),
                           " at offset ", bad, "); save the file as UTF-8"));
  }
  return absl::OkStatus();
}

// The 1-based line where a second YAML document starts, 0 when the text holds one. YAML's
// document markers ('---' starts a document, '...' ends one) stand at the start of a line,
// so they are found in the text; yaml-cpp 0.7's LoadAll loops forever on some malformed
// input (a 26-byte spec, found by tests/fuzz fuzz_job_spec), so it is not used.
int SecondDocumentLine(std::string_view text) {
  bool started = false;  // a '---' or content seen
  bool ended = false;    // a '...' seen
  int line = 0;
  for (absl::string_view l : absl::StrSplit(base::AsAbsl(text), '\n')) {
    ++line;
    const auto marker = [&](absl::string_view m) {
      return absl::StartsWith(l, m) &&
             (l.size() == 3 || l[3] == ' ' || l[3] == '\t' || l[3] == '\r');
    };
    if (marker("---")) {
      if (started || ended) return line;
      started = true;
      continue;
    }
    if (marker("...")) {
      ended = true;
      continue;
    }
    const absl::string_view body = absl::StripAsciiWhitespace(l);
    if (body.empty() || body[0] == '#' || (!started && body[0] == '%')) continue;
    if (ended) return line;
    started = true;
  }
  return 0;
}

constexpr int kMaxSpecDepth = 16;  // JobSpec nests 3 levels (model.moe.top_k)

// Checks the whole tree before it is mapped: keys are words given once per mapping,
// strings are NUL-free UTF-8, nesting is bounded.
absl::Status CheckTree(const YAML::Node& node, const std::string& path, int depth) {
  if (depth > kMaxSpecDepth) {
    return FieldError(path, absl::StrCat("nested more than ", kMaxSpecDepth,
                                         " levels deep; a job spec nests at most 3 "
                                         "(model.moe.top_k): check the brackets and indentation"));
  }
  if (node.IsScalar()) return CheckText(node.Scalar(), path.empty() ? "spec" : path, "the value");
  if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) {
      if (absl::Status s = CheckTree(node[i], absl::StrCat(path, "[", i, "]"), depth + 1);
          !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  }
  if (!node.IsMap()) return absl::OkStatus();
  std::map<std::string, int> seen;  // key -> 1-based line (0 = from --set)
  for (const auto& entry : node) {
    const YAML::Mark mark = entry.first.Mark();
    const int line = mark.is_null() ? 0 : mark.line + 1;
    if (!entry.first.IsScalar()) {
      return FieldError(path.empty() ? "spec" : path,
                        absl::StrCat("a key", line > 0 ? absl::StrCat(" on line ", line) : "",
                                     " is a list or mapping; keys are field names"));
    }
    const std::string& key = entry.first.Scalar();
    const std::string field_path = Join(path, key);
    if (absl::Status s = CheckText(key, field_path, "the field name"); !s.ok()) return s;
    const auto [it, inserted] = seen.emplace(key, line);
    if (!inserted) {
      return FieldError(field_path,
                        absl::StrCat("given twice",
                                     it->second > 0 && line > 0
                                         ? absl::StrCat(" (lines ", it->second, " and ", line, ")")
                                         : "",
                                     "; keep one (YAML would silently take the last)"));
    }
    if (absl::Status s = CheckTree(entry.second, field_path, depth + 1); !s.ok()) return s;
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

}  // namespace

absl::StatusOr<JobSpec> ParseJobSpec(const std::string& text,
                                     const std::vector<std::string>& overrides,
                                     const std::string& origin) {
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ":", LineColumn(text, nul),
                     ": contains a NUL byte; a spec is a text file (YAML or JSON)"));
  }
  if (const size_t bad = base::FirstInvalidUtf8(text); bad != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ":", LineColumn(text, bad), ": not valid UTF-8 (byte 0x",
                     absl::Hex(static_cast<unsigned char>(text[bad]), absl::kZeroPad2),
                     "); save the spec as UTF-8"));
  }
  YAML::Node root;
  try {
    if (const int line = SecondDocumentLine(text); line > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin, ":", line,
          ": a second YAML document starts here (after a '---' or '...' line); a spec file "
          "holds one document: remove the marker line and what follows, or merge it into "
          "the first"));
    }
    root = YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ":", e.mark.line + 1, ":", e.mark.column + 1, ": nested more than ", e.depth(),
        " levels deep; a job spec nests at most 3 (model.moe.top_k): check the brackets and "
        "indentation"));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, ":", e.mark.line + 1, ":", e.mark.column + 1, ": not valid YAML or JSON: ", e.msg));
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  for (const std::string& o : overrides) {
    if (absl::Status s = ApplyOverride(root, o); !s.ok()) return s;
  }
  if (absl::Status s = CheckTree(root, "", 0); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": ", s.message()));
  }
  JobSpec spec;
  absl::Status mapped;
  try {
    mapped = MapNode(root, spec, "");
  } catch (const YAML::Exception& e) {
    // Every expected error is a Status; this is the net under the ones not foreseen.
    mapped = absl::InvalidArgumentError(
        absl::StrCat(e.mark.line + 1, ":", e.mark.column + 1, ": cannot read the spec: ", e.msg));
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
  // A dataset is a file (.tokens) or a prefix (PREFIX.idx beside PREFIX.bin).
  const auto exists = [](const std::filesystem::path& p) {
    std::error_code ec;
    return std::filesystem::exists(p, ec) || std::filesystem::exists(p.string() + ".idx", ec);
  };
  for (const auto& [field, data_path] : MutableDataPaths(*spec)) {
    if (data_path->empty() || std::filesystem::path(*data_path).is_absolute()) continue;
    const std::filesystem::path beside = folder / *data_path;
    if (!folder.empty() && exists(beside) && !exists(*data_path)) *data_path = beside.string();
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
  if (moe.expert_hidden() == 0 && m.width() > 0 &&
      m.width() <= std::numeric_limits<int32_t>::max() / 2) {
    moe.set_expert_hidden(2 * m.width());  // a larger width leaves it 0: Validate asks for it
  }
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
  if (b.policy().empty()) b.set_policy(std::string(jobspec::kDefaultBalancerPolicy));
  if (!b.has_slots()) b.set_slots(2);
  if (b.eps() == 0) b.set_eps(0.01);
  if (b.min_replica_tokens() == 0) b.set_min_replica_tokens(1);
  if (!b.has_locality()) b.set_locality(true);
  if (b.eplb_window() == 0) b.set_eplb_window(16);
  if (b.eplb_interval() == 0) b.set_eplb_interval(16);
  if (b.mode().empty()) b.set_mode(std::string(jobspec::kDefaultBalancerMode));
  if (!b.has_shared_slots()) {
    const planner::PolicyTraits* policy = planner::FindPolicy(b.policy());
    b.set_shared_slots(policy == nullptr || policy->shared_slots);
  }

  rackrun::v1::CheckpointSpec& c = *spec.mutable_checkpoint();
  if (c.keep() == 0) c.set_keep(2);
  rackrun::v1::LoggingSpec& l = *spec.mutable_logging();
  if (l.interval() == 0) l.set_interval(10);
  rackrun::v1::ResourceSpec& r = *spec.mutable_resources();
  if (r.channel().empty()) r.set_channel(std::string(comm::kDefaultChannel));
  if (r.device().empty()) r.set_device("cpu");
  ApplyRestartDefaults(*spec.mutable_restart());
}

// Keep the two lists in the same order.
std::vector<std::pair<std::string, std::string*>> SpecPathFields(JobSpec& spec) {
  std::vector<std::pair<std::string, std::string*>> fields = MutableDataPaths(spec);
  fields.emplace_back("checkpoint.dir", spec.mutable_checkpoint()->mutable_dir());
  fields.emplace_back("logging.json", spec.mutable_logging()->mutable_json());
  fields.emplace_back("logging.load_trace", spec.mutable_logging()->mutable_load_trace());
  return fields;
}

std::vector<std::pair<std::string, const std::string*>> SpecPathFields(const JobSpec& spec) {
  std::vector<std::pair<std::string, const std::string*>> fields = DataPaths(spec);
  fields.emplace_back("checkpoint.dir", &spec.checkpoint().dir());
  fields.emplace_back("logging.json", &spec.logging().json());
  fields.emplace_back("logging.load_trace", &spec.logging().load_trace());
  return fields;
}

void MakeSpecPathsAbsolute(JobSpec& spec, const std::string& base_dir) {
  for (const auto& [field, path] : SpecPathFields(spec)) {
    if (path->empty() || std::filesystem::path(*path).is_absolute()) continue;
    *path = (std::filesystem::path(base_dir) / *path).lexically_normal().string();
  }
}

absl::Status CheckSpecPathsAbsolute(const JobSpec& spec) {
  for (const auto& [field, path] : SpecPathFields(spec)) {
    if (path->empty() || std::filesystem::path(*path).is_absolute()) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": '", *path,
        "' is not an absolute path; workers run in other folders (and on other hosts), so "
        "give the full path (rackrun submit makes paths absolute)"));
  }
  return absl::OkStatus();
}

std::string JobSpecToJson(const JobSpec& spec) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(spec, &json, options);
  return json;
}

}  // namespace rackrun::jobspec
