// Fuzz target: the checkpoint reader (runtime/checkpoint.h LoadCheckpoint), through a
// file as training reads it. Input: one mode byte, then the file. Mode bit 0 appends a
// valid footer (length, CRC32C of the rest, end marker) so that the fuzzer gets past the
// whole-file checksum to the header and section parsing behind it; mode bit 1 also
// recomputes each section's CRC32C where the section framing parses.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "base/crc32c.h"
#include "runtime/checkpoint.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

template <typename U>
void PutLe(std::string& out, U value) {
  for (size_t i = 0; i < sizeof(U); ++i) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

template <typename U>
bool GetLe(const std::string& s, size_t pos, U& value) {
  if (pos > s.size() || s.size() - pos < sizeof(U)) return false;
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(U); ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(s[pos + i])) << (8 * i);
  }
  value = static_cast<U>(v);
  return true;
}

// Rewrites each section's CRC to match its payload, as far as the framing parses.
void FixSectionCrcs(std::string& body) {
  uint32_t count = 0;
  if (!GetLe(body, 12, count)) return;
  size_t pos = 24;  // magic 8 + version 4 + sections 4 + step 8
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t name_len = 0;
    uint64_t len = 0;
    if (!GetLe(body, pos, name_len)) return;
    pos += 4;
    if (body.size() - pos < name_len) return;
    pos += name_len;
    if (!GetLe(body, pos, len)) return;
    pos += 8;
    if (body.size() - pos < len) return;
    const uint32_t crc = rackrun::base::Crc32c(std::string_view(body).substr(pos, len));
    pos += len;
    if (body.size() - pos < 4) return;
    for (int b = 0; b < 4; ++b) body[pos + b] = static_cast<char>((crc >> (8 * b)) & 0xff);
    pos += 4;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string file(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((mode & 2) != 0) FixSectionCrcs(file);
  if ((mode & 1) != 0) {
    const uint64_t body = file.size();
    const uint32_t crc = rackrun::base::Crc32c(file);
    PutLe<uint64_t>(file, body);
    PutLe<uint32_t>(file, crc);
    file.append("RKRCKEND", 8);
  }
  static const std::string path =
      (std::filesystem::temp_directory_path() /
       ("rackrun-fuzz-checkpoint-" + std::to_string(getpid()) + ".ckpt"))
          .string();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);  // no fsync: speed
    out.write(file.data(), static_cast<std::streamsize>(file.size()));
    FUZZ_CHECK(out.good());
  }
  absl::StatusOr<rackrun::runtime::Checkpoint> checkpoint = rackrun::runtime::LoadCheckpoint(path);
  std::error_code ec;
  std::filesystem::remove(path, ec);  // nothing left behind in the temporary folder
  if (checkpoint.ok()) {
    size_t payload = 0;
    for (const auto& s : checkpoint->sections) payload += s.name.size() + s.payload.size();
    FUZZ_CHECK(payload <= file.size());
  } else {
    FUZZ_CHECK(checkpoint.status().message().find(path) != std::string_view::npos);
  }
  return 0;
}
