// Paths as the kernel follows them, and the folders a process's job files are confined to.
//
// ResolvePath says where a path leads now: every symlink followed in the kernel's order,
// dangling ones included (a link whose target does not exist yet leads to that target,
// where an open with O_CREAT would create it), `..` taken after the symlink before it, and
// the part that does not exist yet normalised lexically. realpath() fails on such paths
// and std::filesystem::weakly_canonical leaves a dangling last link unresolved; a worker
// that confined paths with either could be led outside its roots by `ln -s /elsewhere/x
// ROOT/l`.
//
// Job-file roots: rackrun-worker --allowed-roots sets them once at start
// (SetJobFileRoots); the opens of base/file.h made for a job's files (FileUse::kJob) then
// reach only files beneath them, and follow no symlink below the root (see file.h). The
// process's own files (tokens, certificates, /proc) are never confined.
#ifndef RACKRUN_BASE_PATHS_H_
#define RACKRUN_BASE_PATHS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace rackrun::base {

// Where `path` leads now (see above): absolute (a relative path is taken from the working
// directory), no symlink, `.` or `..` left. InvalidArgument naming the path for an empty
// one, a loop of more than 40 symlinks, or a component that cannot be examined (no search
// permission).
absl::StatusOr<std::string> ResolvePath(const std::string& path);

// True when `path` is `root` or lies beneath it, compared component by component (both
// resolved: `/data` does not contain `/data2`).
bool PathIsWithin(const std::string& path, const std::string& root);

// The folders a job's files must lie in (resolved, absolute), or none (unconfined, the
// default). Set once, before any thread opens a job file; not thread-safe against opens.
void SetJobFileRoots(std::vector<std::string> roots);
const std::vector<std::string>& JobFileRoots();

}  // namespace rackrun::base

#endif  // RACKRUN_BASE_PATHS_H_
