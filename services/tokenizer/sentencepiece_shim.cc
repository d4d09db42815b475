// The only code that links libsentencepiece (see sentencepiece_backend.h).
// Built as a module library; deliberately includes no Abseil header
// (Debian's sentencepiece_processor.h declares its own absl::string_view).
#include <sentencepiece_processor.h>

#include <memory>

#include "tokenizer/sentencepiece_backend.h"

namespace pdserve::tokenizer::internal {
namespace {

SpStatus Convert(const sentencepiece::util::Status& s) {
  if (s.ok()) return {};
  return SpStatus{static_cast<int>(s.code()), s.message()};
}

class LibrarySentencePiece final : public SentencePieceBackend {
 public:
  SpStatus LoadFromSerializedProto(std::string_view serialized) override {
    return Convert(sp_.LoadFromSerializedProto(serialized));
  }
  SpStatus Load(const std::string& path) override {
    return Convert(sp_.Load(path));
  }
  SpStatus Encode(std::string_view text, std::vector<int>* ids) const override {
    return Convert(sp_.Encode(text, ids));
  }
  SpStatus Decode(const std::vector<int>& ids,
                  std::string* text) const override {
    return Convert(sp_.Decode(ids, text));
  }
  int GetPieceSize() const override { return sp_.GetPieceSize(); }
  const std::string& IdToPiece(int id) const override {
    return sp_.IdToPiece(id);
  }
  float GetScore(int id) const override { return sp_.GetScore(id); }
  bool IsByte(int id) const override { return sp_.IsByte(id); }
  bool IsControl(int id) const override { return sp_.IsControl(id); }
  bool IsUnknown(int id) const override { return sp_.IsUnknown(id); }
  bool IsUnused(int id) const override { return sp_.IsUnused(id); }
  int bos_id() const override { return sp_.bos_id(); }
  int eos_id() const override { return sp_.eos_id(); }
  int unk_id() const override { return sp_.unk_id(); }
  int pad_id() const override { return sp_.pad_id(); }

 private:
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace
}  // namespace pdserve::tokenizer::internal

extern "C" __attribute__((visibility("default")))
pdserve::tokenizer::internal::SentencePieceBackend*
pdserve_create_sentencepiece_backend() {
  return new pdserve::tokenizer::internal::LibrarySentencePiece();
}
