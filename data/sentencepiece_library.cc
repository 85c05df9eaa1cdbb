#include "data/sentencepiece_library.h"

#include <dlfcn.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "data/sentencepiece_backend.h"

namespace rackrun::data::spm {
namespace {

constexpr size_t kErrorCap = 1024;

struct Module {
  RackrunSpmLoad load = nullptr;
  RackrunSpmFree free = nullptr;
  RackrunSpmInfo info = nullptr;
  RackrunSpmEncode encode = nullptr;
  RackrunSpmDecode decode = nullptr;
  RackrunSpmTrain train = nullptr;
  RackrunSpmBytes bytes = nullptr;
  RackrunSpmFreeBytes free_bytes = nullptr;
  std::string error;  // why it is not there
};

template <typename F>
bool Find(void* handle, const char* name, F* out) {
  *out = reinterpret_cast<F>(::dlsym(handle, name));
  return *out != nullptr;
}

const Module& TheModule() {
  static const Module module = [] {
    Module m;
    void* handle = ::dlmopen(LM_ID_NEWLM, RACKRUN_SENTENCEPIECE_MODULE, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = ::dlerror();
      m.error = absl::StrCat("SentencePiece is not available (cannot load ",
                             RACKRUN_SENTENCEPIECE_MODULE, ": ", why != nullptr ? why : "?",
                             "); run tools/setup (libsentencepiece-dev) and rebuild");
      return m;
    }
    if (!Find(handle, "rackrun_spm_load", &m.load) || !Find(handle, "rackrun_spm_free", &m.free) ||
        !Find(handle, "rackrun_spm_info", &m.info) ||
        !Find(handle, "rackrun_spm_encode", &m.encode) ||
        !Find(handle, "rackrun_spm_decode", &m.decode) ||
        !Find(handle, "rackrun_spm_train", &m.train) ||
        !Find(handle, "rackrun_spm_bytes", &m.bytes) ||
        !Find(handle, "rackrun_spm_free_bytes", &m.free_bytes)) {
      m.load = nullptr;
      m.error = absl::StrCat("SentencePiece module ", RACKRUN_SENTENCEPIECE_MODULE,
                             " lacks its entry points; rebuild with tools/build");
    }
    return m;  // the namespace stays loaded for the process's life
  }();
  return module;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::Load(std::string_view bytes) {
  const Module& m = TheModule();
  if (m.load == nullptr) return absl::FailedPreconditionError(m.error);
  char error[kErrorCap] = "";
  void* handle = m.load(bytes.data(), bytes.size(), error, sizeof(error));
  if (handle == nullptr) return absl::InvalidArgumentError(error);
  return std::unique_ptr<Model>(new Model(handle));
}

Model::Model(void* handle) : handle_(handle) { TheModule().info(handle_, info_); }

Model::~Model() { TheModule().free(handle_); }

absl::Status Model::Encode(std::string_view text, std::vector<int32_t>& ids) const {
  const size_t at = ids.size();
  int64_t room = static_cast<int64_t>(text.size()) + 16;
  char error[kErrorCap] = "";
  while (true) {
    ids.resize(at + static_cast<size_t>(room));
    const int64_t n = TheModule().encode(handle_, text.data(), text.size(), ids.data() + at, room,
                                         error, sizeof(error));
    if (n < 0) {
      ids.resize(at);
      return absl::InvalidArgumentError(absl::StrCat("SentencePiece cannot encode: ", error));
    }
    if (n <= room) {
      ids.resize(at + static_cast<size_t>(n));
      return absl::OkStatus();
    }
    room = n;
  }
}

absl::StatusOr<std::string> Model::Decode(std::span<const int32_t> ids) const {
  std::string text(ids.size() * 4 + 16, '\0');
  char error[kErrorCap] = "";
  while (true) {
    const int64_t n =
        TheModule().decode(handle_, ids.data(), static_cast<int64_t>(ids.size()), text.data(),
                           static_cast<int64_t>(text.size()), error, sizeof(error));
    if (n < 0)
      return absl::InvalidArgumentError(absl::StrCat("SentencePiece cannot decode: ", error));
    if (n <= static_cast<int64_t>(text.size())) {
      text.resize(static_cast<size_t>(n));
      return text;
    }
    text.resize(static_cast<size_t>(n));
  }
}

absl::StatusOr<std::string> Train(const std::string& args,
                                  const std::function<bool(std::string*)>& next) {
  const Module& m = TheModule();
  if (m.load == nullptr) return absl::FailedPreconditionError(m.error);
  struct Context {
    const std::function<bool(std::string*)>* next;
    std::string sentence;
  } context{&next, {}};
  const auto pull = [](void* c, const char** text, size_t* size) -> int {
    auto* ctx = static_cast<Context*>(c);
    if (!(*ctx->next)(&ctx->sentence)) return 0;
    *text = ctx->sentence.data();
    *size = ctx->sentence.size();
    return 1;
  };
  char error[kErrorCap] = "";
  void* model = m.train(args.data(), args.size(), pull, &context, error, sizeof(error));
  if (model == nullptr) return absl::InvalidArgumentError(error);
  std::string bytes(static_cast<size_t>(m.bytes(model, nullptr, 0)), '\0');
  m.bytes(model, bytes.data(), static_cast<int64_t>(bytes.size()));
  m.free_bytes(model);
  return bytes;
}

}  // namespace rackrun::data::spm
