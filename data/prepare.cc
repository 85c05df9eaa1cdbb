#include "data/prepare.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rackrun::data {
namespace {

constexpr size_t kBatchBytes = size_t{1} << 20;

struct Batch {
  uint64_t seq = 0;
  std::vector<Document> docs;
  std::vector<bool> validation;  // per document
  std::vector<std::vector<int32_t>> tokens;
  size_t bytes = 0;
};

// The queues between the reader, the tokenizing workers and the writer, and the first error.
class Pipeline {
 public:
  explicit Pipeline(size_t limit) : limit_(limit) {}

  // Reader: blocks while `limit` batches are in flight; false once the pipeline failed.
  bool Push(std::unique_ptr<Batch> batch) {
    std::unique_lock lock(mu_);
    space_.wait(lock, [&] { return in_flight_ < limit_ || failed_; });
    if (failed_) return false;
    ++in_flight_;
    batch->seq = pushed_++;
    work_.push_back(std::move(batch));
    work_ready_.notify_one();
    return true;
  }
  void CloseInput() {
    std::lock_guard lock(mu_);
    closed_ = true;
    work_ready_.notify_all();
    done_ready_.notify_all();
  }
  // Worker: the next batch, or null when there is no more work.
  std::unique_ptr<Batch> TakeWork() {
    std::unique_lock lock(mu_);
    work_ready_.wait(lock, [&] { return !work_.empty() || closed_ || failed_; });
    if (failed_ || work_.empty()) return nullptr;
    std::unique_ptr<Batch> b = std::move(work_.front());
    work_.pop_front();
    return b;
  }
  void Done(std::unique_ptr<Batch> batch) {
    std::lock_guard lock(mu_);
    done_[batch->seq] = std::move(batch);
    done_ready_.notify_all();
  }
  // Writer: batch `seq` once tokenized; null when the input ended before it or on failure.
  std::unique_ptr<Batch> TakeDone(uint64_t seq) {
    std::unique_lock lock(mu_);
    done_ready_.wait(
        lock, [&] { return done_.count(seq) > 0 || failed_ || (closed_ && seq >= pushed_); });
    if (failed_ || done_.count(seq) == 0) return nullptr;
    std::unique_ptr<Batch> b = std::move(done_[seq]);
    done_.erase(seq);
    return b;
  }
  void Written() {
    std::lock_guard lock(mu_);
    --in_flight_;
    space_.notify_one();
  }
  void Fail(absl::Status s) {
    std::lock_guard lock(mu_);
    if (error_.ok()) error_ = std::move(s);
    failed_ = true;
    space_.notify_all();
    work_ready_.notify_all();
    done_ready_.notify_all();
  }
  absl::Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable space_, work_ready_, done_ready_;
  std::deque<std::unique_ptr<Batch>> work_;
  std::map<uint64_t, std::unique_ptr<Batch>> done_;
  size_t in_flight_ = 0;
  uint64_t pushed_ = 0;  // batches pushed; their seqs are 0 .. pushed_ - 1
  const size_t limit_;
  bool closed_ = false;
  bool failed_ = false;
  absl::Status error_;
};

// Splits a single document for validation: the last `fraction` of its bytes, cut at a line
// break within 1% of the text when there is one.
std::pair<std::string, std::string> CutTail(const std::string& doc, double fraction) {
  size_t cut =
      doc.size() - static_cast<size_t>(std::llround(fraction * static_cast<double>(doc.size())));
  const size_t newline = doc.rfind('\n', cut);
  if (newline != std::string::npos && cut - newline <= doc.size() / 100 + 1) cut = newline + 1;
  return {doc.substr(0, cut), doc.substr(cut)};
}

// The flags PrepareDataset checks before it opens anything: the fraction and the EOS id.
absl::Status CheckOptions(double f, const Tokenizer& tokenizer) {
  if (!(f >= 0 && f <= 0.5)) {
    return absl::InvalidArgumentError(absl::StrCat("--val-fraction: ", f, " must lie in [0, 0.5]"));
  }
  const int32_t eos = tokenizer.eos_id();
  if (eos < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer ", tokenizer.info().Describe(),
                     " has no EOS id to end documents with; train it with an eos piece "
                     "(`rackrun data tokenizer --train` does)"));
  }
  return absl::OkStatus();
}

// The datasets being written: training, and validation when the fraction is above 0.
struct Writers {
  IndexedDatasetWriter train;
  std::optional<IndexedDatasetWriter> val;
};

absl::StatusOr<Writers> OpenWriters(const std::string& prefix, const std::string& val_prefix,
                                    double f, const Tokenizer& tokenizer) {
  const uint8_t dtype = MegatronDTypeForVocab(tokenizer.vocab_size());
  absl::StatusOr<IndexedDatasetWriter> train =
      IndexedDatasetWriter::Create(prefix, dtype, tokenizer.vocab_size());
  if (!train.ok()) return train.status();
  std::optional<IndexedDatasetWriter> val;
  if (f > 0) {
    absl::StatusOr<IndexedDatasetWriter> v =
        IndexedDatasetWriter::Create(val_prefix, dtype, tokenizer.vocab_size());
    if (!v.ok()) return v.status();
    val.emplace(*std::move(v));
  }
  return Writers{*std::move(train), std::move(val)};
}

// The tokenizing workers: each takes batches until there is no more work.
std::vector<std::thread> StartTokenizers(int threads, const Tokenizer& tokenizer, int32_t eos,
                                         Pipeline& pipeline) {
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&tokenizer, &pipeline, eos] {
      while (std::unique_ptr<Batch> b = pipeline.TakeWork()) {
        b->tokens.resize(b->docs.size());
        for (size_t i = 0; i < b->docs.size(); ++i) {
          std::vector<int32_t>& ids = b->tokens[i];
          if (absl::Status s = tokenizer.Encode(b->docs[i].text, ids); !s.ok()) {
            pipeline.Fail(absl::InvalidArgumentError(
                absl::StrCat(b->docs[i].file, ":", b->docs[i].line, ": ", s.message())));
            return;
          }
          ids.push_back(eos);
          b->docs[i].text = std::string();  // frees the text early
        }
        pipeline.Done(std::move(b));
      }
    });
  }
  return workers;
}

// The writer: appends the tokenized batches in input order.
std::thread StartWriter(Pipeline& pipeline, Writers& writers, std::atomic<int64_t>& tokens_written,
                        std::atomic<int64_t>& docs_written) {
  return std::thread([&pipeline, &writers, &tokens_written, &docs_written] {
    for (uint64_t seq = 0;; ++seq) {
      std::unique_ptr<Batch> b = pipeline.TakeDone(seq);
      if (b == nullptr) return;
      for (size_t i = 0; i < b->tokens.size(); ++i) {
        IndexedDatasetWriter& w = b->validation[i] ? *writers.val : writers.train;
        if (absl::Status s = w.AddDocument(b->tokens[i]); !s.ok()) {
          pipeline.Fail(absl::InvalidArgumentError(
              absl::StrCat(b->docs[i].file, ":", b->docs[i].line, ": ", s.message())));
          return;
        }
        tokens_written += static_cast<int64_t>(b->tokens[i].size());
        ++docs_written;
      }
      pipeline.Written();
    }
  });
}

// Reads every document into batches for the pipeline, with one document of lookahead (the
// last one's destination depends on the end), calling `progress` about every 0.2 s; a read
// error fails the pipeline. Returns the number of documents read.
int64_t ReadDocuments(DocumentReader& reader, double f, Pipeline& pipeline,
                      const std::function<void()>& progress) {
  auto batch = std::make_unique<Batch>();
  const auto flush = [&]() -> bool {
    if (batch->docs.empty()) return true;
    if (!pipeline.Push(std::move(batch))) return false;
    batch = std::make_unique<Batch>();
    return true;
  };
  const auto route = [&](Document doc, bool to_validation) -> bool {
    batch->bytes += doc.text.size();
    batch->docs.push_back(std::move(doc));
    batch->validation.push_back(to_validation);
    return batch->bytes < kBatchBytes || flush();
  };
  const size_t period = f > 0 ? std::max<size_t>(2, static_cast<size_t>(std::llround(1.0 / f))) : 0;
  const auto is_validation = [&](int64_t index) {
    return period > 0 && static_cast<size_t>(index) % period == period - 1;
  };
  std::optional<Document> held;
  int64_t count = 0, to_validation = 0;
  auto last_progress = std::chrono::steady_clock::now();
  bool ok = true;
  absl::Status read_error;
  while (ok) {
    Document doc;
    absl::StatusOr<bool> got = reader.Next(doc);
    if (!got.ok()) {
      read_error = got.status();
      break;
    }
    if (!*got) break;
    if (held.has_value()) {
      const bool v = is_validation(count - 1);
      to_validation += v;
      ok = route(*std::move(held), v);
    }
    held = std::move(doc);
    ++count;
    if (std::chrono::steady_clock::now() - last_progress > std::chrono::milliseconds(200)) {
      progress();
      last_progress = std::chrono::steady_clock::now();
    }
  }
  if (ok && read_error.ok() && held.has_value()) {
    if (count == 1 && f > 0) {
      auto [head, tail] = CutTail(held->text, f);
      Document tail_doc{std::move(tail), held->file, held->line};
      held->text = std::move(head);
      if (!held->text.empty()) ok = route(*std::move(held), false);
      if (ok && !tail_doc.text.empty()) {
        ++to_validation;
        ok = route(std::move(tail_doc), true);
      }
    } else {
      const bool v = f > 0 && (to_validation == 0 || is_validation(count - 1));
      to_validation += v;
      ok = route(*std::move(held), v);
    }
  }
  if (ok && read_error.ok()) ok = flush();
  if (!read_error.ok()) pipeline.Fail(read_error);
  return count;
}

// Checks that both sets got documents, finishes them and reads back their records.
absl::StatusOr<PrepareResult> FinishDatasets(const std::string& input, const std::string& prefix,
                                             const std::string& val_prefix, double f, int64_t count,
                                             const DocumentReader& reader, const DatasetInfo& info,
                                             Writers& writers) {
  std::optional<IndexedDatasetWriter>& val = writers.val;
  if (count == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--input: '", input, "' holds no text",
        reader.skipped_documents() > 0
            ? absl::StrCat(" (", reader.skipped_documents(), " documents skipped as invalid UTF-8)")
            : ""));
  }
  if (writers.train.documents() == 0 || (val.has_value() && val->documents() == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--val-fraction ", f, " leaves the ",
                     writers.train.documents() == 0 ? "training" : "validation", " set of '", input,
                     "' empty; use a larger fraction or more input text"));
  }
  PrepareResult result;
  result.bytes = reader.bytes_read();
  result.skipped_documents = reader.skipped_documents();
  if (absl::Status s = writers.train.Finish(info); !s.ok()) return s;
  result.train.prefix = prefix;
  if (val.has_value()) {
    if (absl::Status s = val->Finish(info); !s.ok()) return s;
    result.validation = PreparedDataset{.prefix = val_prefix, .info = {}};
  }
  // The records as written (counts and entropy filled in by Finish).
  for (PreparedDataset* d : {&result.train, result.validation ? &*result.validation : nullptr}) {
    if (d == nullptr) continue;
    absl::StatusOr<IndexedDataset> opened = IndexedDataset::Open(d->prefix);
    if (!opened.ok()) return opened.status();
    d->info = *opened->info();
  }
  return result;
}

}  // namespace

absl::StatusOr<PrepareResult> PrepareDataset(const std::string& input, const std::string& prefix,
                                             const std::string& val_prefix,
                                             const PrepareOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  };
  const Tokenizer& tokenizer = *options.tokenizer;
  const double f = options.val_fraction;
  if (absl::Status s = CheckOptions(f, tokenizer); !s.ok()) return s;
  const int32_t eos = tokenizer.eos_id();
  absl::StatusOr<DocumentReader> reader = DocumentReader::Open(input, options.corpus);
  if (!reader.ok()) return reader.status();
  absl::StatusOr<Writers> writers = OpenWriters(prefix, val_prefix, f, tokenizer);
  if (!writers.ok()) return writers.status();

  const int threads = options.threads > 0
                          ? options.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Pipeline pipeline(2 * static_cast<size_t>(threads) + 2);
  std::atomic<int64_t> tokens_written{0}, docs_written{0};
  std::vector<std::thread> workers = StartTokenizers(threads, tokenizer, eos, pipeline);
  std::thread writer = StartWriter(pipeline, *writers, tokens_written, docs_written);
  const auto progress = [&] {
    if (options.on_progress) {
      options.on_progress({.bytes_read = reader->bytes_read(),
                           .total_bytes = reader->total_bytes(),
                           .documents = docs_written.load(),
                           .tokens = tokens_written.load(),
                           .seconds = elapsed()});
    }
  };
  const int64_t count = ReadDocuments(*reader, f, pipeline, progress);
  pipeline.CloseInput();
  for (std::thread& t : workers) t.join();
  writer.join();
  progress();
  if (absl::Status s = pipeline.error(); !s.ok()) return s;

  DatasetInfo info{.tokenizer = tokenizer.info(), .end_of_document = eos, .sources = {input}};
  absl::StatusOr<PrepareResult> result =
      FinishDatasets(input, prefix, val_prefix, f, count, *reader, info, *writers);
  if (!result.ok()) return result.status();
  result->threads = threads;
  result->seconds = elapsed();
  return result;
}

}  // namespace rackrun::data
