// The rendezvous stores' shared contract (rendezvous_store.h), run on the in-memory and the
// directory store alike: values, waiting for keys set by other threads, and the timeout
// naming exactly the missing keys; then what only the directory store has (escaped key
// names, file errors that name the path).
#include "comm/rendezvous_store.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/shell.h"

namespace rackrun::comm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A store of each kind; the directory store gets a fresh folder of its own.
template <typename Store>
std::unique_ptr<Store> NewStore();

template <>
std::unique_ptr<InMemoryRendezvousStore> NewStore() {
  return std::make_unique<InMemoryRendezvousStore>();
}

// An empty folder `name` in the test's own folder (removed when the test passes).
std::string FreshDir(const std::string& name) {
  const std::filesystem::path dir = ::rackrun::testing::ScratchDir("rendezvous-") / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

template <>
std::unique_ptr<DirectoryRendezvousStore> NewStore() {
  return std::make_unique<DirectoryRendezvousStore>(
      FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name()));
}

template <typename Store>
class RendezvousStoreContract : public ::testing::Test {};

using StoreKinds = ::testing::Types<InMemoryRendezvousStore, DirectoryRendezvousStore>;
TYPED_TEST_SUITE(RendezvousStoreContract, StoreKinds);

TYPED_TEST(RendezvousStoreContract, GetReturnsValuesInKeyOrder) {
  std::unique_ptr<TypeParam> owned = NewStore<TypeParam>();
  TypeParam& store = *owned;
  ASSERT_TRUE(store.Set("a", "1").ok());
  ASSERT_TRUE(store.Set("b", std::string("\0x", 2)).ok());
  absl::StatusOr<std::vector<std::string>> values = store.Get({"b", "a"}, absl::ZeroDuration());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre(std::string("\0x", 2), "1"));
  ASSERT_TRUE(store.Set("a", "2").ok());
  EXPECT_THAT(*store.Get({"a"}, absl::ZeroDuration()), ElementsAre("2"));
  EXPECT_TRUE(store.Get({}, absl::ZeroDuration()).ok());
}

TYPED_TEST(RendezvousStoreContract, GetWaitsForKeysSetByOtherThreads) {
  std::unique_ptr<TypeParam> owned = NewStore<TypeParam>();
  TypeParam& store = *owned;
  std::vector<std::thread> setters;
  for (int i = 0; i < 4; ++i) {
    setters.emplace_back([&store, i] {
      std::this_thread::sleep_for(std::chrono::milliseconds(10 * i));
      EXPECT_TRUE(store.Set("rank/" + std::to_string(i), std::to_string(i * i)).ok());
    });
  }
  absl::StatusOr<std::vector<std::string>> values =
      store.Get({"rank/0", "rank/1", "rank/2", "rank/3"}, absl::Seconds(30));
  for (std::thread& t : setters) t.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre("0", "1", "4", "9"));
}

TYPED_TEST(RendezvousStoreContract, TimeoutNamesOnlyTheMissingKeys) {
  std::unique_ptr<TypeParam> owned = NewStore<TypeParam>();
  TypeParam& store = *owned;
  ASSERT_TRUE(store.Set("job/1/here", "").ok());
  absl::StatusOr<std::vector<std::string>> values =
      store.Get({"job/1/here", "job/1/late", "job/1/gone"}, absl::Milliseconds(20));
  ASSERT_FALSE(values.ok());
  EXPECT_EQ(values.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(values.status().message(), HasSubstr("'job/1/late', 'job/1/gone'"));
  EXPECT_THAT(values.status().message(), Not(HasSubstr("here")));
  // A zero timeout checks once.
  EXPECT_EQ(store.Get({"job/1/late"}, absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(DirectoryRendezvousStore, KeysThatDifferOnlyInSlashesAndEscapesAreDistinct) {
  DirectoryRendezvousStore store(FreshDir("distinct"));
  const std::vector<std::string> keys = {"a/b", "a_b", "a%2Fb", "a%b", "a%252Fb", "",
                                         ".",   "..",  "%2E",   "%00", ".a"};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(store.Set(keys[i], std::to_string(i)).ok());
  }
  EXPECT_THAT(*store.Get(keys, absl::ZeroDuration()),
              ElementsAre("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10"));
  // Nothing but the values is left in the folder (no temporaries, nothing outside it).
  const std::filesystem::path dir = std::filesystem::path(store.PathOf("x")).parent_path();
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            static_cast<std::ptrdiff_t>(keys.size()));
}

TEST(DirectoryRendezvousStore, TwoStoresOnOneFolderSeeEachOthersValues) {
  const std::string dir = FreshDir("shared");
  DirectoryRendezvousStore a(dir), b(dir);
  std::thread setter([&a] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(a.Set("job/7/rank/1", "addr").ok());
  });
  absl::StatusOr<std::vector<std::string>> values = b.Get({"job/7/rank/1"}, absl::Seconds(30));
  setter.join();
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_THAT(*values, ElementsAre("addr"));
}

TEST(DirectoryRendezvousStore, MissingFolderIsNamedInTheError) {
  DirectoryRendezvousStore store(FreshDir("gone") + "/not-there");
  const absl::Status s = store.Set("k", "v");
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("not-there/k.tmp"));
  EXPECT_THAT(s.message(), HasSubstr("check that the folder exists"));
  absl::StatusOr<std::vector<std::string>> values = store.Get({"k"}, absl::ZeroDuration());
  EXPECT_EQ(values.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(values.status().message(), HasSubstr("not-there: key 'k' not set"));
}

}  // namespace
}  // namespace rackrun::comm
