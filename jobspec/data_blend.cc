#include "jobspec/data_blend.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace rackrun::jobspec {
namespace {

bool IsNumber(const std::string& text, double* value) { return absl::SimpleAtod(text, value); }

// Indices of the path items of a well-formed blend (every item, or every second one).
bool PathIndices(const google::protobuf::RepeatedPtrField<std::string>& items,
                 std::vector<int>* paths) {
  double v = 0;
  int numbers = 0;
  for (const std::string& item : items) numbers += IsNumber(item, &v) ? 1 : 0;
  paths->clear();
  if (numbers == 0) {
    for (int i = 0; i < items.size(); ++i) paths->push_back(i);
    return true;
  }
  if (items.size() % 2 != 0 || numbers != items.size() / 2) return false;
  for (int i = 0; i < items.size(); i += 2) {
    if (!IsNumber(items[i], &v) || IsNumber(items[i + 1], &v)) return false;
    paths->push_back(i + 1);
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<BlendItem>> ParseBlend(
    const google::protobuf::RepeatedPtrField<std::string>& items, absl::string_view field) {
  std::vector<int> paths;
  if (!PathIndices(items, &paths)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     ": write it as Megatron's --data-path does, [W1, PATH1, W2, PATH2, ...] "
                     "(e.g. [0.3, data/a, 0.7, data/b]), or as paths only (weighed by size)"));
  }
  std::vector<BlendItem> blend;
  const bool weighted = static_cast<int>(paths.size()) != items.size();
  for (const int i : paths) {
    BlendItem b;
    b.path = items[i];
    b.weight = -1;
    if (b.path.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: an empty path"));
    }
    if (weighted) {
      (void)IsNumber(items[i - 1], &b.weight);
      if (!(b.weight > 0) || !std::isfinite(b.weight)) {
        return absl::InvalidArgumentError(absl::StrCat(field, "[", i - 1, "]: the weight of '",
                                                       b.path, "' is ", items[i - 1],
                                                       "; weights must be positive numbers"));
      }
    }
    blend.push_back(std::move(b));
  }
  return blend;
}

absl::StatusOr<std::vector<BlendItem>> TrainBlendOf(const rackrun::v1::DataSpec& data) {
  if (!data.blend().empty()) {
    if (!data.train().empty()) {
      return absl::InvalidArgumentError(
          "data.blend: give the training data either as data.train or as data.blend, not both");
    }
    return ParseBlend(data.blend(), "data.blend");
  }
  if (data.train().empty()) {
    return absl::InvalidArgumentError(
        "data.train: required (or data.blend); point it at a dataset made by `rackrun data` "
        "(its PREFIX, for PREFIX.bin + PREFIX.idx) or by Megatron's preprocess_data.py");
  }
  return std::vector<BlendItem>{{1.0, data.train()}};
}

absl::StatusOr<std::vector<BlendItem>> ValidationBlendOf(const rackrun::v1::DataSpec& data) {
  if (!data.validation_blend().empty()) {
    if (!data.validation().empty()) {
      return absl::InvalidArgumentError(
          "data.validation_blend: give the validation data either as data.validation or as "
          "data.validation_blend, not both");
    }
    return ParseBlend(data.validation_blend(), "data.validation_blend");
  }
  if (data.validation().empty()) return std::vector<BlendItem>{};
  return std::vector<BlendItem>{{1.0, data.validation()}};
}

std::vector<std::pair<std::string, const std::string*>> DataPaths(
    const rackrun::v1::JobSpec& spec) {
  const rackrun::v1::DataSpec& d = spec.data();
  std::vector<std::pair<std::string, const std::string*>> out;
  if (!d.train().empty()) out.emplace_back("data.train", &d.train());
  if (!d.validation().empty()) out.emplace_back("data.validation", &d.validation());
  for (auto [name, items] :
       {std::pair<const char*, const google::protobuf::RepeatedPtrField<std::string>*>{"data.blend",
                                                                                       &d.blend()},
        {"data.validation_blend", &d.validation_blend()}}) {
    std::vector<int> paths;
    if (!PathIndices(*items, &paths)) continue;
    for (const int i : paths) out.emplace_back(absl::StrCat(name, "[", i, "]"), &items->Get(i));
  }
  return out;
}

std::vector<std::pair<std::string, std::string*>> MutableDataPaths(rackrun::v1::JobSpec& spec) {
  std::vector<std::pair<std::string, std::string*>> out;
  // The pointers point into `spec`, which is not const.
  for (auto& [field, path] : DataPaths(spec)) {
    out.emplace_back(std::move(field), const_cast<std::string*>(path));
  }
  return out;
}

}  // namespace rackrun::jobspec
