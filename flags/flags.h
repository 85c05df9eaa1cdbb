// Command-line flags for every rackrun executable: the daemons (rackrun-coordinator,
// rackrun-worker), the `rackrun` CLI and each of its subcommands, and the benchmarks.
//
// A program declares its flags on a FlagSet, bound to the variables they set, each with a
// help text; the set parses the arguments and writes the help from those declarations.
// Every program therefore has the same rules:
//   - `--flag=value` and `--flag value` (a flag with a value takes the next argument,
//     whatever it is); a switch takes no value; `--` ends the flags;
//   - `--help` / `-h` prints the generated help on stdout, exit 0;
//   - one format for a usage error, on stderr, exit 2 (a program may choose another code):
//         PROGRAM: SUBJECT: PROBLEM[; what to do]
//         run 'PROGRAM --help' for usage
//     SUBJECT names what is wrong: the flag ("--threads: 'x' is not an integer"), the
//     environment variable standing in for it, or the positional argument.
//
// Why our own small library on Abseil (strings, Status) rather than one of the two at hand:
//   - Abseil flags (ABSL_FLAG) registers every flag in one process-wide registry. The
//     `rackrun` binary holds nine subcommands whose flags share names with different
//     meanings and defaults (--json, --policy, --seed, --warmup, --coordinator), which one
//     global namespace cannot hold; its --help lists every flag linked into the binary,
//     and its usage errors exit 1 in its own wording.
//   - CLI11 (Debian libcli11-dev 2.1.2) has subcommands, but reports every problem as a
//     typed exception with its own wording ("The following argument was not expected",
//     "Could not convert"), and lays out help its own way; one error format and our help
//     layout would mean rewriting each exception type and a formatter, and exceptions
//     would cross code that otherwise speaks absl::Status. It would also be one more
//     package on every node that builds rackrun.
//   What we need (typed values with ranges, comma lists, repeatable flags, one required
//   positional argument, an environment fallback, help sections) is small, and it grew out
//   of the table-driven parser `rackrun plan` already had. A subcommand is one FlagSet;
//   shared groups of flags (the CLI's connection flags) are functions that declare them on
//   a set.
//
// Not thread-safe; a FlagSet is built, parsed and read on one thread. The bound variables
// must outlive Parse.
#ifndef RACKRUN_FLAGS_FLAGS_H_
#define RACKRUN_FLAGS_FLAGS_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rackrun::flags {

// Value parsers with the library's wording, for Custom flags: the error's message is the
// PROBLEM part ("'x' is not an integer", "7 is out of range; use 1..4").
absl::StatusOr<int64_t> ParseInt(std::string_view text, int64_t lo = INT64_MIN,
                                 int64_t hi = INT64_MAX);
absl::StatusOr<uint64_t> ParseUint(std::string_view text);
absl::StatusOr<double> ParseDouble(std::string_view text,
                                   double lo = -std::numeric_limits<double>::infinity(),
                                   double hi = std::numeric_limits<double>::infinity());

// Prints a usage error in the one format (see the top of this file) on stderr and returns
// `exit_code`. `message` is "SUBJECT: PROBLEM".
int PrintUsageError(std::string_view program, std::string_view message, int exit_code = 2);

// One declared flag; FlagSet's declaring calls return it for the modifiers below.
class Flag {
 public:
  // Numbers (and each element of a number list) must lie in [lo, hi]; otherwise
  // "V is out of range; use LO..HI" ("use LO or more" when hi is infinity).
  Flag& Range(double lo, double hi = std::numeric_limits<double>::infinity());
  // The default shown in the help ("(default TEXT)"), instead of the bound variable's
  // value at declaration; an empty text shows none.
  Flag& Default(std::string text);
  // When the flag is not given, the value of environment variable `name` (when set and not
  // empty) is parsed as if it had been; errors then name the variable.
  Flag& Env(std::string name);
  // Left out of the help (flags for tests).
  Flag& Hidden();

  const std::string& name() const { return name_; }

 private:
  friend class FlagSet;
  using Setter = std::function<absl::Status(const Flag&, std::string_view value)>;

  // The problem when `v` is outside Range; OK when inside or when there is no range.
  absl::Status CheckRange(double v, std::string_view text) const;

  std::string name_;
  std::string placeholder_;  // empty: a switch
  std::string help_;
  std::string default_text_;
  std::string env_;
  bool hidden_ = false;
  bool has_range_ = false;
  double lo_ = 0, hi_ = 0;
  bool integer_ = false;  // ranges print as integers
  int section_ = 0;
  Setter set_;
};

class FlagSet {
 public:
  // `program` as errors and the help name it ("rackrun-worker", "rackrun submit");
  // `synopsis` follows it on the help's usage line ("SPEC [options]").
  FlagSet(std::string program, std::string synopsis);
  FlagSet(const FlagSet&) = delete;
  FlagSet& operator=(const FlagSet&) = delete;

  // Text printed verbatim after the usage line / after the flags (hand-wrapped prose).
  void Describe(std::string text) { description_ = std::move(text); }
  void Epilogue(std::string text) { epilogue_ = std::move(text); }
  // Flags declared from now on are listed under `title` ("generator options"); `note`
  // (verbatim) follows the section's flags. The first section is "options". Returns the
  // section's index for GivenIn.
  int Section(std::string title, std::string note = "");

  // A switch: sets *out to true (or runs `on`) when given; takes no value.
  Flag& Switch(std::string name, bool* out, std::string help);
  Flag& Switch(std::string name, std::string help, std::function<void()> on);
  // Text values. `placeholder` names the value in the help ("FILE", "HOST:PORT").
  Flag& String(std::string name, std::string* out, std::string placeholder, std::string help);
  Flag& String(std::string name, std::optional<std::string>* out, std::string placeholder,
               std::string help);
  // Repeatable: every occurrence appends its value.
  Flag& Strings(std::string name, std::vector<std::string>* out, std::string placeholder,
                std::string help);
  // Integers ("'x' is not an integer"); T is int, int64_t, uint64_t or a std::optional of
  // int / int64_t. The type's bounds are always checked.
  template <typename T>
  Flag& Int(std::string name, T* out, std::string placeholder, std::string help);
  // Real numbers ("'x' is not a number"); finite only.
  Flag& Double(std::string name, double* out, std::string placeholder, std::string help);
  // Comma-separated lists; the last occurrence replaces the whole list.
  Flag& List(std::string name, std::vector<std::string>* out, std::string placeholder,
             std::string help);
  Flag& List(std::string name, std::vector<int>* out, std::string placeholder, std::string help);
  // Anything else: `parse` gets the value and returns the PROBLEM on failure (the set
  // puts the flag's name in front).
  Flag& Custom(std::string name, std::string placeholder, std::string help,
               std::function<absl::Status(std::string_view value)> parse);

  // The one positional argument (SPEC, JOB): required, at most one, anywhere among the
  // flags. Without it, an argument that is not a flag is an error.
  void Positional(std::string name, std::string* out, std::string help);

  // Parses `args` (without the program's name). OK, or InvalidArgument with the message
  // "SUBJECT: PROBLEM". --help / -h sets help_requested() and stops (later arguments are
  // not looked at); a required positional is not asked for then.
  absl::Status Parse(const std::vector<std::string>& args);

  // For main() and subcommands: Parse, then on --help print Help() on stdout and return
  // 0; on a usage error print it (PrintUsageError) and return `usage_exit`; nullopt when
  // the program goes on.
  std::optional<int> ParseCommandLine(const std::vector<std::string>& args, int usage_exit = 2);
  std::optional<int> ParseCommandLine(int argc, char** argv, int usage_exit = 2);

  // A usage error found after parsing (two flags that contradict each other), in the one
  // format; returns `exit_code`.
  int Fail(std::string_view subject, std::string_view problem, int exit_code = 2) const;
  int Fail(const absl::Status& status, int exit_code = 2) const;

  bool help_requested() const { return help_requested_; }
  // Whether the flag was given on the command line (or by its environment variable).
  bool Given(std::string_view name) const;
  // The flags of section `section` that were given, by name.
  std::vector<std::string> GivenIn(int section) const;

  // The help text: usage line, description, every section's flags with their help and
  // default, epilogue.
  std::string Help() const;
  const std::string& program() const { return program_; }

 private:
  Flag& Add(std::string name, std::string placeholder, std::string help, std::string default_text,
            Flag::Setter set);
  Flag* Find(std::string_view name);
  absl::Status Set(Flag& flag, std::string_view value, std::string_view subject);
  std::string Suggest(std::string_view name) const;

  struct SectionInfo {
    std::string title, note;
  };

  std::string program_, synopsis_, description_, epilogue_;
  std::vector<SectionInfo> sections_;
  std::vector<std::unique_ptr<Flag>> flags_;
  std::vector<std::string> given_;
  std::string positional_name_, positional_help_;
  std::string* positional_ = nullptr;
  bool help_requested_ = false;
};

// ---- implementation of the template ----

namespace internal {
template <typename T>
struct IntTraits {
  using Value = T;
};
template <typename T>
struct IntTraits<std::optional<T>> {
  using Value = T;
};
std::string DefaultOf(int64_t v);
std::string DefaultOf(uint64_t v);
template <typename T>
std::string DefaultOf(const std::optional<T>& v) {
  return v ? DefaultOf(static_cast<int64_t>(*v)) : "";
}
}  // namespace internal

template <typename T>
Flag& FlagSet::Int(std::string name, T* out, std::string placeholder, std::string help) {
  using V = typename internal::IntTraits<T>::Value;
  static_assert(std::is_integral_v<V>, "Int binds integers");
  std::string default_text;
  if constexpr (std::is_same_v<T, V>) {
    if constexpr (std::is_unsigned_v<V>) {
      default_text = internal::DefaultOf(static_cast<uint64_t>(*out));
    } else {
      default_text = internal::DefaultOf(static_cast<int64_t>(*out));
    }
  } else {
    default_text = internal::DefaultOf(*out);
  }
  Flag& flag = Add(std::move(name), std::move(placeholder), std::move(help),
                   std::move(default_text), [out](const Flag& f, std::string_view value) {
                     if constexpr (std::is_same_v<V, uint64_t>) {
                       absl::StatusOr<uint64_t> v = ParseUint(value);
                       if (!v.ok()) return v.status();
                       if (absl::Status s = f.CheckRange(static_cast<double>(*v), value); !s.ok()) {
                         return s;
                       }
                       *out = *v;
                     } else {
                       absl::StatusOr<int64_t> v = ParseInt(value, std::numeric_limits<V>::min(),
                                                            std::numeric_limits<V>::max());
                       if (!v.ok()) return v.status();
                       if (absl::Status s = f.CheckRange(static_cast<double>(*v), value); !s.ok()) {
                         return s;
                       }
                       *out = static_cast<V>(*v);
                     }
                     return absl::OkStatus();
                   });
  flag.integer_ = true;
  return flag;
}

}  // namespace rackrun::flags

#endif  // RACKRUN_FLAGS_FLAGS_H_
