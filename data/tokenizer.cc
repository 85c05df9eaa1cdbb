#include "data/tokenizer.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/crc32c.h"
#include "base/file.h"
#include "data/mapped_file.h"
#include "data/sentencepiece_library.h"
#include "nlohmann/json.hpp"

namespace rackrun::data {
namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  ByteTokenizer()
      : Tokenizer(TokenizerInfo{.kind = "bytes",
                                .vocab = kByteVocab,
                                .bos = kByteEndOfDocument,
                                .eos = kByteEndOfDocument}) {}

  absl::Status Encode(std::string_view text, std::vector<int32_t>& ids) const override {
    ids.reserve(ids.size() + text.size());
    for (const char c : text) ids.push_back(static_cast<unsigned char>(c));
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (const int32_t id : ids) {
      if (id >= 0 && id < 256) text.push_back(static_cast<char>(id));
    }
    return text;
  }
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(TokenizerInfo info, std::unique_ptr<spm::Model> model)
      : Tokenizer(std::move(info)), model_(std::move(model)) {}

  absl::Status Encode(std::string_view text, std::vector<int32_t>& ids) const override {
    return model_->Encode(text, ids);
  }

  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids) const override {
    return model_->Decode(ids);
  }

 private:
  std::unique_ptr<spm::Model> model_;
};

// The smallest protobuf wire reader that finds ModelProto.trainer_spec (field 2).model_type
// (field 3, enum: 1 unigram, 2 bpe, 3 word, 4 char; absent = unigram) without the library's
// generated headers, which Debian does not ship.
class WireReader {
 public:
  explicit WireReader(std::string_view bytes) : bytes_(bytes) {}
  bool done() const { return pos_ >= bytes_.size(); }
  bool Varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= bytes_.size()) return false;
      const auto b = static_cast<unsigned char>(bytes_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  // Reads one field: its number, and its payload when length-delimited (else skipped,
  // varints returned in `value`).
  bool Field(uint64_t& number, std::string_view& payload, uint64_t& value) {
    uint64_t tag = 0;
    if (!Varint(tag)) return false;
    number = tag >> 3;
    switch (tag & 7) {
      case 0:
        return Varint(value);
      case 1:
        return Skip(8);
      case 5:
        return Skip(4);
      case 2: {
        uint64_t n = 0;
        if (!Varint(n) || n > bytes_.size() - pos_) return false;
        payload = bytes_.substr(pos_, n);
        pos_ += n;
        return true;
      }
      default:
        return false;
    }
  }

 private:
  bool Skip(size_t n) {
    if (n > bytes_.size() - pos_) return false;
    pos_ += n;
    return true;
  }
  std::string_view bytes_;
  size_t pos_ = 0;
};

std::string ModelTypeOf(std::string_view model) {
  WireReader top(model);
  while (!top.done()) {
    uint64_t number = 0, value = 0;
    std::string_view payload;
    if (!top.Field(number, payload, value)) return "unknown";
    if (number != 2) continue;
    WireReader spec(payload);
    uint64_t type = 1;  // proto2 default: UNIGRAM
    while (!spec.done()) {
      uint64_t n = 0, v = 0;
      std::string_view p;
      if (!spec.Field(n, p, v)) return "unknown";
      if (n == 3) type = v;
    }
    switch (type) {
      case 1:
        return "unigram";
      case 2:
        return "bpe";
      case 3:
        return "word";
      case 4:
        return "char";
      default:
        return "unknown";
    }
  }
  return "unigram";
}

}  // namespace

bool TokenizerInfo::SameTokenizer(const TokenizerInfo& other) const {
  return kind == other.kind && model_type == other.model_type && vocab == other.vocab &&
         model_crc32c == other.model_crc32c;
}

std::string TokenizerInfo::Describe() const {
  if (kind == "sentencepiece") {
    return absl::StrFormat("sentencepiece %s, vocab %d (model %s, crc32c 0x%08x)", model_type,
                           vocab, model.empty() ? "?" : model, model_crc32c);
  }
  return absl::StrCat(kind, " (vocab ", vocab, ")");
}

std::string TokenizerInfo::ToJson() const {
  const nlohmann::json j = {
      {"kind", kind}, {"model_type", model_type},     {"vocab", vocab}, {"bos", bos}, {"eos", eos},
      {"pad", pad},   {"model_crc32c", model_crc32c}, {"model", model}};
  return j.dump();
}

absl::StatusOr<TokenizerInfo> TokenizerInfo::FromJson(std::string_view json,
                                                      absl::string_view origin) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(origin, ": the tokenizer record is not valid: ", why));
  };
  if (!j.is_object()) return bad("not a JSON object");
  if (!j.contains("kind") || !j["kind"].is_string()) return bad("no \"kind\"");
  if (!j.contains("vocab") || !j["vocab"].is_number_integer()) return bad("no \"vocab\"");
  TokenizerInfo info;
  info.kind = j["kind"].get<std::string>();
  info.vocab = j["vocab"].get<int32_t>();
  if (info.vocab <= 0) return bad(absl::StrCat("vocab ", info.vocab));
  const auto integer = [&](const char* key, int32_t fallback) {
    return j.contains(key) && j[key].is_number_integer() ? j[key].get<int32_t>() : fallback;
  };
  info.bos = integer("bos", -1);
  info.eos = integer("eos", -1);
  info.pad = integer("pad", -1);
  if (j.contains("model_type") && j["model_type"].is_string()) {
    info.model_type = j["model_type"].get<std::string>();
  }
  if (j.contains("model") && j["model"].is_string()) info.model = j["model"].get<std::string>();
  if (j.contains("model_crc32c") && j["model_crc32c"].is_number_unsigned()) {
    info.model_crc32c = j["model_crc32c"].get<uint32_t>();
  }
  return info;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> OpenTokenizer(const std::string& name) {
  if (name == "bytes") return std::make_unique<ByteTokenizer>();
  absl::StatusOr<MappedFile> file =
      MappedFile::Open(name, "SentencePiece model", MappedFile::Access::kSequential);
  if (!file.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer: ", file.status().message(),
        "; give `bytes` or a SentencePiece .model (`rackrun data tokenizer --train` makes one)"));
  }
  const std::string_view bytes = file->bytes();
  absl::StatusOr<std::unique_ptr<spm::Model>> model = spm::Model::Load(bytes);
  if (!model.ok()) {
    if (model.status().code() == absl::StatusCode::kFailedPrecondition) return model.status();
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer '", name, "' is not a SentencePiece model (",
                     model.status().message(), "); give `bytes` or a .model file"));
  }
  const spm::Model& m = **model;
  TokenizerInfo info{.kind = "sentencepiece",
                     .model_type = ModelTypeOf(bytes),
                     .vocab = m.pieces(),
                     .bos = m.bos(),
                     .eos = m.eos(),
                     .pad = m.pad(),
                     .model_crc32c = base::Crc32c(bytes),
                     .model = name};
  return std::make_unique<SentencePieceTokenizer>(std::move(info), *std::move(model));
}

absl::Status TrainSentencePiece(const SentencePieceTraining& options,
                                const std::function<bool(std::string*)>& next) {
  if (options.model_type != "bpe" && options.model_type != "unigram") {
    return absl::InvalidArgumentError(absl::StrCat("--model-type: '", options.model_type,
                                                   "' is not a choice; use bpe or unigram"));
  }
  if (options.vocab_size < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("--vocab: ", options.vocab_size, " is too small; give at least 8"));
  }
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string args = absl::StrCat(
      "--vocab_size=", options.vocab_size, " --model_type=", options.model_type,
      " --character_coverage=", options.character_coverage,
      " --input_sentence_size=", options.max_sentences, " --shuffle_input_sentence=true",
      " --num_threads=", options.threads > 0 ? static_cast<unsigned>(options.threads) : cores,
      " --minloglevel=2", " --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1");
  absl::StatusOr<std::string> model = spm::Train(args, next);
  if (!model.ok()) {
    if (model.status().code() == absl::StatusCode::kFailedPrecondition) return model.status();
    return absl::InvalidArgumentError(
        absl::StrCat("SentencePiece training failed: ", model.status().message(),
                     " (for a small corpus, lower --vocab or use --model-type unigram)"));
  }
  return base::WriteFileAtomically(options.output, *model);
}

}  // namespace rackrun::data
