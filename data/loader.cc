#include "data/loader.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/random.h"
#include "nlohmann/json.hpp"

namespace rackrun::data {
namespace {

constexpr int kFeistelRounds = 6;

// A bijection of [0, n) keyed by `key`: a balanced Feistel network over the smallest even
// bit width that holds n - 1, cycle-walked back into [0, n) (fewer than 4 passes expected,
// as 2^bits < 4n).
uint64_t Permute(uint64_t x, uint64_t n, uint64_t key) {
  if (n <= 1) return 0;
  int bits = std::bit_width(n - 1);
  bits += bits % 2;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (int round = 0; round < kFeistelRounds; ++round) {
      const uint64_t f =
          base::SplitMix64(right ^ (key + static_cast<uint64_t>(round) * 0x9e3779b97f4a7c15ULL)) &
          mask;
      const uint64_t next_left = right;
      right = left ^ f;
      left = next_left;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

// The key of epoch `epoch` of dataset `d` under `seed`.
uint64_t EpochKey(uint64_t seed, size_t d, uint64_t epoch) {
  return base::SplitMix64(base::SplitMix64(base::SplitMix64(seed) ^ (d + 1)) ^ epoch);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Loader>> Loader::Create(const std::vector<BlendEntry>& blend,
                                                       const LoaderOptions& options) {
  const std::string& field = options.field;
  if (blend.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": no dataset"));
  if (options.seq_len < 1 || options.batch < 1) {
    return absl::InvalidArgumentError(absl::StrCat("loader needs seq_len >= 1 and batch >= 1, got ",
                                                   options.seq_len, " and ", options.batch));
  }
  std::unique_ptr<Loader> l(new Loader());
  l->options_ = options;
  const bool by_size =
      std::all_of(blend.begin(), blend.end(), [](const BlendEntry& e) { return e.weight < 0; });
  const TokenSource* known = nullptr;  // the first dataset that knows its tokenizer
  const int64_t seq = options.seq_len;
  for (const BlendEntry& e : blend) {
    if (!by_size && !(e.weight > 0 && std::isfinite(e.weight))) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": the weight of '", e.path, "' is ",
                                                     e.weight, "; weights must be positive"));
    }
    absl::StatusOr<std::unique_ptr<TokenSource>> s = TokenSource::Open(e.path);
    if (!s.ok()) {
      return absl::Status(s.status().code(), absl::StrCat(field, ": ", s.status().message()));
    }
    const TokenSource& src = **s;
    if (src.tokens() < 2 * seq + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", e.path, "' has ", src.tokens(),
                       " tokens, fewer than 2 windows of model.seq_len + 1 = ", seq + 1,
                       "; use more text or a shorter model.seq_len"));
    }
    if (src.tokenizer().kind != "unknown") {
      if (known == nullptr) {
        known = &src;
      } else if (!known->tokenizer().SameTokenizer(src.tokenizer()) ||
                 known->end_of_document() != src.end_of_document()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": '", known->path(), "' was made with tokenizer ",
            known->tokenizer().Describe(), " but '", src.path(), "' with ",
            src.tokenizer().Describe(), "; tokenize every dataset of a job with one tokenizer"));
      }
    }
    l->windows_.push_back(options.shuffle ? (src.tokens() - seq) / seq : (src.tokens() - 1) / seq);
    l->weights_.push_back(by_size ? static_cast<double>(src.tokens()) : e.weight);
    l->sources_.push_back(*std::move(s));
  }
  double total = 0;
  for (const double w : l->weights_) total += w;
  for (double& w : l->weights_) w /= total;
  if (known != nullptr) {
    l->tokenizer_ = known->tokenizer();
    l->end_of_document_ = known->end_of_document();
  } else {
    l->tokenizer_ = TokenizerInfo{.kind = "unknown"};
  }
  if (options.vocab == 0 && l->tokenizer_.vocab == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": the data does not record its tokenizer (a Megatron dataset without a ",
        "PREFIX.meta.json, e.g. from preprocess_data.py); set model.vocab to its tokenizer's "
        "vocabulary size"));
  }
  l->position_.drawn.assign(l->sources_.size(), 0);
  l->window_.resize(static_cast<size_t>(seq) + 1);
  return l;
}

int64_t Loader::WindowStart(size_t d, uint64_t k) const {
  const uint64_t w = static_cast<uint64_t>(windows_[d]);
  const uint64_t epoch = k / w, slot = k % w;
  const uint64_t seq = static_cast<uint64_t>(options_.seq_len);
  if (!options_.shuffle) return static_cast<int64_t>(slot * seq);
  const uint64_t key = EpochKey(options_.seed, d, epoch);
  const uint64_t shift = base::SplitMix64(key ^ 0x5851f42d4c957f2dULL) % seq;
  return static_cast<int64_t>(shift + Permute(slot, w, key) * seq);
}

Loader::Draw Loader::DrawAt(uint64_t n, std::vector<uint64_t>& drawn) const {
  size_t best = 0;
  if (sources_.size() > 1) {
    // Megatron's build_blending_indices, with the same ties (the first dataset wins).
    const double x = static_cast<double>(std::max<uint64_t>(n, 1));
    double best_error = weights_[0] * x - static_cast<double>(drawn[0]);
    for (size_t d = 1; d < sources_.size(); ++d) {
      const double error = weights_[d] * x - static_cast<double>(drawn[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
  }
  const uint64_t k = drawn[best]++;
  return {best, WindowStart(best, k)};
}

absl::Status Loader::Next(int first_row, int rows, Batch& out) {
  const int seq = options_.seq_len;
  if (first_row < 0 || rows < 0 || first_row + rows > options_.batch) {
    return absl::InvalidArgumentError(absl::StrCat("rows [", first_row, ", ", first_row + rows,
                                                   ") are outside the microbatch of ",
                                                   options_.batch));
  }
  const int32_t vocab = options_.vocab > 0 ? options_.vocab : tokenizer_.vocab;
  out.batch = rows;
  out.seq_len = seq;
  const size_t cells = static_cast<size_t>(rows) * static_cast<size_t>(seq);
  out.inputs.resize(cells);
  out.targets.resize(cells);
  out.segment_starts.clear();
  for (int b = 0; b < options_.batch; ++b) {
    const Draw draw = DrawAt(position_.samples++, position_.drawn);
    if (b < first_row || b >= first_row + rows) continue;
    const TokenSource& src = *sources_[draw.dataset];
    src.Read(draw.start, seq + 1, window_.data());
    for (int t = 0; t <= seq; ++t) {
      const int32_t id = window_[static_cast<size_t>(t)];
      if (id < 0 || id >= vocab) {
        return absl::InvalidArgumentError(
            absl::StrCat(options_.field, ": '", src.path(), "' holds token id ", id, " at token ",
                         draw.start + t, ", outside the vocabulary [0, ", vocab,
                         "); the data was made with another tokenizer than model.vocab says"));
      }
    }
    const size_t row = static_cast<size_t>(b - first_row) * static_cast<size_t>(seq);
    out.segment_starts.push_back(static_cast<int32_t>(row));
    std::copy(window_.begin(), window_.end() - 1, out.inputs.begin() + static_cast<ptrdiff_t>(row));
    std::copy(window_.begin() + 1, window_.end(),
              out.targets.begin() + static_cast<ptrdiff_t>(row));
    if (end_of_document_ >= 0) {
      for (int t = 1; t < seq; ++t) {
        if (window_[static_cast<size_t>(t)] == end_of_document_) {
          out.segment_starts.push_back(static_cast<int32_t>(row + static_cast<size_t>(t)));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status Loader::Restore(const LoaderPosition& position) {
  uint64_t sum = 0;
  for (const uint64_t d : position.drawn) sum += d;
  if (position.drawn.size() != sources_.size() || sum != position.samples) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the loader position (", position.samples, " samples from ", position.drawn.size(),
        " datasets) does not fit this blend of ", sources_.size(), " datasets"));
  }
  position_ = position;
  return absl::OkStatus();
}

std::string Loader::SavePosition() const {
  nlohmann::json datasets = nlohmann::json::array();
  for (size_t d = 0; d < sources_.size(); ++d) {
    datasets.push_back({{"path", sources_[d]->path()},
                        {"tokens", sources_[d]->tokens()},
                        {"weight", weights_[d]}});
  }
  const nlohmann::json j = {{"samples", position_.samples},
                            {"drawn", position_.drawn},
                            {"seq_len", options_.seq_len},
                            {"seed", options_.seed},
                            {"datasets", datasets}};
  return j.dump();
}

absl::Status Loader::RestorePosition(std::string_view json) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  const auto bad = [](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("the checkpoint's data position is damaged: ", why));
  };
  if (!j.is_object() || !j.contains("samples") || !j["samples"].is_number_unsigned() ||
      !j.contains("drawn") || !j["drawn"].is_array() || !j.contains("datasets") ||
      !j["datasets"].is_array()) {
    return bad("missing fields");
  }
  const auto describe = [](const std::vector<std::string>& parts) {
    return absl::StrJoin(parts, ", ");
  };
  std::vector<std::string> theirs, ours;
  bool same = j["datasets"].size() == sources_.size();
  for (size_t d = 0; d < j["datasets"].size(); ++d) {
    const nlohmann::json& e = j["datasets"][d];
    if (!e.is_object() || !e.contains("tokens") || !e.contains("weight") || !e.contains("path")) {
      return bad("a dataset entry lacks tokens, weight or path");
    }
    theirs.push_back(absl::StrCat(e["weight"].get<double>(), " x '", e["path"].get<std::string>(),
                                  "' (", e["tokens"].get<int64_t>(), " tokens)"));
    if (same && (e["tokens"].get<int64_t>() != sources_[d]->tokens() ||
                 e["weight"].get<double>() != weights_[d])) {
      same = false;
    }
  }
  for (size_t d = 0; d < sources_.size(); ++d) {
    ours.push_back(absl::StrCat(weights_[d], " x '", sources_[d]->path(), "' (",
                                sources_[d]->tokens(), " tokens)"));
  }
  if (!same) {
    return absl::InvalidArgumentError(
        absl::StrCat(options_.field, ": the checkpoint's data position belongs to other data (",
                     describe(theirs), ") than this job's (", describe(ours),
                     "); resume with the data it was written with"));
  }
  if (j.value("seq_len", 0) != options_.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat(options_.field, ": the checkpoint's data position was recorded with seq_len ",
                     j.value("seq_len", 0), ", this job has ", options_.seq_len,
                     "; resume with the spec it was written with"));
  }
  if (!j.contains("seed") || !j["seed"].is_number_unsigned()) return bad("no data seed");
  LoaderPosition p;
  p.samples = j["samples"].get<uint64_t>();
  for (const nlohmann::json& v : j["drawn"]) {
    if (!v.is_number_unsigned()) return bad("a per-dataset count is not a number");
    p.drawn.push_back(v.get<uint64_t>());
  }
  if (absl::Status s = Restore(p); !s.ok()) return s;
  // The stream continues the checkpoint's, whatever seed this job was given.
  options_.seed = j["seed"].get<uint64_t>();
  return absl::OkStatus();
}

int64_t Loader::tokens() const {
  int64_t n = 0;
  for (const auto& s : sources_) n += s->tokens();
  return n;
}

double Loader::unigram_entropy() const {
  double h = 0;
  for (size_t d = 0; d < sources_.size(); ++d) {
    if (sources_[d]->unigram_entropy() < 0) return -1;
    h += weights_[d] * sources_[d]->unigram_entropy();
  }
  return h;
}

int64_t Loader::windows_per_epoch() const {
  int64_t n = 0;
  for (const int64_t w : windows_) n += w;
  return n;
}

std::string Loader::Describe() const {
  if (sources_.size() == 1) {
    return absl::StrCat("'", sources_[0]->path(), "' (", std::string(sources_[0]->format()), ")");
  }
  std::vector<std::string> parts;
  for (size_t d = 0; d < sources_.size(); ++d) {
    parts.push_back(absl::StrFormat("%.3g %s", weights_[d], sources_[d]->path()));
  }
  return absl::StrCat(sources_.size(), " datasets (", absl::StrJoin(parts, ", "), ")");
}

}  // namespace rackrun::data
