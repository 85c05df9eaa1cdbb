#include "base/paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace rackrun::base {
namespace {

// Linux's limit on the symlinks one lookup follows (MAXSYMLINKS).
constexpr int kMaxLinks = 40;

std::vector<std::string>& Roots() {
  static std::vector<std::string>* roots = new std::vector<std::string>();
  return *roots;
}

// `parts` pushed in front of `todo`, in order.
void PushFront(std::deque<std::string>& todo, const std::string& text) {
  const std::vector<std::string> parts = absl::StrSplit(text, '/', absl::SkipEmpty());
  todo.insert(todo.begin(), parts.begin(), parts.end());
}

std::string Joined(const std::vector<std::string>& parts) {
  return absl::StrCat("/", absl::StrJoin(parts, "/"));
}

}  // namespace

absl::StatusOr<std::string> ResolvePath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("an empty path");
  std::deque<std::string> todo;
  PushFront(todo, path);
  if (path.front() != '/') {
    char cwd[PATH_MAX];
    if (::getcwd(cwd, sizeof(cwd)) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': cannot read the working directory: ", std::strerror(errno)));
    }
    PushFront(todo, cwd);
  }
  std::vector<std::string> done;  // resolved components: no symlink among them
  bool missing = false;           // a component of `done` does not exist: nothing below does
  int links = 0;
  while (!todo.empty()) {
    std::string part = std::move(todo.front());
    todo.pop_front();
    if (part == ".") continue;
    if (part == "..") {
      // `done` holds no symlink, so its parent is the kernel's `..` (and lexical below a
      // missing component, where the kernel would fail anyway).
      if (!done.empty()) done.pop_back();
      continue;
    }
    done.push_back(std::move(part));
    if (missing) continue;
    const std::string here = Joined(done);
    struct stat st {};
    if (::lstat(here.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) {
        missing = true;
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': cannot examine '", here, "': ", std::strerror(errno)));
    }
    if (!S_ISLNK(st.st_mode)) continue;
    if (++links > kMaxLinks) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': more than ", kMaxLinks, " symbolic links (a loop?)"));
    }
    char target[PATH_MAX];
    const ssize_t n = ::readlink(here.c_str(), target, sizeof(target) - 1);
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "': cannot read the link '", here, "': ", std::strerror(errno)));
    }
    target[n] = '\0';
    done.pop_back();  // the link is replaced by its target, from its folder or from /
    if (target[0] == '/') done.clear();
    PushFront(todo, target);
  }
  return Joined(done);
}

bool PathIsWithin(const std::string& path, const std::string& root) {
  const std::vector<absl::string_view> p = absl::StrSplit(path, '/', absl::SkipEmpty());
  const std::vector<absl::string_view> r = absl::StrSplit(root, '/', absl::SkipEmpty());
  if (r.size() > p.size()) return false;
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i] != p[i]) return false;
  }
  return true;
}

void SetJobFileRoots(std::vector<std::string> roots) { Roots() = std::move(roots); }

const std::vector<std::string>& JobFileRoots() { return Roots(); }

}  // namespace rackrun::base
