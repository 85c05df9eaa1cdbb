// The rackrun_sentencepiece module (see sentencepiece_backend.h): C entry points over the
// library. No Abseil header may be included here, and no exception may leave.
#include "data/sentencepiece_backend.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#define RACKRUN_SPM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

void SetError(const std::string& what, char* error, size_t cap) {
  if (cap == 0) return;
  const size_t n = std::min(what.size(), cap - 1);
  std::memcpy(error, what.data(), n);
  error[n] = '\0';
}

// The library's pull interface over the caller's producer.
class Sentences final : public sentencepiece::SentenceIterator {
 public:
  Sentences(int (*next)(void*, const char**, size_t*), void* context)
      : next_(next), context_(context) {
    Next();
  }
  bool done() const override { return done_; }
  void Next() override {
    const char* text = nullptr;
    size_t size = 0;
    done_ = next_(context_, &text, &size) == 0;
    if (!done_) value_.assign(text, size);
  }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  int (*next_)(void*, const char**, size_t*);
  void* context_;
  std::string value_;
  bool done_ = false;
};

}  // namespace

RACKRUN_SPM_EXPORT void* rackrun_spm_load(const char* model, size_t size, char* error,
                                          size_t error_cap) {
  try {
    auto* p = new sentencepiece::SentencePieceProcessor();
    const sentencepiece::util::Status s = p->LoadFromSerializedProto(std::string_view(model, size));
    if (!s.ok()) {
      SetError(s.ToString(), error, error_cap);
      delete p;
      return nullptr;
    }
    return p;
  } catch (...) {
    SetError("the SentencePiece library failed while loading the model", error, error_cap);
    return nullptr;
  }
}

RACKRUN_SPM_EXPORT void rackrun_spm_free(void* handle) {
  delete static_cast<sentencepiece::SentencePieceProcessor*>(handle);
}

RACKRUN_SPM_EXPORT void rackrun_spm_info(void* handle, int32_t* out) {
  const auto* p = static_cast<const sentencepiece::SentencePieceProcessor*>(handle);
  out[0] = p->GetPieceSize();
  out[1] = p->bos_id();
  out[2] = p->eos_id();
  out[3] = p->pad_id();
  out[4] = p->unk_id();
}

RACKRUN_SPM_EXPORT int64_t rackrun_spm_encode(void* handle, const char* text, size_t size,
                                              int32_t* ids, int64_t cap, char* error,
                                              size_t error_cap) {
  try {
    thread_local std::vector<int> out;
    const auto* p = static_cast<const sentencepiece::SentencePieceProcessor*>(handle);
    const sentencepiece::util::Status s = p->Encode(std::string_view(text, size), &out);
    if (!s.ok()) {
      SetError(s.ToString(), error, error_cap);
      return -1;
    }
    const int64_t n = static_cast<int64_t>(out.size());
    if (n <= cap) std::copy(out.begin(), out.end(), ids);
    return n;
  } catch (...) {
    SetError("the SentencePiece library failed while encoding", error, error_cap);
    return -1;
  }
}

RACKRUN_SPM_EXPORT int64_t rackrun_spm_decode(void* handle, const int32_t* ids, int64_t n,
                                              char* text, int64_t cap, char* error,
                                              size_t error_cap) {
  try {
    const auto* p = static_cast<const sentencepiece::SentencePieceProcessor*>(handle);
    std::string out;
    const sentencepiece::util::Status s = p->Decode(std::vector<int>(ids, ids + n), &out);
    if (!s.ok()) {
      SetError(s.ToString(), error, error_cap);
      return -1;
    }
    if (static_cast<int64_t>(out.size()) <= cap) std::memcpy(text, out.data(), out.size());
    return static_cast<int64_t>(out.size());
  } catch (...) {
    SetError("the SentencePiece library failed while decoding", error, error_cap);
    return -1;
  }
}

RACKRUN_SPM_EXPORT void* rackrun_spm_train(const char* args, size_t args_size,
                                           int (*next)(void*, const char**, size_t*), void* context,
                                           char* error, size_t error_cap) {
  try {
    Sentences sentences(next, context);
    auto* model = new std::string();
    const sentencepiece::util::Status s = sentencepiece::SentencePieceTrainer::Train(
        std::string_view(args, args_size), &sentences, model);
    if (!s.ok()) {
      SetError(s.ToString(), error, error_cap);
      delete model;
      return nullptr;
    }
    return model;
  } catch (...) {
    SetError("the SentencePiece trainer failed", error, error_cap);
    return nullptr;
  }
}

RACKRUN_SPM_EXPORT int64_t rackrun_spm_bytes(void* model, char* out, int64_t cap) {
  const auto* m = static_cast<const std::string*>(model);
  if (static_cast<int64_t>(m->size()) <= cap) std::memcpy(out, m->data(), m->size());
  return static_cast<int64_t>(m->size());
}

RACKRUN_SPM_EXPORT void rackrun_spm_free_bytes(void* model) {
  delete static_cast<std::string*>(model);
}
