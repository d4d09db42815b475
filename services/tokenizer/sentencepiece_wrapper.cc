// Deliberately includes no Abseil header: see sentencepiece_wrapper.h.
#include "tokenizer/sentencepiece_wrapper.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>

namespace pdserve::tokenizer::internal {
namespace {

constexpr int kFailedPrecondition = 9;  // absl::StatusCode::kFailedPrecondition

struct ShimLibrary {
  PdserveCreateSentencePieceBackendFn create = nullptr;
  std::string error;
};

std::string ExecutableDirectory() {
  char path[4096];
  ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return "";
  std::string exe(path, static_cast<size_t>(n));
  return exe.substr(0, exe.rfind('/'));
}

// Opens the shim once per process. Where to find it, first hit wins:
// $PDSERVE_SENTENCEPIECE_SHIM, next to the executable, the build tree.
const ShimLibrary& Shim() {
  static const ShimLibrary* shim = [] {
    auto* result = new ShimLibrary();
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("PDSERVE_SENTENCEPIECE_SHIM");
        env != nullptr && *env != '\0') {
      candidates.push_back(env);
    }
    candidates.push_back(ExecutableDirectory() + "/" +
                         kPdserveSentencePieceShimName);
#ifdef PDSERVE_SENTENCEPIECE_SHIM_PATH
    candidates.push_back(PDSERVE_SENTENCEPIECE_SHIM_PATH);
#endif
    int flags = RTLD_NOW | RTLD_LOCAL;
#if !defined(__SANITIZE_ADDRESS__)
    // Sanitizer runtimes refuse RTLD_DEEPBIND; sanitizer builds therefore
    // cannot host gRPC and the tokenizer in one process (no test does).
    flags |= RTLD_DEEPBIND;
#endif
    for (const std::string& path : candidates) {
      if (::access(path.c_str(), R_OK) != 0) continue;
      void* handle = ::dlopen(path.c_str(), flags);
      if (handle == nullptr) {
        result->error += path + ": " + ::dlerror() + "; ";
        continue;
      }
      auto create = reinterpret_cast<PdserveCreateSentencePieceBackendFn>(
          ::dlsym(handle, kPdserveSentencePieceFactorySymbol));
      if (create == nullptr) {
        result->error += path + ": no factory symbol; ";
        continue;
      }
      result->create = create;  // the handle stays open for the process
      return result;
    }
    result->error = "cannot load " +
                    std::string(kPdserveSentencePieceShimName) +
                    " (set PDSERVE_SENTENCEPIECE_SHIM or install it next to "
                    "the executable): " +
                    result->error;
    return result;
  }();
  return *shim;
}

SpStatus ShimMissing() { return SpStatus{kFailedPrecondition, Shim().error}; }

const std::string& EmptyPiece() {
  static const std::string* empty = new std::string();
  return *empty;
}

}  // namespace

SentencePieceModel::SentencePieceModel() {
  if (Shim().create != nullptr) sp_.reset(Shim().create());
}
SentencePieceModel::~SentencePieceModel() = default;

SpStatus SentencePieceModel::LoadFromSerializedProto(
    std::string_view serialized) {
  if (!sp_) return ShimMissing();
  return sp_->LoadFromSerializedProto(serialized);
}
SpStatus SentencePieceModel::Load(const std::string& path) {
  if (!sp_) return ShimMissing();
  return sp_->Load(path);
}

// A model is only used after a successful Load*, so sp_ is set below.
SpStatus SentencePieceModel::Encode(std::string_view text,
                                    std::vector<int>* ids) const {
  if (!sp_) return ShimMissing();
  return sp_->Encode(text, ids);
}
SpStatus SentencePieceModel::Decode(const std::vector<int>& ids,
                                    std::string* text) const {
  if (!sp_) return ShimMissing();
  return sp_->Decode(ids, text);
}

int SentencePieceModel::GetPieceSize() const {
  return sp_ ? sp_->GetPieceSize() : 0;
}
const std::string& SentencePieceModel::IdToPiece(int id) const {
  return sp_ ? sp_->IdToPiece(id) : EmptyPiece();
}
float SentencePieceModel::GetScore(int id) const {
  return sp_ ? sp_->GetScore(id) : 0.0f;
}
bool SentencePieceModel::IsByte(int id) const { return sp_ && sp_->IsByte(id); }
bool SentencePieceModel::IsControl(int id) const {
  return sp_ && sp_->IsControl(id);
}
bool SentencePieceModel::IsUnknown(int id) const {
  return sp_ && sp_->IsUnknown(id);
}
bool SentencePieceModel::IsUnused(int id) const {
  return sp_ && sp_->IsUnused(id);
}
int SentencePieceModel::bos_id() const { return sp_ ? sp_->bos_id() : -1; }
int SentencePieceModel::eos_id() const { return sp_ ? sp_->eos_id() : -1; }
int SentencePieceModel::unk_id() const { return sp_ ? sp_->unk_id() : -1; }
int SentencePieceModel::pad_id() const { return sp_ ? sp_->pad_id() : -1; }

}  // namespace pdserve::tokenizer::internal
