#include "jobspec/spec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/edit_distance.h"
#include "base/file.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/util/json_util.h"
#include "yaml-cpp/depthguard.h"
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

absl::Status UnknownField(const google::protobuf::Descriptor& type, absl::string_view path,
                          absl::string_view name) {
  std::vector<std::string> known;
  std::string closest;
  size_t best = std::numeric_limits<size_t>::max();
  for (int i = 0; i < type.field_count(); ++i) {
    const std::string& candidate = type.field(i)->name();
    known.push_back(candidate);
    const size_t d = base::EditDistance(std::string_view(name.data(), name.size()), candidate);
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
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is a hexadecimal, octal or binary literal; integers in a spec are decimal: "
                   "write the number in decimal digits"));
  }
  const auto digit = [](char c) { return c >= '0' && c <= '9'; };
  if (t.empty() || !std::all_of(t.begin(), t.end(), digit)) {
    const bool numeric = !t.empty() && digit(t[0]) && std::all_of(t.begin(), t.end(), [](char c) {
      return (c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '_' || c == '+' ||
             c == '-';
    });
    if (numeric) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", text, "' is not a whole decimal number (no fractions, exponents or '_'); write "
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
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is out of range for a ", type,
                                                   " (", min, " to ", max, ")"));
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
        absl::StatusOr<Decimal> v = integer(std::numeric_limits<int32_t>::min(),
                                            std::numeric_limits<int32_t>::max());
        if (!v.ok()) return v.status();
        r.SetInt32(&message, &field, static_cast<int32_t>(SignedValue(*v)));
        break;
      }
      case FieldDescriptor::CPPTYPE_INT64: {
        absl::StatusOr<Decimal> v = integer(std::numeric_limits<int64_t>::min(),
                                            std::numeric_limits<int64_t>::max());
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

// Offset of the first byte that is not part of valid UTF-8 (overlong forms, surrogates
// and code points above U+10FFFF are invalid), or npos.
size_t InvalidUtf8At(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int extra = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      extra = 1;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      extra = 2;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + static_cast<size_t>(extra) >= s.size()) return i;  // truncated sequence
    for (int j = 1; j <= extra; ++j) {
      const unsigned char d = static_cast<unsigned char>(s[i + static_cast<size_t>(j)]);
      if ((d & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((extra == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return i;
    }
    i += static_cast<size_t>(extra) + 1;
  }
  return std::string_view::npos;
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
  if (const size_t bad = InvalidUtf8At(text); bad != std::string_view::npos) {
    return FieldError(path, absl::StrCat(what, " is not valid UTF-8 (byte 0x",
                                         absl::Hex(static_cast<unsigned char>(text[bad]),
                                                   absl::kZeroPad2),
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
  for (absl::string_view l : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line;
    const auto marker = [&](absl::string_view m) {
      return absl::StartsWith(l, m) && (l.size() == 3 || l[3] == ' ' || l[3] == '\t' || l[3] == '\r');
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
      if (absl::Status s = CheckTree(node[i], absl::StrCat(path, "[", i, "]"), depth + 1); !s.ok()) {
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
                        absl::StrCat("given twice", it->second > 0 && line > 0
                                                        ? absl::StrCat(" (lines ", it->second,
                                                                       " and ", line, ")")
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

bool OneOf(const std::string& value, std::initializer_list<std::string_view> choices) {
  return std::find(choices.begin(), choices.end(), value) != choices.end();
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
  if (const size_t bad = InvalidUtf8At(text); bad != std::string_view::npos) {
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

namespace {

// A size the job cannot run without: 0 means "not given", a negative value is wrong.
absl::Status RequirePositive(absl::string_view path, int64_t value, absl::string_view what) {
  if (value > 0) return absl::OkStatus();
  if (value == 0) return FieldError(path, absl::StrCat("required; set ", what));
  return FieldError(path, absl::StrCat("is ", value, "; it must be positive: set ", what));
}

// value >= min, where `zero` explains what 0 (the default) means, if anything.
absl::Status AtLeast(absl::string_view path, int64_t value, int64_t min, absl::string_view zero) {
  if (value >= min) return absl::OkStatus();
  return FieldError(path, absl::StrCat("is ", value, "; it must be >= ", min,
                                       zero.empty() ? "" : absl::StrCat(" (", zero, ")")));
}

absl::Status Finite(absl::string_view path, double value) {
  if (std::isfinite(value)) return absl::OkStatus();
  return FieldError(path, absl::StrCat("is ", value, "; write a finite number"));
}

constexpr int kMaxTopK = 64;      // the MoE layer's per-token gate scratch (runtime/model.cc)
constexpr int kMaxThreads = 4096;  // beyond any machine; CheckJobFitsThisMachine asks this one

}  // namespace

absl::Status ValidateJobSpec(const JobSpec& spec) {
  const rackrun::v1::ModelSpec& m = spec.model();
  if (m.vocab() < 0) {
    return FieldError("model.vocab", absl::StrCat("is ", m.vocab(),
                                                  "; it must be >= 0 (0 = from the token file)"));
  }
  if (absl::Status s = RequirePositive("model.width", m.width(), "the model width C, e.g. 128");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = RequirePositive("model.blocks", m.blocks(), "the number of blocks, e.g. 4");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = RequirePositive("model.heads", m.heads(), "the attention heads, e.g. 4");
      !s.ok()) {
    return s;
  }
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
  if (absl::Status s =
          RequirePositive("model.seq_len", m.seq_len(), "the sequence length, e.g. 128");
      !s.ok()) {
    return s;
  }
  if (!OneOf(m.residual(), {"vanilla", "hc", "mhc", "xhc", "xhc_flash", "xhc_flash4"})) {
    return FieldError("model.residual", absl::StrCat("unknown mode '", m.residual(),
                                                     "'; choose vanilla, hc, mhc, xhc, "
                                                     "xhc_flash or xhc_flash4"));
  }
  if (absl::Status s = AtLeast("model.streams", m.streams(), 1, "0 = the mode's default");
      !s.ok()) {
    return s;
  }
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
    const int group = m.residual() == "xhc_flash" ? 2 : m.residual() == "xhc_flash4" ? 4 : 1;
    if ((2 * static_cast<int64_t>(m.blocks())) % group != 0) {
      return FieldError("model.blocks",
                        absl::StrCat(m.blocks(), " blocks give ", 2 * static_cast<int64_t>(m.blocks()),
                                     " sublayers, not a multiple of ", m.residual(),
                                     "'s group of ", group, "; use an even number of blocks or "
                                     "another residual mode"));
    }
  } else if (m.active() != 0 || m.fixed() != 0) {
    return FieldError(m.active() != 0 ? "model.active" : "model.fixed",
                      absl::StrCat("only xhc modes use active/fixed streams, not '", m.residual(),
                                   "'; remove the field"));
  }
  if (!(m.rope_theta() > 1) || !std::isfinite(m.rope_theta())) {
    return FieldError("model.rope_theta", absl::StrCat("is ", m.rope_theta(),
                                                       "; it must be a finite number > 1 "
                                                       "(10000 is usual)"));
  }
  if (!(m.init_std() > 0) || !(m.init_std() <= 1)) {
    return FieldError("model.init_std",
                      absl::StrCat("is ", m.init_std(),
                                   "; the initial weights' standard deviation must lie in (0, 1] "
                                   "(larger weights overflow float activations); 0.02 is usual"));
  }
  const rackrun::v1::MoeSpec& moe = m.moe();
  if (absl::Status s = RequirePositive("model.moe.experts", moe.experts(),
                                       "the number of routed experts, e.g. 16");
      !s.ok()) {
    return s;
  }
  if (moe.top_k() < 1 || moe.top_k() > moe.experts()) {
    return FieldError("model.moe.top_k", absl::StrCat("top_k ", moe.top_k(),
                                                      " must lie in [1, experts = ", moe.experts(),
                                                      "]; lower model.moe.top_k or add experts"));
  }
  if (moe.top_k() > kMaxTopK) {
    return FieldError("model.moe.top_k", absl::StrCat("top_k ", moe.top_k(), " exceeds ", kMaxTopK,
                                                      ", the most experts a token may use"));
  }
  if (moe.expert_hidden() < 0) {
    return FieldError("model.moe.expert_hidden",
                      absl::StrCat("is ", moe.expert_hidden(),
                                   "; it must be positive (0 = 2 x model.width)"));
  }
  if (moe.expert_hidden() == 0) {
    return FieldError("model.moe.expert_hidden",
                      "required: the default 2 x model.width does not fit an int32; set it");
  }
  if (moe.shared_hidden() < 0) {
    return FieldError("model.moe.shared_hidden",
                      absl::StrCat("is ", moe.shared_hidden(),
                                   "; it must be >= 0 (0 = model.moe.expert_hidden)"));
  }
  for (const auto& [path, value] : {std::pair<const char*, double>{"model.moe.aux_loss_coef",
                                                                    moe.aux_loss_coef()},
                                    {"model.moe.bias_update_rate", moe.bias_update_rate()}}) {
    if (absl::Status s = Finite(path, value); !s.ok()) return s;
    if (value < 0) return FieldError(path, absl::StrCat("is ", value, "; it must be >= 0 (0 = off)"));
  }

  const rackrun::v1::DataSpec& d = spec.data();
  if (d.train().empty()) {
    return FieldError("data.train", "required; point it at a token file made by `rackrun data`");
  }
  if (absl::Status s = AtLeast("data.batch_size", d.batch_size(), 1, "0 = the default 8");
      !s.ok()) {
    return s;
  }

  const rackrun::v1::TrainingSpec& t = spec.training();
  if (absl::Status s =
          RequirePositive("training.steps", t.steps(), "the optimizer steps, e.g. 300");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AtLeast("training.microbatches", t.microbatches(), 1, "0 = the default 1");
      !s.ok()) {
    return s;
  }
  for (const auto& [path, value] :
       {std::pair<const char*, double>{"training.lr", t.lr()}, {"training.min_lr", t.min_lr()},
        {"training.weight_decay", t.weight_decay()}, {"training.beta1", t.beta1()},
        {"training.beta2", t.beta2()}, {"training.adam_eps", t.adam_eps()},
        {"training.grad_clip", t.grad_clip()}}) {
    if (absl::Status s = Finite(path, value); !s.ok()) return s;
  }
  if (t.lr() <= 0) {
    return FieldError("training.lr",
                      absl::StrCat("is ", t.lr(), "; it must be positive (0 = the default 3e-3)"));
  }
  if (t.min_lr() < 0 || t.min_lr() > t.lr()) {
    return FieldError("training.min_lr", absl::StrCat("is ", t.min_lr(), "; it must lie in [0, lr = ",
                                                      t.lr(), "]"));
  }
  if (t.warmup_steps() < 0 || t.warmup_steps() > t.steps()) {
    return FieldError("training.warmup_steps", absl::StrCat("is ", t.warmup_steps(),
                                                            "; it must lie in [0, steps = ",
                                                            t.steps(), "]"));
  }
  if (!OneOf(t.schedule(), {"cosine", "constant"})) {
    return FieldError("training.schedule", absl::StrCat("unknown schedule '", t.schedule(),
                                                        "'; choose cosine or constant"));
  }
  if (t.weight_decay() < 0) {
    return FieldError("training.weight_decay",
                      absl::StrCat("is ", t.weight_decay(), "; it must be >= 0 (0 = off)"));
  }
  if (t.beta1() < 0 || t.beta1() >= 1) {
    return FieldError("training.beta1", absl::StrCat("is ", t.beta1(), "; it must lie in [0, 1)"));
  }
  if (t.beta2() < 0 || t.beta2() >= 1) {
    return FieldError("training.beta2", absl::StrCat("is ", t.beta2(), "; it must lie in [0, 1)"));
  }
  if (t.adam_eps() <= 0) {
    return FieldError("training.adam_eps",
                      absl::StrCat("is ", t.adam_eps(), "; it must be positive, e.g. 1e-8"));
  }
  if (t.grad_clip() < 0) {
    return FieldError("training.grad_clip",
                      absl::StrCat("is ", t.grad_clip(), "; it must be >= 0 (0 = off)"));
  }
  if (absl::Status s = AtLeast("training.eval_interval", t.eval_interval(), 0, "0 = never");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AtLeast("training.eval_batches", t.eval_batches(), 1, "0 = the default 8");
      !s.ok()) {
    return s;
  }

  const rackrun::v1::BalancerSpec& b = spec.balancer();
  if (!OneOf(b.policy(), {"none", "ultraep", "eplb"})) {
    return FieldError("balancer.policy", absl::StrCat("unknown policy '", b.policy(),
                                                      "'; choose none, ultraep or eplb"));
  }
  if (absl::Status s = AtLeast("balancer.slots", b.slots(), 0, ""); !s.ok()) return s;
  if (absl::Status s = Finite("balancer.eps", b.eps()); !s.ok()) return s;
  if (b.eps() <= 0) {
    return FieldError("balancer.eps", absl::StrCat("is ", b.eps(), "; it must be positive, e.g. 0.01"));
  }
  if (absl::Status s = AtLeast("balancer.min_replica_tokens", b.min_replica_tokens(), 1,
                               "0 = the default 1");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = AtLeast("balancer.eplb_window", b.eplb_window(), 1, "0 = the default 16");
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          AtLeast("balancer.eplb_interval", b.eplb_interval(), 1, "0 = the default 16");
      !s.ok()) {
    return s;
  }
  if (!OneOf(b.mode(), {"inband", "coordinator"})) {
    return FieldError("balancer.mode",
                      absl::StrCat("unknown mode '", b.mode(), "'; choose inband or coordinator"));
  }

  if (absl::Status s = AtLeast("checkpoint.interval", spec.checkpoint().interval(), 0,
                               "0 = only at the end");
      !s.ok()) {
    return s;
  }
  if (spec.checkpoint().keep() < 2) {
    return FieldError("checkpoint.keep",
                      absl::StrCat("is ", spec.checkpoint().keep(),
                                   "; it must be >= 2 so the previous good checkpoint survives; "
                                   "set 2 or more"));
  }
  if (absl::Status s = AtLeast("logging.interval", spec.logging().interval(), 1,
                               "0 = the default 10");
      !s.ok()) {
    return s;
  }
  const rackrun::v1::ResourceSpec& r = spec.resources();
  if (absl::Status s = AtLeast("resources.threads", r.threads(), 0, "0 = all cores"); !s.ok()) {
    return s;
  }
  if (r.threads() > kMaxThreads) {
    return FieldError("resources.threads",
                      absl::StrCat("is ", r.threads(), "; more than ", kMaxThreads,
                                   " threads per rank is beyond any machine: set at most the "
                                   "cores of one machine, or 0 for all of them"));
  }
  if (absl::Status s = AtLeast("resources.ranks", r.ranks(), 0, "0 = as launched"); !s.ok()) {
    return s;
  }
  if (!OneOf(r.channel(), {"gloo", "nccl"})) {
    return FieldError("resources.channel", absl::StrCat("unknown data channel '", r.channel(),
                                                        "'; choose gloo (CPU) or nccl (GPU)"));
  }
  const rackrun::v1::RestartSpec& restart = spec.restart();
  if (absl::Status s = AtLeast("restart.max_attempts", restart.max_attempts(), 1,
                               "1 = never restart; 0 = the default 1");
      !s.ok()) {
    return s;
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
  // Sizes no machine holds, or whose products overflow: refused here, on every path
  // (CLI, coordinator, worker), before anything is allocated.
  JobMemoryInputs inputs;
  inputs.ranks = std::max(1, r.ranks());
  inputs.threads = std::max(1, r.threads());
  absl::StatusOr<JobMemoryEstimate> memory = EstimateJobMemory(spec, inputs);
  if (!memory.ok()) return memory.status();
  if (memory->total > kMaxJobBytes) {
    const MemoryTerm& top = memory->terms.front();
    return FieldError(top.fields,
                      absl::StrCat("the job would need an estimated ", memory->Describe(),
                                   ", beyond any machine (", FormatBytes(kMaxJobBytes),
                                   "); largest: ", top.what, " ", FormatBytes(top.bytes), " (",
                                   top.fields, "). Lower those sizes"));
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

// ---------------------------------------------------------------- memory accounting

namespace rackrun::runtime {
namespace {

constexpr int64_t kFloat = 4;  // the trainer's parameters, gradients and activations
// Code, shared libraries, OpenMP and gRPC thread stacks, allocator slack: the resident
// size of `rackrun train` on a tiny model (about 20 MiB peak on x86-64 Linux, GNU time).
constexpr int64_t kProcessOverhead = 24ll << 20;

// Saturating arithmetic: a product that overflows is "more than any machine has".
int64_t Mul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (a < 0 || b < 0) return 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::numeric_limits<int64_t>::max();
  return out;
}
int64_t Mul(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) out = Mul(out, f);
  return out;
}
int64_t Add(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::numeric_limits<int64_t>::max();
  return out;
}

// Trainable floats of the residual mappings (residual_streams.h lists the tensors; the
// xhc MLP write-back uses ResidualConfig's default convolutions 4, 8, 12: J = 3).
int64_t ResidualParameterCount(const rackrun::v1::ModelSpec& m) {
  const int64_t n = m.streams(), c = m.width(), k = m.active(), sublayers = Mul(2, m.blocks());
  const std::string& mode = m.residual();
  if (mode == "vanilla") return 0;
  if (mode == "hc") return Mul(sublayers, Add(Mul(n + 2, c), 2 + 2 * n + n * n));
  if (mode == "mhc") {
    return Mul(sublayers, Add(Mul({2 * n + n * n, n, c}), 3 + 2 * n + n * n));
  }
  const int64_t g = mode == "xhc_flash" ? 2 : mode == "xhc_flash4" ? 4 : 1;
  constexpr int64_t kConvTaps = 4 + 8 + 12, kConvs = 3;
  int64_t total = Mul({sublayers / g, n, n, c});  // routers
  for (int64_t l = 0; l < std::min<int64_t>(sublayers, 4); ++l) {
    // Sublayers repeat with period lcm(2, g) <= 4: count the first ones, scale the rest.
    const bool mlp = l % 2 == 1;
    const bool last = l % g == g - 1;
    const int64_t kr = mlp ? 1 + kConvs : 1;
    int64_t one = Add(Mul({n, n, c}), 1 + n);
    if (last) one = Add(one, Add(Mul({k, k, k, c}), 1 + k * k));
    one = Add(one, Add(Mul({k, kr, k, c}), 1 + k * kr));
    if (mlp) one = Add(one, Mul(kConvTaps, c));
    const int64_t repeats = (sublayers - l + 3) / 4;  // sublayers l, l+4, l+8, ...
    total = Add(total, Mul(one, repeats));
  }
  return total;
}

// Floats of the residual streams' state and saved rows for one microbatch of `tokens`.
int64_t ResidualActivationFloats(const rackrun::v1::ModelSpec& m, int64_t tokens) {
  const int64_t n = m.streams(), c = m.width(), k = std::max(1, m.active()),
                sublayers = Mul(2, m.blocks());
  const std::string& mode = m.residual();
  int64_t total = Mul({2, tokens, n, c});  // state X and its gradient
  if (mode == "vanilla") return total;
  if (mode == "hc" || mode == "mhc") {
    // Per sublayer: the saved input state, body output and coefficient records.
    return Add(total, Mul({sublayers, tokens, Add(Mul(n, c), c + 2 * (2 * n + n * n))}));
  }
  const int64_t g = mode == "xhc_flash" ? 2 : mode == "xhc_flash4" ? 4 : 1;
  constexpr int64_t kConvs = 3;
  // Per sublayer: saved rows (k + K_r) x C and coefficients; per token: group records,
  // the group's base reads and the backward workspaces.
  const int64_t kr_mean2 = 1 + (1 + kConvs);  // attention K_r = 1, MLP K_r = 4, per pair
  int64_t rows = Mul({m.blocks(), Add(Mul(2 * k, c), Mul(kr_mean2, c))});
  rows = Add(rows, Mul(sublayers, 1 + 3 * k * k + 2 * k * (1 + kConvs)));
  int64_t per_token = Add(rows, Mul(sublayers / g, k + 3 * n));
  per_token = Add(per_token, Add(Mul(g - 1, c), Mul(kConvs, c)));
  per_token = Add(per_token, k + g * n + n + g * n + 2 * k * k + k * (1 + kConvs));
  return Add(total, Mul(tokens, per_token));
}

}  // namespace

std::string FormatBytes(int64_t bytes) {
  if (bytes == std::numeric_limits<int64_t>::max()) return "more than 8 EiB (sizes overflow)";
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (v >= 1024 && unit < 5) {
    v /= 1024;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f %s", v, kUnits[unit]);
  return text;
}

std::string JobMemoryEstimate::Describe() const {
  std::string s = absl::StrCat(FormatBytes(total), ranks > 1 ? " per rank" : "", " (parameters ",
                               FormatBytes(parameters), ", gradients ", FormatBytes(gradients),
                               ", AdamW state ", FormatBytes(optimizer), ", activations ",
                               FormatBytes(activations), ", batch ", FormatBytes(batch));
  if (expert_slots > 0) absl::StrAppend(&s, ", replica slots ", FormatBytes(expert_slots));
  if (data > 0) absl::StrAppend(&s, ", token files ", FormatBytes(data));
  absl::StrAppend(&s, ", process ", FormatBytes(overhead), ")");
  return s;
}

absl::StatusOr<JobMemoryEstimate> EstimateJobMemory(const JobSpec& spec,
                                                    const JobMemoryInputs& in) {
  const rackrun::v1::ModelSpec& m = spec.model();
  const rackrun::v1::MoeSpec& moe = m.moe();
  JobMemoryEstimate e;
  e.ranks = std::max(1, in.ranks);
  const int64_t ranks = e.ranks;
  const int64_t threads = std::max(1, in.threads);
  const int64_t vocab = m.vocab() > 0 ? m.vocab() : std::max<int64_t>(0, in.vocab);
  const int64_t c = std::max(0, m.width()), blocks = std::max(0, m.blocks()),
                heads = std::max(1, m.heads()), seq = std::max(0, m.seq_len()),
                experts = std::max(0, moe.experts()), k = std::max(0, moe.top_k()),
                hidden = std::max(0, moe.expert_hidden()),
                shared = moe.shared_expert() ? std::max(0, moe.shared_hidden()) : 0;
  const int64_t local_experts = (experts + ranks - 1) / ranks;
  const int64_t global_rows = std::max(1, spec.data().batch_size());
  const int64_t rows = (global_rows + ranks - 1) / ranks;
  const int64_t tokens = Mul(rows, seq);
  if (Mul(global_rows, seq) > std::numeric_limits<int32_t>::max()) {
    return FieldError("data.batch_size",
                      absl::StrCat(global_rows, " sequences x model.seq_len ", seq, " = ",
                                   Mul(global_rows, seq),
                                   " tokens per microbatch exceeds 2^31 - 1; lower "
                                   "data.batch_size or model.seq_len (raise "
                                   "training.microbatches to keep the step's tokens)"));
  }

  const auto term = [&](int64_t& component, std::string what, std::string fields,
                        int64_t bytes) {
    component = Add(component, bytes);
    e.terms.push_back({std::move(what), std::move(fields), bytes});
  };
  // Trainable parameters: value + gradient + AdamW m and v.
  const auto params = [&](std::string what, std::string fields, int64_t count) {
    e.parameter_count = Add(e.parameter_count, count);
    e.parameters = Add(e.parameters, Mul(count, kFloat));
    e.gradients = Add(e.gradients, Mul(count, kFloat));
    e.optimizer = Add(e.optimizer, Mul(count, 2 * kFloat));
    e.terms.push_back({absl::StrCat(what, " (weights, gradients, AdamW moments)"),
                       std::move(fields), Mul(count, 4 * kFloat)});
  };
  params("token embedding [vocab x width]", "model.vocab, model.width", Mul(vocab, c));
  params("LM head [width x vocab]", "model.vocab, model.width", Mul(c, vocab));
  params("attention weights [blocks x 4 width^2]", "model.width, model.blocks",
         Mul(blocks, Add(Mul(4 * c, c), c)));
  const int64_t expert_count = Mul({blocks, local_experts, 3, c, hidden});
  params(ranks > 1 ? "expert weights [blocks x experts/ranks x 3 width x expert_hidden]"
                   : "expert weights [blocks x experts x 3 width x expert_hidden]",
         "model.moe.experts, model.moe.expert_hidden, model.width, model.blocks", expert_count);
  params("routers and norms", "model.moe.experts, model.width, model.blocks",
         Add(Mul(blocks, Add(Mul(c, experts), c)), c));
  if (shared > 0) {
    params("shared experts", "model.moe.shared_hidden, model.width, model.blocks",
           Mul({blocks, 3, c, shared}));
  }
  params("residual mappings", "model.streams, model.active, model.width, model.blocks",
         ResidualParameterCount(m));
  e.parameters = Add(e.parameters, Mul({blocks, experts, kFloat}));  // router_bias buffers
  if (ranks > 1) {
    // The packed dense gradients of the all-reduce.
    e.optimizer = Add(e.optimizer, Mul(Add(e.parameter_count, -expert_count), kFloat));
  }

  // One microbatch of `tokens` on this rank.
  const int64_t tc = Mul(tokens, c);
  const std::string tok_fields = "data.batch_size, model.seq_len";
  term(e.activations, "LM-head logits [tokens x vocab]",
       absl::StrCat("model.vocab, ", tok_fields), Mul({tokens, vocab, kFloat}));
  term(e.activations, "attention probabilities [blocks x rows x heads x seq^2]",
       absl::StrCat("model.seq_len, model.heads, data.batch_size, model.blocks"),
       Mul(Add(Mul({blocks, rows, heads, seq, seq}), Mul({blocks, threads, seq, seq})), kFloat));
  term(e.activations, "sublayer inputs, outputs and attention state [blocks x 14 x tokens x width]",
       absl::StrCat("model.width, model.blocks, ", tok_fields),
       Mul(Add(Mul(14 * blocks + 8, tc), Mul(blocks, Add(Mul(seq, c / heads), 2 * tokens))),
           kFloat));
  const int64_t slots_rows = Mul(tokens, k);
  term(e.activations, "MoE dispatch buffers [blocks x 4 x tokens x top_k x width]",
       absl::StrCat("model.moe.top_k, model.width, model.blocks, ", tok_fields),
       Mul({blocks, ranks > 1 ? 8 : 4, slots_rows, c, kFloat}));
  term(e.activations, "expert hidden states [blocks x 6 x tokens x top_k x expert_hidden]",
       absl::StrCat("model.moe.expert_hidden, model.moe.top_k, model.blocks, ", tok_fields),
       Mul({blocks, 6, slots_rows, hidden, kFloat}));
  term(e.activations, "router scores and gates [blocks x tokens x (2 experts + 4 top_k)]",
       absl::StrCat("model.moe.experts, model.moe.top_k, model.blocks, ", tok_fields),
       Mul({blocks, tokens, Add(2 * experts, 4 * k + 2 * c), kFloat}));
  if (shared > 0) {
    term(e.activations, "shared-expert hidden states [blocks x 6 x tokens x shared_hidden]",
         absl::StrCat("model.moe.shared_hidden, model.blocks, ", tok_fields),
         Mul({blocks, tokens, Add(6 * shared, 2 * c), kFloat}));
  }
  term(e.activations, "residual streams [tokens x streams x width] and saved rows",
       absl::StrCat("model.streams, model.width, model.blocks, ", tok_fields),
       Mul(ResidualActivationFloats(m, tokens), kFloat));

  // Token ids: the global batch the loader fills and this rank's rows (inputs, targets,
  // segment starts).
  term(e.batch, "batch token ids", tok_fields,
       Mul({3, Add(Mul(global_rows, seq), ranks > 1 ? tokens : 0), 4}));
  if (ranks > 1 && spec.balancer().slots() > 0) {
    const int64_t slot = Mul({3, c, hidden});
    const int64_t floats = spec.balancer().shared_slots()
                               ? Mul({spec.balancer().slots(), slot, 3})
                               : Mul({blocks, spec.balancer().slots(), slot, 2});
    term(e.expert_slots, "replica slots [slots x 3 width x expert_hidden]",
         "balancer.slots, model.moe.expert_hidden, model.width", Mul(floats, kFloat));
  }
  if (in.train_tokens > 0 || in.validation_tokens > 0) {
    term(e.data, "token files (int32 in memory)", "data.train, data.validation",
         Add(Mul(in.train_tokens, 4), Mul(in.validation_tokens, 8)));
  }
  e.overhead = kProcessOverhead;
  for (int64_t part : {e.parameters, e.gradients, e.optimizer, e.activations, e.batch,
                       e.expert_slots, e.data, e.overhead}) {
    e.total = Add(e.total, part);
  }
  std::stable_sort(e.terms.begin(), e.terms.end(),
                   [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes > b.bytes; });
  return e;
}

int64_t MachineMemory::usable() const {
  int64_t usable = available > 0 ? available : total;
  if (cgroup_limit > 0) {
    const int64_t room = std::max<int64_t>(0, cgroup_limit - cgroup_usage);
    usable = usable > 0 ? std::min(usable, room) : room;
  }
  return usable;
}

std::string MachineMemory::Describe() const {
  std::string s = absl::StrCat(FormatBytes(usable()), " usable (MemAvailable ",
                               FormatBytes(available), " of MemTotal ", FormatBytes(total));
  if (cgroup_limit > 0) {
    absl::StrAppend(&s, "; cgroup limit ", FormatBytes(cgroup_limit), ", ",
                    FormatBytes(cgroup_usage), " in use");
  }
  return s + ")";
}

MachineMemory ParseMachineMemory(std::string_view meminfo, std::string_view cgroup_limit,
                                 std::string_view cgroup_usage) {
  MachineMemory mm;
  for (absl::string_view line : absl::StrSplit(absl::string_view(meminfo.data(), meminfo.size()),
                                               '\n')) {
    int64_t kib = 0;
    const auto value = [&](absl::string_view key) {
      if (!absl::ConsumePrefix(&line, key)) return false;
      line = absl::StripAsciiWhitespace(line);
      absl::ConsumeSuffix(&line, "kB");
      return absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &kib);
    };
    if (value("MemTotal:")) {
      mm.total = Mul(kib, 1024);
    } else if (value("MemAvailable:")) {
      mm.available = Mul(kib, 1024);
    }
  }
  int64_t bytes = 0;
  const absl::string_view limit =
      absl::StripAsciiWhitespace(absl::string_view(cgroup_limit.data(), cgroup_limit.size()));
  // cgroup v1 reports "no limit" as a huge page-rounded number: ignore limits above RAM.
  if (absl::SimpleAtoi(limit, &bytes) && bytes > 0 && (mm.total == 0 || bytes < mm.total)) {
    mm.cgroup_limit = bytes;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(
                             absl::string_view(cgroup_usage.data(), cgroup_usage.size())),
                         &bytes)) {
      mm.cgroup_usage = bytes;
    }
  }
  return mm;
}

MachineMemory ReadMachineMemory() {
  const auto read = [](const std::string& path) {
    absl::StatusOr<std::string> text = base::ReadWholeFile(path);
    return text.ok() ? *text : std::string();
  };
  // This process's cgroup: "0::/path" (v2) or "N:memory:/path" (v1).
  std::string v2_dir, v1_dir;
  for (absl::string_view line : absl::StrSplit(read("/proc/self/cgroup"), '\n')) {
    const std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3) continue;
    if (parts[0] == "0" && parts[1].empty()) v2_dir = std::string(parts[2]);
    if (absl::StrContains(parts[1], "memory")) v1_dir = std::string(parts[2]);
  }
  std::string limit, usage;
  for (const std::string& dir : {absl::StrCat("/sys/fs/cgroup", v2_dir), std::string("/sys/fs/cgroup")}) {
    limit = read(dir + "/memory.max");
    if (!limit.empty()) {
      usage = read(dir + "/memory.current");
      break;
    }
  }
  if (limit.empty()) {
    for (const std::string& dir :
         {absl::StrCat("/sys/fs/cgroup/memory", v1_dir), std::string("/sys/fs/cgroup/memory")}) {
      limit = read(dir + "/memory.limit_in_bytes");
      if (!limit.empty()) {
        usage = read(dir + "/memory.usage_in_bytes");
        break;
      }
    }
  }
  return ParseMachineMemory(read("/proc/meminfo"), limit, usage);
}

absl::Status CheckJobMemory(const JobMemoryEstimate& estimate, int ranks_here,
                            const MachineMemory& machine) {
  const int64_t usable = machine.usable();
  if (usable <= 0) return absl::OkStatus();
  const int64_t here = Mul(estimate.total, std::max(1, ranks_here));
  if (here <= usable) return absl::OkStatus();
  std::string largest;
  for (size_t i = 0; i < estimate.terms.size() && i < 3; ++i) {
    absl::StrAppend(&largest, i > 0 ? "; " : "", estimate.terms[i].what, " ",
                    FormatBytes(estimate.terms[i].bytes), " (", estimate.terms[i].fields, ")");
  }
  // The message starts with the fields that size the largest term.
  const std::string field = estimate.terms.empty() ? std::string("model") : estimate.terms[0].fields;
  return absl::ResourceExhaustedError(absl::StrCat(
      field, ": the job needs an estimated ", estimate.Describe(),
      ranks_here > 1 ? absl::StrCat(", x ", ranks_here, " ranks on this machine = ",
                                    FormatBytes(here))
                     : "",
      ", but this machine has ", machine.Describe(), ". Largest: ", largest,
      ". Lower those sizes",
      !estimate.terms.empty() && absl::StartsWith(estimate.terms[0].what, "expert weights")
          ? ", or spread the experts over more ranks on more machines (mpirun -np R)"
          : "",
      "."));
}

}  // namespace rackrun::runtime
