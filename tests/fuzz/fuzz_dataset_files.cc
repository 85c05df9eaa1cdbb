// Fuzz target: the data files a team brings (issue 36), read as a job reads them: a
// Megatron indexed dataset (data/indexed_dataset.h: PREFIX.idx, PREFIX.bin and rackrun's
// PREFIX.meta.json record) and a safetensors file (data/safetensors.h). The input is split
// into the files: a first byte chooses what is fuzzed (even: the dataset, odd: a
// safetensors file); for the dataset, two little-endian uint16 lengths then the .idx, the
// record (none when its length is 0) and the rest as the .bin. What opens must keep the
// promises of the headers: every sequence inside the token stream, the document index
// rising, every token readable; every tensor's bytes inside the file and of its shape's
// size.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "data/indexed_dataset.h"
#include "data/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

namespace data = ::rackrun::data;

namespace {

void Write(const std::string& path, std::string_view bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint16_t Length(std::string_view bytes, size_t at) {
  return at + 1 < bytes.size() ? static_cast<uint16_t>(static_cast<uint8_t>(bytes[at]) |
                                                       static_cast<uint8_t>(bytes[at + 1]) << 8)
                               : 0;
}

void CheckDataset(const data::IndexedDataset& d) {
  FUZZ_CHECK(d.sequences() >= 0 && d.documents() >= 0 && d.tokens() >= 0);
  int64_t next = 0;
  for (int64_t i = 0; i < d.sequences(); ++i) {
    FUZZ_CHECK(d.sequence_start(i) == next);  // contiguous from 0
    FUZZ_CHECK(d.sequence_length(i) >= 0);
    next += d.sequence_length(i);
  }
  FUZZ_CHECK(next == d.tokens());
  int64_t last = 0;
  for (int64_t i = 0; i <= d.documents(); ++i) {
    FUZZ_CHECK(d.document_index(i) >= last && d.document_index(i) <= d.sequences());
    last = d.document_index(i);
  }
  std::vector<int32_t> tokens(static_cast<size_t>(d.tokens()));
  if (!tokens.empty()) d.Read(0, d.tokens(), tokens.data());
}

void FuzzDataset(std::string_view bytes, const std::string& prefix) {
  const size_t idx_len = Length(bytes, 0), meta_len = Length(bytes, 2);
  bytes.remove_prefix(std::min<size_t>(4, bytes.size()));
  const std::string_view idx = bytes.substr(0, idx_len);
  bytes.remove_prefix(idx.size());
  const std::string_view meta = bytes.substr(0, meta_len);
  bytes.remove_prefix(meta.size());
  Write(prefix + ".idx", idx);
  Write(prefix + ".bin", bytes);
  if (!meta.empty()) Write(data::DatasetInfoPath(prefix), meta);
  absl::StatusOr<data::IndexedDataset> d = data::IndexedDataset::Open(prefix);
  if (d.ok()) CheckDataset(*d);
  std::remove((prefix + ".idx").c_str());
  std::remove((prefix + ".bin").c_str());
  std::remove(data::DatasetInfoPath(prefix).c_str());
}

void FuzzSafetensors(std::string_view bytes, const std::string& path) {
  Write(path, bytes);
  absl::StatusOr<data::SafetensorsFile> f = data::SafetensorsFile::Open(path);
  if (f.ok()) {
    for (const data::SafeTensor& t : f->tensors()) {
      int64_t elements = 1;
      for (const int64_t n : t.shape) {
        FUZZ_CHECK(n >= 0);
        elements *= n;
      }
      FUZZ_CHECK(static_cast<int64_t>(t.bytes.size()) ==
                 elements * static_cast<int64_t>(data::SafetensorsDTypeBytes(t.dtype)));
      // Every byte is readable (ASan: inside the mapping).
      unsigned sum = 0;
      for (const char c : t.bytes) sum += static_cast<unsigned char>(c);
      FUZZ_CHECK(sum <= 255u * t.bytes.size());
      FUZZ_CHECK(f->Find(t.name) != nullptr);
    }
  }
  std::remove(path.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes_in, size_t size) {
  if (size == 0) return 0;
  std::string_view bytes(reinterpret_cast<const char*>(bytes_in), size);
  const bool safetensors = (static_cast<uint8_t>(bytes[0]) & 1) != 0;
  bytes.remove_prefix(1);
  const std::string base = "/tmp/fuzz_dataset_files." + std::to_string(getpid());
  if (safetensors) {
    FuzzSafetensors(bytes, base + ".safetensors");
  } else {
    FuzzDataset(bytes, base);
  }
  return 0;
}
