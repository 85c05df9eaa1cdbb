// No Abseil header may be included here (see sentencepiece_backend.h).
#include "data/sentencepiece_backend.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <utility>

namespace rackrun::data::spm {

struct Processor::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

Processor::Processor(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Processor::~Processor() = default;

std::unique_ptr<Processor> Processor::FromSerialized(const std::string& model, std::string* error) {
  auto impl = std::make_unique<Impl>();
  const sentencepiece::util::Status s = impl->processor.LoadFromSerializedProto(model);
  if (!s.ok()) {
    *error = s.ToString();
    return nullptr;
  }
  return std::unique_ptr<Processor>(new Processor(std::move(impl)));
}

bool Processor::Encode(std::string_view text, std::vector<int>* ids, std::string* error) const {
  const sentencepiece::util::Status s = impl_->processor.Encode(text, ids);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

bool Processor::Decode(const std::vector<int>& ids, std::string* text, std::string* error) const {
  const sentencepiece::util::Status s = impl_->processor.Decode(ids, text);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

int Processor::pieces() const { return impl_->processor.GetPieceSize(); }
int Processor::bos() const { return impl_->processor.bos_id(); }
int Processor::eos() const { return impl_->processor.eos_id(); }
int Processor::pad() const { return impl_->processor.pad_id(); }
int Processor::unk() const { return impl_->processor.unk_id(); }

namespace {

// The library's pull interface over our producer.
class Sentences final : public sentencepiece::SentenceIterator {
 public:
  explicit Sentences(const std::function<bool(std::string*)>& next) : next_(next) { Next(); }
  bool done() const override { return done_; }
  void Next() override { done_ = !next_(&value_); }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::function<bool(std::string*)>& next_;
  std::string value_;
  bool done_ = false;
};

}  // namespace

bool Train(const std::string& args, const std::function<bool(std::string*)>& next,
           std::string* model, std::string* error) {
  Sentences sentences(next);
  const sentencepiece::util::Status s =
      sentencepiece::SentencePieceTrainer::Train(args, &sentences, model);
  if (!s.ok()) *error = s.ToString();
  return s.ok();
}

}  // namespace rackrun::data::spm
