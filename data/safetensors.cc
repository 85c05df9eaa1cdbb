#include "data/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/file.h"
#include "nlohmann/json.hpp"

namespace rackrun::data {

size_t SafetensorsDTypeBytes(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

namespace {

// Elements of `shape`, or -1 when a dimension is negative or the product overflows.
int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (const int64_t d : shape) {
    if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) return -1;
    n *= d;
  }
  return n;
}

// Bytes of `count` elements of `element` bytes each, or -1 when count is negative or the
// product overflows (2^62 eight-byte elements wrapped to 0 bytes and matched an empty range).
int64_t BytesOf(int64_t count, size_t element) {
  if (count < 0 || element == 0 ||
      count > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(element))
    return -1;
  return count * static_cast<int64_t>(element);
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafeTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const SafeTensor& t : tensors) {
    const size_t element = SafetensorsDTypeBytes(t.dtype);
    const int64_t n = Elements(t.shape);
    if (element == 0)
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': dtype ", t.dtype));
    const int64_t want = BytesOf(n, element);
    if (want < 0 || static_cast<uint64_t>(want) != t.bytes.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "': ", t.bytes.size(), " bytes do not match its shape"));
    }
    if (t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name '", t.name, "' is used twice or reserved"));
    }
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  absl::StatusOr<base::AtomicFileWriter> out = base::AtomicFileWriter::Open(path);
  if (!out.ok()) return out.status();
  const uint64_t n = text.size();
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i)
    length[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  for (const std::string_view part : {std::string_view(length), std::string_view(text)}) {
    if (absl::Status s = out->Append(part); !s.ok()) return s;
  }
  for (const SafeTensor& t : tensors) {
    if (absl::Status s = out->Append(t.bytes); !s.ok()) return s;
  }
  return out->Commit();
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  absl::StatusOr<MappedFile> mapped = MappedFile::Open(path, "safetensors file");
  if (!mapped.ok()) return absl::InvalidArgumentError(mapped.status().message());
  SafetensorsFile f;
  f.file_ = *std::move(mapped);
  const std::string_view bytes = f.file_.bytes();
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors file '", path, "' is not valid: ", why));
  };
  if (bytes.size() < 8) return bad("shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[static_cast<size_t>(i)]))
         << (8 * i);
  if (n > bytes.size() - 8) return bad(absl::StrCat("header length ", n, " exceeds the file"));
  const nlohmann::json header =
      nlohmann::json::parse(bytes.substr(8, n), nullptr, /*allow_exceptions=*/false);
  if (!header.is_object()) return bad("the header is not a JSON object");
  const std::string_view buffer = bytes.substr(8 + n);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return bad("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) return bad(absl::StrCat("metadata '", k, "' is not a string"));
        f.metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !entry.contains("shape") || !entry["shape"].is_array() || !entry.contains("data_offsets") ||
        !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2 ||
        !entry["data_offsets"][0].is_number_unsigned() ||
        !entry["data_offsets"][1].is_number_unsigned()) {
      return bad(absl::StrCat("tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    SafeTensor t;
    t.name = name;
    t.dtype = entry["dtype"].get<std::string>();
    for (const nlohmann::json& d : entry["shape"]) {
      if (!d.is_number_unsigned()) return bad(absl::StrCat("tensor '", name, "': bad shape"));
      t.shape.push_back(d.get<int64_t>());
    }
    const uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
    const uint64_t end = entry["data_offsets"][1].get<uint64_t>();
    const size_t element = SafetensorsDTypeBytes(t.dtype);
    const int64_t count = Elements(t.shape);
    if (element == 0) return bad(absl::StrCat("tensor '", name, "': unknown dtype ", t.dtype));
    const int64_t want = BytesOf(count, element);
    if (begin > end || end > buffer.size() || want < 0 ||
        end - begin != static_cast<uint64_t>(want)) {
      return bad(absl::StrCat("tensor '", name, "': offsets [", begin, ", ", end,
                              ") do not fit its shape or the file's ", buffer.size(),
                              " data bytes"));
    }
    t.bytes = buffer.substr(begin, end - begin);
    ranges.emplace_back(begin, end);
    f.tensors_.push_back(std::move(t));
  }
  // The tensors tile the buffer: no gap, no overlap (what the safetensors package checks).
  std::vector<size_t> order(f.tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  uint64_t at = 0;
  std::vector<SafeTensor> sorted;
  for (const size_t i : order) {
    if (ranges[i].first != at)
      return bad(
          absl::StrCat("tensor '", f.tensors_[i].name, "' leaves a gap or overlaps another"));
    at = ranges[i].second;
    sorted.push_back(std::move(f.tensors_[i]));
  }
  if (at != buffer.size()) return bad("bytes after the last tensor");
  f.tensors_ = std::move(sorted);
  return f;
}

const SafeTensor* SafetensorsFile::Find(std::string_view name) const {
  for (const SafeTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

}  // namespace rackrun::data
