#include "flags/flags.h"

#include <stdlib.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace rackrun::flags {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

absl::string_view ParseTestText(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

// A set with one flag of every kind, bound to `Values`.
struct Values {
  std::string listen = "127.0.0.1:7070";
  std::optional<std::string> trace;
  bool json = false;
  bool live = true;
  int threads = 0;
  int64_t timeout_ms = 1000;
  uint64_t seed = 1;
  std::optional<int> masters;
  double eps = 0.01;
  std::vector<std::string> sets;
  std::vector<std::string> policies = {"ultraep", "none"};
  std::vector<int> ranks = {2, 4};
  std::string mode = "exposed";
  std::string spec;
};

class FlagSetTest : public ::testing::Test {
 protected:
  explicit FlagSetTest(bool positional = false) : set_("prog sub", "[options]") {
    set_.Describe("Does things.\n");
    set_.String("--listen", &v_.listen, "HOST:PORT", "address to serve on");
    set_.String("--trace", &v_.trace, "FILE", "a trace");
    set_.Switch("--json", &v_.json, "print JSON");
    set_.Switch("--plain", "plain lines", [this] { v_.live = false; });
    set_.Int("--threads", &v_.threads, "N", "compute threads").Default("the spec's");
    set_.Int("--timeout-ms", &v_.timeout_ms, "MS", "how long").Range(1);
    set_.Int("--seed", &v_.seed, "S", "the seed");
    set_.Int("--masters", &v_.masters, "N", "masters per rank").Range(1, 64);
    generator_ = set_.Section("generator options", "  (only with --generate)\n");
    set_.Double("--eps", &v_.eps, "X", "precision").Range(1e-9, 1);
    set_.Strings("--set", &v_.sets, "FIELD=VALUE", "override a field (repeatable)");
    set_.List("--policy", &v_.policies, "LIST", "policies");
    set_.List("--ranks", &v_.ranks, "LIST", "rank counts").Range(1, 1024);
    set_.Custom("--mode", "MODE", "exposed | hidden", [this](std::string_view value) {
      if (value != "exposed" && value != "hidden") {
        return absl::InvalidArgumentError(
            absl::StrCat("'", ParseTestText(value), "' is not a mode"));
      }
      v_.mode = std::string(value);
      return absl::OkStatus();
    });
    set_.Int("--serving-delay-ms", &v_.timeout_ms, "MS", "tests only").Hidden();
    if (positional) set_.Positional("SPEC", &v_.spec, "the job spec file");
  }

  // The message of a failed Parse ("" when it succeeded).
  std::string Error(const std::vector<std::string>& args) {
    const absl::Status s = set_.Parse(args);
    return s.ok() ? "" : std::string(s.message());
  }

  Values v_;
  FlagSet set_;
  int generator_ = 0;
};

class PositionalTest : public FlagSetTest {
 protected:
  PositionalTest() : FlagSetTest(/*positional=*/true) {}
};

TEST_F(FlagSetTest, BothValueFormsAndSwitches) {
  ASSERT_EQ(Error({"--listen=0.0.0.0:1", "--threads", "4", "--json", "--plain", "--eps=0.5",
                   "--seed", "18446744073709551615", "--masters=3", "--trace", "t.jsonl"}),
            "");
  EXPECT_EQ(v_.listen, "0.0.0.0:1");
  EXPECT_EQ(v_.threads, 4);
  EXPECT_TRUE(v_.json);
  EXPECT_FALSE(v_.live);
  EXPECT_DOUBLE_EQ(v_.eps, 0.5);
  EXPECT_EQ(v_.seed, UINT64_MAX);
  EXPECT_EQ(v_.masters, 3);
  EXPECT_EQ(v_.trace, "t.jsonl");
  EXPECT_TRUE(set_.Given("--threads"));
  EXPECT_FALSE(set_.Given("--timeout-ms"));
  EXPECT_FALSE(set_.help_requested());
}

TEST_F(FlagSetTest, ValueIsTheNextArgumentWhateverItIs) {
  // A negative number and an empty value are values, not flags.
  ASSERT_EQ(Error({"--threads", "-3", "--listen", ""}), "");
  EXPECT_EQ(v_.threads, -3);
  EXPECT_EQ(v_.listen, "");
  ASSERT_EQ(Error({"--listen=", "--set", "a=b=c", "--set=d=e"}), "");
  EXPECT_EQ(v_.sets, (std::vector<std::string>{"a=b=c", "d=e"}));
}

TEST_F(FlagSetTest, ListsReplaceRepeatedFlagsAppend) {
  ASSERT_EQ(Error({"--policy", "eplb", "--policy", "none,ideal", "--ranks=8,16"}), "");
  EXPECT_EQ(v_.policies, (std::vector<std::string>{"none", "ideal"}));
  EXPECT_EQ(v_.ranks, (std::vector<int>{8, 16}));
  EXPECT_THAT(Error({"--ranks", "8,x"}), HasSubstr("--ranks: 'x' is not an integer"));
  EXPECT_EQ(Error({"--ranks", "8,0"}), "--ranks: 0 is out of range; use 1..1024");
}

TEST_F(FlagSetTest, EveryErrorNamesTheFlag) {
  EXPECT_EQ(Error({"--bogus", "3"}), "--bogus: unknown option");
  EXPECT_EQ(Error({"--thread", "3"}), "--thread: unknown option; did you mean --threads?");
  EXPECT_EQ(Error({"--bogus=3"}), "--bogus: unknown option");
  EXPECT_EQ(Error({"--json", "--threads"}), "--threads: needs a value (--threads N)");
  EXPECT_EQ(Error({"--threads", "many"}), "--threads: 'many' is not an integer");
  EXPECT_EQ(Error({"--threads", "1.5"}), "--threads: '1.5' is not an integer");
  EXPECT_EQ(Error({"--threads", "99999999999"}),
            "--threads: 99999999999 is out of range; use -2147483648..2147483647");
  EXPECT_EQ(Error({"--timeout-ms", "0"}), "--timeout-ms: 0 is out of range; use 1 or more");
  EXPECT_EQ(Error({"--masters", "65"}), "--masters: 65 is out of range; use 1..64");
  EXPECT_EQ(Error({"--seed", "-1"}), "--seed: '-1' is not a non-negative integer");
  EXPECT_EQ(Error({"--eps", "nan"}), "--eps: 'nan' is not a number");
  EXPECT_EQ(Error({"--eps", "2"}), "--eps: 2 is out of range; use 1e-09..1");
  EXPECT_EQ(Error({"--json=yes"}), "--json: takes no value");
  EXPECT_EQ(Error({"--mode", "sometimes"}), "--mode: 'sometimes' is not a mode");
  EXPECT_EQ(Error({"stray"}), "'stray': unexpected argument; flags start with --");
  EXPECT_EQ(Error({"-x"}), "-x: unknown option");
}

TEST_F(FlagSetTest, HelpStopsParsingAndLaterArgumentsAreNotLookedAt) {
  EXPECT_EQ(Error({"--json", "--help", "--bogus"}), "");
  EXPECT_TRUE(set_.help_requested());
  EXPECT_EQ(Error({"-h"}), "");
  EXPECT_TRUE(set_.help_requested());
  // An error before --help is reported.
  EXPECT_EQ(Error({"--bogus", "--help"}), "--bogus: unknown option");
  EXPECT_FALSE(set_.help_requested());
}

TEST_F(FlagSetTest, DoubleDashEndsTheFlags) {
  EXPECT_EQ(Error({"--", "--json"}), "'--json': unexpected argument; flags start with --");
  EXPECT_FALSE(v_.json);
}

TEST_F(FlagSetTest, SectionsKnowTheirGivenFlags) {
  ASSERT_EQ(Error({"--set", "a=1", "--eps", "0.1", "--json"}), "");
  EXPECT_EQ(set_.GivenIn(generator_), (std::vector<std::string>{"--eps", "--set"}));
  EXPECT_EQ(set_.GivenIn(0), (std::vector<std::string>{"--json"}));
}

TEST_F(FlagSetTest, EnvironmentStandsInForAFlagNotGiven) {
  std::string coordinator = "127.0.0.1:7070";
  int patience = 120;
  FlagSet set("prog", "");
  set.String("--coordinator", &coordinator, "HOST:PORT", "the coordinator")
      .Env("FLAGS_TEST_COORDINATOR");
  set.Int("--patience", &patience, "S", "seconds").Env("FLAGS_TEST_PATIENCE").Range(0);
  setenv("FLAGS_TEST_COORDINATOR", "10.0.0.1:7070", 1);
  ASSERT_TRUE(set.Parse({}).ok());
  EXPECT_EQ(coordinator, "10.0.0.1:7070");
  ASSERT_TRUE(set.Parse({"--coordinator", "h:1"}).ok());
  EXPECT_EQ(coordinator, "h:1");
  setenv("FLAGS_TEST_PATIENCE", "soon", 1);
  EXPECT_EQ(set.Parse({}).message(),
            "FLAGS_TEST_PATIENCE='soon' (for --patience): 'soon' is not an integer");
  EXPECT_TRUE(set.Parse({"--patience", "3"}).ok());
  unsetenv("FLAGS_TEST_COORDINATOR");
  unsetenv("FLAGS_TEST_PATIENCE");
  // The default shown is the one at declaration.
  EXPECT_THAT(set.Help(), HasSubstr("(default $FLAGS_TEST_PATIENCE, else 120)"));
}

TEST_F(PositionalTest, OnePositionalAnywhereAndRequired) {
  ASSERT_EQ(Error({"--json", "spec.yaml", "--threads", "2"}), "");
  EXPECT_EQ(v_.spec, "spec.yaml");
  EXPECT_EQ(Error({"--json"}), "SPEC: missing; give the job spec file");
  EXPECT_EQ(Error({"a.yaml", "b.yaml"}),
            "'b.yaml': unexpected argument; give one SPEC (a.yaml is one)");
  // Help needs no positional.
  EXPECT_EQ(Error({"--help"}), "");
}

TEST_F(FlagSetTest, HelpListsEveryFlagWithItsHelpAndDefault) {
  const std::string help = set_.Help();
  EXPECT_THAT(help, HasSubstr("usage: prog sub [options]\n\nDoes things.\n\noptions:\n"));
  EXPECT_THAT(help,
              HasSubstr("  --listen HOST:PORT  address to serve on (default 127.0.0.1:7070)\n"));
  EXPECT_THAT(help, HasSubstr("  --json              print JSON\n"));
  EXPECT_THAT(help, HasSubstr("--threads N         compute threads (default the spec's)\n"));
  EXPECT_THAT(help, HasSubstr("--timeout-ms MS     how long (default 1000)\n"));
  EXPECT_THAT(help, HasSubstr("--eps X             precision (default 0.01)\n"));
  EXPECT_THAT(help, HasSubstr("--policy LIST       policies (default ultraep,none)\n"));
  EXPECT_THAT(help, HasSubstr("  -h, --help          print this help and exit\n"));
  EXPECT_THAT(help, HasSubstr("\ngenerator options:\n"));
  EXPECT_THAT(help, HasSubstr("--mode MODE         exposed | hidden\n  (only with --generate)\n"));
  // Unset optionals and repeatables show no default; hidden flags are not listed.
  EXPECT_THAT(help, HasSubstr("--trace FILE        a trace\n"));
  EXPECT_THAT(help, Not(HasSubstr("--serving-delay-ms")));
  // Sections in declaration order.
  EXPECT_LT(help.find("--listen"), help.find("generator options"));
  EXPECT_LT(help.find("generator options"), help.find("--eps"));
}

TEST(FlagSetHelpTest, LongHelpWrapsUnderItsColumnAndLongNamesGetTheirOwnLine) {
  std::string a, b;
  FlagSet set("prog", "");
  set.String("--a", &a, "X",
             "one two three four five six seven eight nine ten eleven twelve thirteen "
             "fourteen fifteen sixteen seventeen eighteen nineteen twenty");
  set.String("--a-very-long-flag-name-indeed", &b, "FILE", "first line\nsecond line");
  const std::string help = set.Help();
  for (const std::string_view line : {std::string_view(help)}) {
    size_t start = 0;
    while (start < line.size()) {
      const size_t end = line.find('\n', start);
      EXPECT_LE(end - start, 96u) << line.substr(start, end - start);
      start = end + 1;
    }
  }
  // The column: two spaces, the widest name that fits ("-h, --help"), two spaces.
  EXPECT_THAT(help, HasSubstr("  --a X       one two"));
  EXPECT_THAT(help, HasSubstr(" fourteen\n              fifteen"));  // wrapped under the column
  EXPECT_THAT(help, HasSubstr("  --a-very-long-flag-name-indeed FILE\n"
                              "              first line\n"
                              "              second line\n"));
}

TEST(FlagSetHelpTest, CommandLineExitCodes) {
  bool json = false;
  FlagSet set("prog", "");
  set.Switch("--json", &json, "JSON");
  char prog[] = "prog", help[] = "--help", bad[] = "--bad", ok[] = "--json";
  char* with_help[] = {prog, help};
  char* with_bad[] = {prog, bad};
  char* with_ok[] = {prog, ok};
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(set.ParseCommandLine(2, with_help), 0);
  EXPECT_THAT(::testing::internal::GetCapturedStdout(), HasSubstr("usage: prog\n"));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(set.ParseCommandLine(2, with_bad), 2);
  EXPECT_EQ(set.ParseCommandLine(2, with_bad, 3), 3);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "prog: --bad: unknown option\nrun 'prog --help' for usage\n"
            "prog: --bad: unknown option\nrun 'prog --help' for usage\n");
  EXPECT_EQ(set.ParseCommandLine(2, with_ok), std::nullopt);
  EXPECT_TRUE(json);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(set.Fail("--heartbeat-timeout-ms", "must exceed --heartbeat-interval-ms"), 2);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "prog: --heartbeat-timeout-ms: must exceed --heartbeat-interval-ms\n"
            "run 'prog --help' for usage\n");
}

TEST(ParseTest, ValueParsersForCustomFlags) {
  EXPECT_EQ(*ParseInt("42", 0, 100), 42);
  EXPECT_EQ(ParseInt("x").status().message(), "'x' is not an integer");
  EXPECT_EQ(ParseInt("-1", 0).status().message(), "-1 is out of range; use 0 or more");
  EXPECT_EQ(*ParseDouble("2.5", 0), 2.5);
  EXPECT_EQ(ParseDouble("inf").status().message(), "'inf' is not a number");
  EXPECT_EQ(ParseDouble("-1", 0).status().message(), "-1 is out of range; use 0 or more");
  EXPECT_EQ(*ParseUint("7"), 7u);
  EXPECT_FALSE(ParseUint(" -7").ok());
}

}  // namespace
}  // namespace rackrun::flags
