// Confined paths: a worker daemon runs every job with its own privileges, so its operator
// may list the folders jobs are allowed to touch (rackrun-worker --allowed-roots). A job
// whose file paths lead outside them is refused at the start of an attempt, before any file
// is opened or created.
//
// What "leads" means: the path as the kernel would follow it now (base::ResolvePath).
// Relative paths are taken from the working directory; every symlink is followed, dangling
// ones included (`ROOT/l -> /elsewhere/x.json` leads to /elsewhere/x.json, where an open
// would create the file), every `..` after the symlink before it, and the part that does not
// exist yet is normalised lexically. So `/allowed/link/x` with link -> /etc is /etc/x, and
// `/allowed/new/../../etc` is /etc. A path is inside a root when the root is a prefix of it
// component by component (`/data` does not contain `/data2`).
//
// The check at attempt start gives the early, named refusal. What holds later: the worker
// also sets its roots as the process's job-file roots (base/paths.h), and every open of a
// job file (data, checkpoints and their lock and owner files, the JSON log, the load trace)
// resolves the path again and opens it from the root one component at a time with
// O_NOFOLLOW (base/file.h), so a symlink swapped in after the check is not followed.
// Limits: folder operations by path (creating the checkpoint folder, moving old
// checkpoints aside into `previous-<time>/`) are not confined that way; whoever can write
// inside a root can still swap a folder for a symlink between the check and such an
// operation. Keep the roots writable only by the users whose jobs the worker runs. Unix
// permissions of the worker's user still apply.
//
// Thread-safe (no state). Errors: InvalidArgument saying what is wrong with a root list;
// PermissionDenied naming the spec field, the path, where it leads, the host and the roots.
#ifndef RACKRUN_JOBSPEC_PATH_CONFINEMENT_H_
#define RACKRUN_JOBSPEC_PATH_CONFINEMENT_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "rackrun/v1/job_spec.pb.h"

namespace rackrun::jobspec {

// Parses "DIR[,DIR...]": every entry an absolute path to an existing folder, returned
// resolved (symlinks followed), duplicates removed, in the given order. The error says the
// problem only; the caller puts the flag's name in front (flags::FlagSet::Custom does). An
// empty list or entry is an error: no flag at all means unconfined, which the caller decides.
absl::StatusOr<std::vector<std::string>> ParseAllowedRoots(std::string_view value);

// Where `path` leads now (see the header comment): absolute, symlinks and `..` resolved.
// An error when an existing ancestor cannot be examined (no search permission).
absl::StatusOr<std::string> ResolvePathNow(const std::string& path);

// OK when `path` leads inside one of `roots` (resolved folders, as ParseAllowedRoots
// returns). `field` ("checkpoint.dir") and `host` only name things in the error.
absl::Status CheckPathConfined(const std::string& field, const std::string& path,
                               const std::vector<std::string>& roots, const std::string& host);

// Every file path of a job spec (jobspec::SpecPathFields: the datasets, blends included,
// and the outputs; empty fields are skipped). The first path outside is the error.
// Empty `roots` = unconfined: always OK.
absl::Status CheckSpecPathsConfined(const rackrun::v1::JobSpec& spec,
                                    const std::vector<std::string>& roots, const std::string& host);

}  // namespace rackrun::jobspec

#endif  // RACKRUN_JOBSPEC_PATH_CONFINEMENT_H_
