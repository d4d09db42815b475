// Deliberately includes no Abseil header: see sentencepiece_wrapper.h.
#include "tokenizer/sentencepiece_wrapper.h"

#include <sentencepiece_processor.h>

namespace pdserve::tokenizer::internal {
namespace {

SpStatus Convert(const sentencepiece::util::Status& s) {
  if (s.ok()) return {};
  return SpStatus{static_cast<int>(s.code()), s.message()};
}

}  // namespace

SentencePieceModel::SentencePieceModel()
    : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
SentencePieceModel::~SentencePieceModel() = default;

SpStatus SentencePieceModel::LoadFromSerializedProto(
    std::string_view serialized) {
  return Convert(sp_->LoadFromSerializedProto(serialized));
}
SpStatus SentencePieceModel::Load(const std::string& path) {
  return Convert(sp_->Load(path));
}

SpStatus SentencePieceModel::Encode(std::string_view text,
                                    std::vector<int>* ids) const {
  return Convert(sp_->Encode(text, ids));
}
SpStatus SentencePieceModel::Decode(const std::vector<int>& ids,
                                    std::string* text) const {
  return Convert(sp_->Decode(ids, text));
}

int SentencePieceModel::GetPieceSize() const { return sp_->GetPieceSize(); }
const std::string& SentencePieceModel::IdToPiece(int id) const {
  return sp_->IdToPiece(id);
}
float SentencePieceModel::GetScore(int id) const { return sp_->GetScore(id); }
bool SentencePieceModel::IsByte(int id) const { return sp_->IsByte(id); }
bool SentencePieceModel::IsControl(int id) const { return sp_->IsControl(id); }
bool SentencePieceModel::IsUnknown(int id) const { return sp_->IsUnknown(id); }
bool SentencePieceModel::IsUnused(int id) const { return sp_->IsUnused(id); }
int SentencePieceModel::bos_id() const { return sp_->bos_id(); }
int SentencePieceModel::eos_id() const { return sp_->eos_id(); }
int SentencePieceModel::unk_id() const { return sp_->unk_id(); }
int SentencePieceModel::pad_id() const { return sp_->pad_id(); }

}  // namespace pdserve::tokenizer::internal
