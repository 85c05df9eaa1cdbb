#include "jobspec/path_confinement.h"

#include <algorithm>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/paths.h"
#include "jobspec/spec.h"

namespace rackrun::jobspec {
namespace {

namespace fs = std::filesystem;

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseAllowedRoots(std::string_view text) {
  const std::string value(text);  // absl here predates std::string_view interop
  std::vector<std::string> roots;
  if (value.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty; give one or more absolute folders separated by commas (DIR[,DIR...]), "
                     "or leave the flag out for an unconfined worker"));
  }
  for (const absl::string_view entry : absl::StrSplit(value, ',')) {
    const std::string dir(entry);
    if (dir.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", value, "' has an empty entry; separate folders by one comma"));
    }
    if (!fs::path(dir).is_absolute()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", dir,
                       "' is not an absolute path; write it from / (the worker's working "
                       "directory is not a root unless it is listed)"));
    }
    std::error_code ec;
    const fs::path resolved = fs::canonical(dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", dir, "': ", ec.message(), "; create the folder or remove it from the list"));
    }
    if (!fs::is_directory(resolved, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", dir, "' is not a folder (it leads to '", resolved.string(), "')"));
    }
    if (std::find(roots.begin(), roots.end(), resolved.string()) == roots.end()) {
      roots.push_back(resolved.string());
    }
  }
  return roots;
}

absl::StatusOr<std::string> ResolvePathNow(const std::string& path) {
  return base::ResolvePath(path);
}

absl::Status CheckPathConfined(const std::string& field, const std::string& path,
                               const std::vector<std::string>& roots, const std::string& host) {
  const std::string where =
      absl::StrCat("on host ", host, " (allowed roots: ", absl::StrJoin(roots, ", "), ")");
  absl::StatusOr<std::string> resolved = ResolvePathNow(path);
  if (!resolved.ok()) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": ", resolved.status().message(), "; it cannot be confined ", where));
  }
  for (const std::string& root : roots) {
    if (base::PathIsWithin(*resolved, root)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat(field, ": '", path, "'",
                   *resolved == path ? "" : absl::StrCat(" leads to '", *resolved, "',"),
                   " outside the folders this worker may use ", where,
                   "; put the file under one of them, or ask the operator to add its folder to the "
                   "worker's --allowed-roots"));
}

absl::Status CheckSpecPathsConfined(const rackrun::v1::JobSpec& spec,
                                    const std::vector<std::string>& roots,
                                    const std::string& host) {
  if (roots.empty()) return absl::OkStatus();
  for (const auto& [field, path] : SpecPathFields(spec)) {
    if (path->empty()) continue;
    if (absl::Status s = CheckPathConfined(field, *path, roots, host); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace rackrun::jobspec
