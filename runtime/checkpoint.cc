#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace rackrun::runtime {
namespace {

constexpr char kMagic[8] = {'R', 'K', 'R', 'C', 'K', 'P', 'T', '1'};
constexpr char kEndMagic[8] = {'R', 'K', 'R', 'C', 'K', 'E', 'N', 'D'};
constexpr uint32_t kVersion = 1;

using base::PosixError;

template <typename U>
void PutLe(std::string& out, U value) {
  for (size_t i = 0; i < sizeof(U); ++i) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

// Bounds-checked little-endian reader over a byte buffer.
class Reader {
 public:
  explicit Reader(std::string_view bytes) : bytes_(bytes) {}
  template <typename U>
  bool Get(U& value) {
    if (bytes_.size() - pos_ < sizeof(U)) return false;
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(U); ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[pos_ + i])) << (8 * i);
    }
    value = static_cast<U>(v);
    pos_ += sizeof(U);
    return true;
  }
  bool Take(size_t n, std::string_view& out) {
    if (bytes_.size() - pos_ < n) return false;
    out = bytes_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

bool ParseStep(const std::string& file_name, int64_t& step) {
  // step-00000100.ckpt
  if (file_name.size() < 11 || file_name.rfind("step-", 0) != 0 ||
      file_name.substr(file_name.size() - 5) != ".ckpt") {
    return false;
  }
  const std::string digits = file_name.substr(5, file_name.size() - 10);
  if (digits.empty() ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  step = std::stoll(digits);
  return true;
}

}  // namespace

const CheckpointSection* Checkpoint::Find(std::string_view name) const {
  for (const CheckpointSection& s : sections) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

std::string PackFloats(std::span<const float> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size_bytes());
}

absl::Status UnpackFloats(const CheckpointSection& section, std::span<float> out) {
  if (section.payload.size() != out.size_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint section '", section.name, "' holds ",
                     section.payload.size() / sizeof(float), " values but the model expects ",
                     out.size(), "; the checkpoint was written for a different model shape"));
  }
  std::memcpy(out.data(), section.payload.data(), out.size_bytes());
  return absl::OkStatus();
}

std::string CheckpointPath(const std::string& dir, int64_t step) {
  return (std::filesystem::path(dir) / absl::StrFormat("step-%08d.ckpt", step)).string();
}

absl::StatusOr<std::string> SaveCheckpoint(const std::string& dir, const Checkpoint& checkpoint,
                                           int keep) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create checkpoint folder '", dir, "': ", ec.message()));
  }
  std::string bytes;
  size_t total = 64;
  for (const CheckpointSection& s : checkpoint.sections)
    total += 16 + s.name.size() + s.payload.size();
  bytes.reserve(total);
  bytes.append(kMagic, sizeof(kMagic));
  PutLe<uint32_t>(bytes, kVersion);
  PutLe<uint32_t>(bytes, static_cast<uint32_t>(checkpoint.sections.size()));
  PutLe<uint64_t>(bytes, static_cast<uint64_t>(checkpoint.step));
  for (const CheckpointSection& s : checkpoint.sections) {
    PutLe<uint32_t>(bytes, static_cast<uint32_t>(s.name.size()));
    bytes += s.name;
    PutLe<uint64_t>(bytes, s.payload.size());
    bytes += s.payload;
    PutLe<uint32_t>(bytes, Crc32c(s.payload));
  }
  const uint64_t body = bytes.size();
  const uint32_t crc = Crc32c(bytes);
  PutLe<uint64_t>(bytes, body);
  PutLe<uint32_t>(bytes, crc);
  bytes.append(kEndMagic, sizeof(kEndMagic));

  const std::string path = CheckpointPath(dir, checkpoint.step);
  if (absl::Status s = WriteFileAtomically(path, bytes, base::FileUse::kJob); !s.ok()) return s;

  std::vector<std::string> all = ListCheckpoints(dir);
  const size_t kept = static_cast<size_t>(std::max(keep, 2));
  for (size_t i = 0; i + kept < all.size(); ++i) {
    if (all[i] != path) std::filesystem::remove(all[i], ec);
  }
  return path;
}

std::vector<std::string> ListCheckpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    int64_t step = 0;
    if (entry.is_regular_file() && ParseStep(entry.path().filename().string(), step)) {
      found.emplace_back(step, entry.path().string());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  for (auto& [step, path] : found) paths.push_back(std::move(path));
  return paths;
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& path) {
  absl::StatusOr<std::string> read = ReadWholeFile(path, base::FileUse::kJob);
  if (!read.ok()) {
    return absl::Status(read.status().code(),
                        absl::StrCat("checkpoint: ", read.status().message()));
  }
  const std::string& bytes = *read;
  const auto refuse = [&](absl::string_view why) {
    return absl::DataLossError(
        absl::StrCat("refusing checkpoint '", path, "': ", why,
                     "; resume from an earlier checkpoint in the same folder"));
  };
  constexpr size_t kFooter = 8 + 4 + sizeof(kEndMagic);
  if (bytes.size() < sizeof(kMagic) + 16 + kFooter &&
      (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0)) {
    return refuse("file is truncated (too short)");
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    const bool text = std::all_of(bytes.begin(),
                                  bytes.begin() + std::min<size_t>(bytes.size(), 512), [](char ch) {
                                    const unsigned char u = static_cast<unsigned char>(ch);
                                    return u == '\n' || u == '\r' || u == '\t' || u >= 0x20;
                                  });
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is not a rackrun checkpoint (it does not start with \"RKRCKPT1\"",
        text ? "; it is a text file, perhaps a job spec" : "",
        "); pass a checkpoint written by rackrun train, <checkpoint.dir>/step-<8 digits>.ckpt, "
        "or the checkpoint folder itself to take its newest"));
  }
  if (std::memcmp(bytes.data() + bytes.size() - sizeof(kEndMagic), kEndMagic, sizeof(kEndMagic)) !=
      0) {
    return refuse("end marker missing (file is truncated)");
  }
  Reader footer(std::string_view(bytes).substr(bytes.size() - kFooter));
  uint64_t body = 0;
  uint32_t crc = 0;
  footer.Get(body);
  footer.Get(crc);
  if (body != bytes.size() - kFooter) {
    return refuse(absl::StrCat("footer records ", body, " bytes but ", bytes.size() - kFooter,
                               " precede it (file is truncated or padded)"));
  }
  const std::string_view content = std::string_view(bytes).substr(0, body);
  if (Crc32c(content) != crc) return refuse("file checksum mismatch (data corrupted)");

  Reader r(content);
  std::string_view magic;
  uint32_t version = 0, count = 0;
  uint64_t step = 0;
  r.Take(sizeof(kMagic), magic);
  if (!r.Get(version) || !r.Get(count) || !r.Get(step)) return refuse("header is truncated");
  if (version != kVersion) {
    return refuse(absl::StrCat("format version ", version, ", this build reads ", kVersion));
  }
  Checkpoint checkpoint;
  checkpoint.step = static_cast<int64_t>(step);
  std::string section_crcs;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t name_len = 0;
    uint64_t len = 0;
    uint32_t section_crc = 0;
    std::string_view name, payload;
    if (!r.Get(name_len) || !r.Take(name_len, name) || !r.Get(len) || !r.Take(len, payload) ||
        !r.Get(section_crc)) {
      return refuse(absl::StrCat("section ", i, " is truncated"));
    }
    if (Crc32c(payload) != section_crc) {
      return refuse(absl::StrCat("checksum mismatch in section '", std::string(name), "'"));
    }
    checkpoint.sections.push_back({std::string(name), std::string(payload)});
    PutLe<uint32_t>(section_crcs, section_crc);
  }
  checkpoint.checksum = Crc32c(section_crcs);
  if (r.pos() != content.size()) return refuse("trailing bytes after the last section");
  return checkpoint;
}

namespace {

bool IsCheckpointName(const std::string& name) {
  int64_t step = 0;
  return ParseStep(name, step);
}

// Moves `files` into `<dir>/<label>-<UTC time>/` (a new folder; a suffix keeps it new).
absl::StatusOr<std::string> MoveAside(const std::string& dir, const std::vector<std::string>& files,
                                      absl::string_view label) {
  char stamp[32] = {};
  const std::time_t now = std::time(nullptr);
  struct tm utc = {};
  gmtime_r(&now, &utc);
  std::strftime(stamp, sizeof(stamp), "%Y%m%dT%H%M%SZ", &utc);
  std::filesystem::path aside = std::filesystem::path(dir) / absl::StrCat(label, "-", stamp);
  for (int n = 2; std::filesystem::exists(aside); ++n) {
    aside = std::filesystem::path(dir) / absl::StrCat(label, "-", stamp, "-", n);
  }
  if (::mkdir(aside.c_str(), 0755) != 0) return PosixError("cannot create folder", aside.string());
  for (const std::string& f : files) {
    const std::filesystem::path to = aside / std::filesystem::path(f).filename();
    if (::rename(f.c_str(), to.c_str()) != 0) return PosixError("cannot move checkpoint", f);
  }
  return aside.string();
}

std::string Names(const std::vector<std::string>& files) {
  std::string out;
  for (const std::string& f : files) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", std::filesystem::path(f).filename().string());
  }
  return out;
}

}  // namespace

absl::StatusOr<CheckpointFolderClaim> ClaimCheckpointFolder(const std::string& dir,
                                                            const CheckpointFolderRun& run) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(dir, ec);
  if (std::filesystem::exists(status) && !std::filesystem::is_directory(status)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint.dir: '", dir,
                     "' exists and is not a folder; give a folder (it is created "
                     "when missing)"));
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint.dir: cannot create '", dir, "': ", ec.message()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint.dir: cannot write into '", dir, "': ", std::strerror(errno)));
  }
  absl::StatusOr<base::FolderLock> lock =
      base::FolderLock::Acquire(dir, "checkpoint.dir", base::FileUse::kJob);
  if (!lock.ok()) return lock.status();
  CheckpointFolderClaim claim{*std::move(lock), {}};
  absl::StatusOr<std::vector<std::string>> stale =
      base::RemoveStaleTemporaries(dir, IsCheckpointName);
  if (!stale.ok()) return stale.status();
  if (!stale->empty()) {
    claim.notes.push_back(
        absl::StrCat("removed ", stale->size(),
                     " temporary file(s) of a checkpoint writer that died: ", Names(*stale)));
  }
  const std::string owner =
      run.owner.empty() ? absl::StrCat("pid ", getpid(), " on host ", base::HostName()) : run.owner;
  const auto record_owner = [&]() -> absl::Status {
    return WriteFileAtomically((std::filesystem::path(dir) / "OWNER").string(), owner + "\n",
                               base::FileUse::kJob);
  };
  const std::vector<std::string> present = ListCheckpoints(dir);
  if (present.empty()) {
    if (absl::Status s = record_owner(); !s.ok()) return s;
    return claim;
  }
  bool continuing = false;
  if (!run.resumed_from.empty()) {
    std::filesystem::path from_dir = std::filesystem::path(run.resumed_from).parent_path();
    if (from_dir.empty()) from_dir = ".";
    continuing = std::filesystem::equivalent(from_dir, dir, ec);
  }
  if (continuing) {
    // Resuming from an older checkpoint of the folder: the newer ones are an abandoned
    // continuation, which this run would overwrite step by step and pruning would mix.
    std::vector<std::string> newer;
    for (const std::string& f : present) {
      int64_t step = 0;
      if (ParseStep(std::filesystem::path(f).filename().string(), step) &&
          step > run.resumed_step) {
        newer.push_back(f);
      }
    }
    if (newer.empty()) return claim;
    absl::StatusOr<std::string> aside = MoveAside(dir, newer, "superseded");
    if (!aside.ok()) return aside.status();
    claim.notes.push_back(absl::StrCat("resuming at step ", run.resumed_step, ": moved the newer ",
                                       Names(newer), " into ", *aside));
    return claim;
  }
  if (!run.start_over) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint.dir: '", dir, "' already holds checkpoints of another run (", Names(present),
        "); continue that run with --resume ", dir,
        ", start over with --start-over (checkpoint.start_over: true, moves them into ", dir,
        "/previous-<time>/), or use another checkpoint.dir"));
  }
  absl::StatusOr<std::string> aside = MoveAside(dir, present, "previous");
  if (!aside.ok()) return aside.status();
  if (absl::Status s = record_owner(); !s.ok()) return s;
  claim.notes.push_back(absl::StrCat("checkpoint.start_over: moved ", Names(present),
                                     " of the previous run into ", *aside));
  return claim;
}

absl::StatusOr<std::string> CheckpointFolderOwner(const std::string& dir) {
  absl::StatusOr<std::string> owner =
      ReadWholeFile((std::filesystem::path(dir) / "OWNER").string(), base::FileUse::kJob);
  if (!owner.ok()) return owner.status();
  while (!owner->empty() && owner->back() == '\n') owner->pop_back();
  return owner;
}

absl::StatusOr<Checkpoint> LoadCheckpointForResume(const std::string& path,
                                                   std::string* loaded_path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) {
    absl::StatusOr<Checkpoint> c = LoadCheckpoint(path);
    if (c.ok() && loaded_path != nullptr) *loaded_path = path;
    return c;
  }
  const std::vector<std::string> all = ListCheckpoints(path);
  if (all.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint (step-*.ckpt) in '", path,
                                            "'; check the folder or drop --resume"));
  }
  absl::StatusOr<Checkpoint> newest = LoadCheckpoint(all.back());
  if (newest.ok()) {
    if (loaded_path != nullptr) *loaded_path = all.back();
    return newest;
  }
  std::string message(newest.status().message());
  for (size_t i = all.size() - 1; i-- > 0;) {
    if (LoadCheckpoint(all[i]).ok()) {
      absl::StrAppend(&message, ". The previous checkpoint '", all[i],
                      "' is intact: resume from it with --resume ", all[i]);
      break;
    }
  }
  return absl::Status(newest.status().code(), message);
}

}  // namespace rackrun::runtime
