#include "runtime/job_data.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "jobspec/data_blend.h"

namespace rackrun::runtime {
namespace {

std::vector<data::BlendEntry> EntriesOf(const std::vector<jobspec::BlendItem>& items) {
  std::vector<data::BlendEntry> out;
  for (const jobspec::BlendItem& i : items) out.push_back({i.weight, i.path});
  return out;
}

}  // namespace

absl::StatusOr<JobData> OpenJobData(const rackrun::v1::JobSpec& spec, const TrainConfig& c,
                                    uint64_t seed, int* vocab) {
  absl::StatusOr<std::vector<jobspec::BlendItem>> train = jobspec::TrainBlendOf(spec.data());
  if (!train.ok()) return train.status();
  absl::StatusOr<std::vector<jobspec::BlendItem>> val = jobspec::ValidationBlendOf(spec.data());
  if (!val.ok()) return val.status();
  const std::string train_field = spec.data().blend().empty() ? "data.train" : "data.blend";
  const std::string val_field =
      spec.data().validation_blend().empty() ? "data.validation" : "data.validation_blend";

  JobData d;
  absl::StatusOr<std::unique_ptr<data::Loader>> loader =
      data::Loader::Create(EntriesOf(*train), {.seq_len = c.seq_len,
                                               .batch = c.batch_size,
                                               .seed = seed,
                                               .shuffle = true,
                                               .vocab = *vocab,
                                               .field = train_field});
  if (!loader.ok()) return loader.status();
  d.train = *std::move(loader);
  const data::TokenizerInfo& tokenizer = d.train->tokenizer();
  if (*vocab == 0) *vocab = tokenizer.vocab;  // Create refused data without one
  if (*vocab < tokenizer.vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.vocab: ", *vocab, " is smaller than the vocabulary of the training data (",
        tokenizer.Describe(), "); set model.vocab to 0 (from the data) or >= ", tokenizer.vocab));
  }
  if (!val->empty()) {
    absl::StatusOr<std::unique_ptr<data::Loader>> v =
        data::Loader::Create(EntriesOf(*val), {.seq_len = c.seq_len,
                                               .batch = c.batch_size,
                                               .seed = 0,
                                               .shuffle = false,
                                               .vocab = *vocab,
                                               .field = val_field});
    if (!v.ok()) return v.status();
    const data::TokenizerInfo& theirs = (*v)->tokenizer();
    if (tokenizer.kind != "unknown" && theirs.kind != "unknown" &&
        (!tokenizer.SameTokenizer(theirs) ||
         d.train->end_of_document() != (*v)->end_of_document())) {
      return absl::InvalidArgumentError(
          absl::StrCat(val_field, ": made with tokenizer ", theirs.Describe(), " but ", train_field,
                       " with ", tokenizer.Describe(), "; make both with the same tokenizer"));
    }
    d.validation = *std::move(v);
  }
  return d;
}

}  // namespace rackrun::runtime
