#include "flags/flags.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/edit_distance.h"
#include "base/string_view.h"

namespace rackrun::flags {
namespace {

// Help lines are wrapped to this width; the flag column is at most kNameColumn wide (a
// longer flag puts its help on the next line).
constexpr size_t kWidth = 96;
constexpr size_t kNameColumn = 28;

using base::AsAbsl;
using base::AsStd;

absl::Status Problem(std::string_view text) {
  return absl::InvalidArgumentError(std::string(text));
}

// `text` wrapped at kWidth, every line after the first indented by `indent` spaces; the
// first line starts `first_used` columns in. A newline in `text` starts a new line.
std::string Wrap(std::string_view text, size_t indent, size_t first_used) {
  std::string out;
  size_t column = first_used;
  bool first_paragraph = true;
  for (absl::string_view paragraph : absl::StrSplit(AsAbsl(text), '\n')) {
    if (!first_paragraph) {
      absl::StrAppend(&out, "\n", std::string(indent, ' '));
      column = indent;
    }
    first_paragraph = false;
    bool line_empty = true;
    for (absl::string_view word : absl::StrSplit(paragraph, ' ', absl::SkipEmpty())) {
      if (!line_empty && column + 1 + word.size() > kWidth) {
        absl::StrAppend(&out, "\n", std::string(indent, ' '));
        column = indent;
        line_empty = true;
      }
      if (!line_empty) {
        out += ' ';
        ++column;
      }
      absl::StrAppend(&out, word);
      column += word.size();
      line_empty = false;
    }
  }
  return out;
}

bool IsHelp(std::string_view arg) { return arg == "--help" || arg == "-h"; }

// A flag is any argument that starts with '-' and is not "-" alone.
bool LooksLikeFlag(std::string_view arg) { return arg.size() > 1 && arg[0] == '-'; }

}  // namespace

absl::StatusOr<int64_t> ParseInt(std::string_view text, int64_t lo, int64_t hi) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(AsAbsl(text), &v)) {
    return Problem(absl::StrCat("'", AsAbsl(text), "' is not an integer"));
  }
  if (v < lo || v > hi) {
    return Problem(hi == INT64_MAX ? absl::StrCat(v, " is out of range; use ", lo, " or more")
                                   : absl::StrCat(v, " is out of range; use ", lo, "..", hi));
  }
  return v;
}

absl::StatusOr<uint64_t> ParseUint(std::string_view text) {
  uint64_t v = 0;
  // SimpleAtoi into an unsigned type accepts "-1" as a huge number on some versions: refuse
  // a sign explicitly.
  if (absl::StartsWith(absl::StripLeadingAsciiWhitespace(AsAbsl(text)), "-") ||
      !absl::SimpleAtoi(AsAbsl(text), &v)) {
    return Problem(absl::StrCat("'", AsAbsl(text), "' is not a non-negative integer"));
  }
  return v;
}

absl::StatusOr<double> ParseDouble(std::string_view text, double lo, double hi) {
  double v = 0;
  if (!absl::SimpleAtod(AsAbsl(text), &v) || !std::isfinite(v)) {
    return Problem(absl::StrCat("'", AsAbsl(text), "' is not a number"));
  }
  if (v < lo || v > hi) {
    return Problem(std::isinf(hi)
                       ? absl::StrCat(AsAbsl(text), " is out of range; use ", lo, " or more")
                       : absl::StrCat(AsAbsl(text), " is out of range; use ", lo, "..", hi));
  }
  return v;
}

int PrintUsageError(std::string_view program, std::string_view message, int exit_code) {
  std::fprintf(stderr, "%.*s: %.*s\nrun '%.*s --help' for usage\n",
               static_cast<int>(program.size()), program.data(), static_cast<int>(message.size()),
               message.data(), static_cast<int>(program.size()), program.data());
  return exit_code;
}

namespace internal {
std::string DefaultOf(int64_t v) { return absl::StrCat(v); }
std::string DefaultOf(uint64_t v) { return absl::StrCat(v); }
}  // namespace internal

// ---- Flag ----

Flag& Flag::Range(double lo, double hi) {
  has_range_ = true;
  lo_ = lo;
  hi_ = hi;
  return *this;
}

Flag& Flag::Default(std::string text) {
  default_text_ = std::move(text);
  return *this;
}

Flag& Flag::Env(std::string name) {
  env_ = std::move(name);
  return *this;
}

Flag& Flag::Hidden() {
  hidden_ = true;
  return *this;
}

absl::Status Flag::CheckRange(double v, std::string_view text) const {
  if (!has_range_ || (v >= lo_ && v <= hi_)) return absl::OkStatus();
  std::string value(text);
  std::string lo = absl::StrCat(lo_), hi = absl::StrCat(hi_);
  if (integer_) {
    value = absl::StrCat(static_cast<int64_t>(v));
    lo = absl::StrCat(static_cast<int64_t>(lo_));
    if (!std::isinf(hi_)) hi = absl::StrCat(static_cast<int64_t>(hi_));
  }
  return Problem(std::isinf(hi_) ? absl::StrCat(value, " is out of range; use ", lo, " or more")
                                 : absl::StrCat(value, " is out of range; use ", lo, "..", hi));
}

// ---- FlagSet ----

FlagSet::FlagSet(std::string program, std::string synopsis)
    : program_(std::move(program)), synopsis_(std::move(synopsis)) {
  sections_.push_back({"options", ""});
}

int FlagSet::Section(std::string title, std::string note) {
  sections_.push_back({std::move(title), std::move(note)});
  return static_cast<int>(sections_.size()) - 1;
}

Flag& FlagSet::Add(std::string name, std::string placeholder, std::string help,
                   std::string default_text, Flag::Setter set) {
  auto flag = std::make_unique<Flag>();
  flag->name_ = std::move(name);
  flag->placeholder_ = std::move(placeholder);
  flag->help_ = std::move(help);
  flag->default_text_ = std::move(default_text);
  flag->section_ = static_cast<int>(sections_.size()) - 1;
  flag->set_ = std::move(set);
  flags_.push_back(std::move(flag));
  return *flags_.back();
}

Flag& FlagSet::Switch(std::string name, bool* out, std::string help) {
  return Switch(std::move(name), std::move(help), [out] { *out = true; });
}

Flag& FlagSet::Switch(std::string name, std::string help, std::function<void()> on) {
  return Add(std::move(name), "", std::move(help), "",
             [on = std::move(on)](const Flag&, std::string_view) {
               on();
               return absl::OkStatus();
             });
}

Flag& FlagSet::String(std::string name, std::string* out, std::string placeholder,
                      std::string help) {
  return Add(std::move(name), std::move(placeholder), std::move(help), *out,
             [out](const Flag&, std::string_view value) {
               *out = std::string(value);
               return absl::OkStatus();
             });
}

Flag& FlagSet::String(std::string name, std::optional<std::string>* out, std::string placeholder,
                      std::string help) {
  return Add(std::move(name), std::move(placeholder), std::move(help), out->value_or(""),
             [out](const Flag&, std::string_view value) {
               *out = std::string(value);
               return absl::OkStatus();
             });
}

Flag& FlagSet::Strings(std::string name, std::vector<std::string>* out, std::string placeholder,
                       std::string help) {
  return Add(std::move(name), std::move(placeholder), std::move(help), "",
             [out](const Flag&, std::string_view value) {
               out->emplace_back(value);
               return absl::OkStatus();
             });
}

Flag& FlagSet::Double(std::string name, double* out, std::string placeholder, std::string help) {
  return Add(std::move(name), std::move(placeholder), std::move(help), absl::StrCat(*out),
             [out](const Flag& f, std::string_view value) {
               absl::StatusOr<double> v = ParseDouble(value);
               if (!v.ok()) return v.status();
               if (absl::Status s = f.CheckRange(*v, value); !s.ok()) return s;
               *out = *v;
               return absl::OkStatus();
             });
}

Flag& FlagSet::List(std::string name, std::vector<std::string>* out, std::string placeholder,
                    std::string help) {
  return Add(std::move(name), std::move(placeholder), std::move(help), absl::StrJoin(*out, ","),
             [out](const Flag&, std::string_view value) {
               std::vector<std::string> items =
                   absl::StrSplit(AsAbsl(value), ',', absl::SkipEmpty());
               if (items.empty()) return Problem("give a comma-separated list");
               *out = std::move(items);
               return absl::OkStatus();
             });
}

Flag& FlagSet::List(std::string name, std::vector<int>* out, std::string placeholder,
                    std::string help) {
  Flag& flag =
      Add(std::move(name), std::move(placeholder), std::move(help), absl::StrJoin(*out, ","),
          [out](const Flag& f, std::string_view value) {
            std::vector<int> items;
            for (absl::string_view item : absl::StrSplit(AsAbsl(value), ',', absl::SkipEmpty())) {
              absl::StatusOr<int64_t> v = ParseInt(AsStd(item), INT32_MIN, INT32_MAX);
              if (!v.ok()) return v.status();
              if (absl::Status s = f.CheckRange(static_cast<double>(*v), AsStd(item)); !s.ok()) {
                return s;
              }
              items.push_back(static_cast<int>(*v));
            }
            if (items.empty()) return Problem("give a comma-separated list of integers");
            *out = std::move(items);
            return absl::OkStatus();
          });
  flag.integer_ = true;
  return flag;
}

Flag& FlagSet::Custom(std::string name, std::string placeholder, std::string help,
                      std::function<absl::Status(std::string_view value)> parse) {
  return Add(
      std::move(name), std::move(placeholder), std::move(help), "",
      [parse = std::move(parse)](const Flag&, std::string_view value) { return parse(value); });
}

void FlagSet::Positional(std::string name, std::string* out, std::string help) {
  positional_name_ = std::move(name);
  positional_help_ = std::move(help);
  positional_ = out;
}

Flag* FlagSet::Find(std::string_view name) {
  for (const auto& f : flags_) {
    if (f->name_ == name) return f.get();
  }
  return nullptr;
}

absl::Status FlagSet::Set(Flag& flag, std::string_view value, std::string_view subject) {
  absl::Status s = flag.set_(flag, value);
  if (!s.ok()) return Problem(absl::StrCat(AsAbsl(subject), ": ", s.message()));
  if (!Given(flag.name_)) given_.push_back(flag.name_);
  return absl::OkStatus();
}

std::string FlagSet::Suggest(std::string_view name) const {
  std::string best;
  size_t best_distance = 3;  // suggest only a near miss
  for (const auto& f : flags_) {
    if (f->hidden_) continue;
    const size_t d = base::EditDistance(name, f->name_);
    if (d < best_distance) {
      best_distance = d;
      best = f->name_;
    }
  }
  return best;
}

absl::Status FlagSet::Parse(const std::vector<std::string>& args) {
  help_requested_ = false;
  bool positional_seen = false;
  bool flags_ended = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (!flags_ended && arg == "--") {
      flags_ended = true;
      continue;
    }
    if (flags_ended || !LooksLikeFlag(arg)) {
      if (positional_ == nullptr) {
        return Problem(absl::StrCat("'", arg, "': unexpected argument; flags start with --"));
      }
      if (positional_seen) {
        return Problem(absl::StrCat("'", arg, "': unexpected argument; give one ", positional_name_,
                                    " (", *positional_, " is one)"));
      }
      *positional_ = arg;
      positional_seen = true;
      continue;
    }
    if (IsHelp(arg)) {
      help_requested_ = true;
      return absl::OkStatus();
    }
    std::string name = arg;
    std::optional<std::string> inline_value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      inline_value = arg.substr(eq + 1);
    }
    Flag* flag = Find(name);
    if (flag == nullptr) {
      const std::string near = Suggest(name);
      return Problem(absl::StrCat(name, ": unknown option",
                                  near.empty() ? "" : absl::StrCat("; did you mean ", near, "?")));
    }
    std::string value;
    if (flag->placeholder_.empty()) {
      if (inline_value) return Problem(absl::StrCat(name, ": takes no value"));
    } else if (inline_value) {
      value = *inline_value;
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      return Problem(absl::StrCat(name, ": needs a value (", name, " ", flag->placeholder_, ")"));
    }
    if (absl::Status s = Set(*flag, value, name); !s.ok()) return s;
  }
  // Environment fallbacks for the flags not given.
  for (const auto& f : flags_) {
    if (f->env_.empty() || Given(f->name_)) continue;
    const char* v = std::getenv(f->env_.c_str());
    if (v == nullptr || *v == '\0') continue;
    if (absl::Status s = Set(*f, v, absl::StrCat(f->env_, "='", v, "' (for ", f->name_, ")"));
        !s.ok()) {
      return s;
    }
  }
  if (positional_ != nullptr && !positional_seen) {
    return Problem(absl::StrCat(positional_name_, ": missing; give ", positional_help_));
  }
  return absl::OkStatus();
}

std::optional<int> FlagSet::ParseCommandLine(const std::vector<std::string>& args, int usage_exit) {
  const absl::Status s = Parse(args);
  if (help_requested_) {
    const std::string help = Help();
    std::fwrite(help.data(), 1, help.size(), stdout);
    return 0;
  }
  if (!s.ok()) return Fail(s, usage_exit);
  return std::nullopt;
}

std::optional<int> FlagSet::ParseCommandLine(int argc, char** argv, int usage_exit) {
  return ParseCommandLine(std::vector<std::string>(argv + std::min(argc, 1), argv + argc),
                          usage_exit);
}

int FlagSet::Fail(std::string_view subject, std::string_view problem, int exit_code) const {
  return PrintUsageError(program_, absl::StrCat(AsAbsl(subject), ": ", AsAbsl(problem)), exit_code);
}

int FlagSet::Fail(const absl::Status& status, int exit_code) const {
  return PrintUsageError(program_, AsStd(status.message()), exit_code);
}

bool FlagSet::Given(std::string_view name) const {
  return std::find(given_.begin(), given_.end(), name) != given_.end();
}

std::vector<std::string> FlagSet::GivenIn(int section) const {
  std::vector<std::string> out;
  for (const auto& f : flags_) {
    if (f->section_ == section && Given(f->name_)) out.push_back(f->name_);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string FlagSet::Help() const {
  std::string out =
      absl::StrCat("usage: ", program_, synopsis_.empty() ? "" : " ", synopsis_, "\n");
  if (!description_.empty()) absl::StrAppend(&out, "\n", description_);
  if (!out.empty() && out.back() != '\n') out += '\n';

  struct Row {
    std::string left, right;
  };
  const auto row_of = [](const Flag& f) {
    Row r;
    r.left = f.placeholder_.empty() ? f.name_ : absl::StrCat(f.name_, " ", f.placeholder_);
    r.right = f.help_;
    if (!f.env_.empty()) {
      absl::StrAppend(&r.right, " (default $", f.env_,
                      f.default_text_.empty() ? "" : absl::StrCat(", else ", f.default_text_), ")");
    } else if (!f.default_text_.empty()) {
      absl::StrAppend(&r.right, " (default ", f.default_text_, ")");
    }
    return r;
  };
  std::vector<std::vector<Row>> rows(sections_.size());
  if (positional_ != nullptr) rows[0].push_back({positional_name_, positional_help_});
  for (const auto& f : flags_) {
    if (!f->hidden_) rows[static_cast<size_t>(f->section_)].push_back(row_of(*f));
  }
  // Under the first section, or the last when every flag has a section of its own.
  const size_t help_section = rows[0].empty() ? rows.size() - 1 : 0;
  rows[help_section].push_back({"-h, --help", "print this help and exit"});
  size_t column = 0;
  for (const auto& section : rows) {
    for (const Row& r : section) {
      if (r.left.size() + 4 <= kNameColumn) column = std::max(column, r.left.size() + 4);
    }
  }
  for (size_t s = 0; s < sections_.size(); ++s) {
    if (rows[s].empty() && sections_[s].note.empty()) continue;
    absl::StrAppend(&out, "\n", sections_[s].title, ":\n");
    for (const Row& r : rows[s]) {
      std::string line = absl::StrCat("  ", r.left);
      if (line.size() + 2 > column) {
        absl::StrAppend(&out, line, "\n");
        line.clear();
      }
      line.resize(column, ' ');
      absl::StrAppend(&out, line, Wrap(r.right, column, column), "\n");
    }
    absl::StrAppend(&out, sections_[s].note);
  }
  if (!epilogue_.empty()) absl::StrAppend(&out, "\n", epilogue_);
  if (out.back() != '\n') out += '\n';
  return out;
}

}  // namespace rackrun::flags
