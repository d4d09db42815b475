// Private to services/tokenizer: a narrow, Abseil-free face of
// sentencepiece::SentencePieceProcessor, served by the shim library that
// sentencepiece_backend.h explains.
//
// Why: Debian's sentencepiece_processor.h declares
// `namespace absl { using std::string_view; }`, which collides with Abseil's
// own absl::string_view ("reference to 'string_view' is ambiguous") in any
// translation unit that includes both. So only sentencepiece_wrapper.cc sees
// the SentencePiece header, and it includes no Abseil header.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/sentencepiece_backend.h"

namespace pdserve::tokenizer::internal {

class SentencePieceModel {
 public:
  SentencePieceModel();
  ~SentencePieceModel();
  SentencePieceModel(const SentencePieceModel&) = delete;
  SentencePieceModel& operator=(const SentencePieceModel&) = delete;

  SpStatus LoadFromSerializedProto(std::string_view serialized);
  SpStatus Load(const std::string& path);

  // Thread-safe after loading.
  SpStatus Encode(std::string_view text, std::vector<int>* ids) const;
  SpStatus Decode(const std::vector<int>& ids, std::string* text) const;

  int GetPieceSize() const;
  const std::string& IdToPiece(int id) const;
  float GetScore(int id) const;
  bool IsByte(int id) const;
  bool IsControl(int id) const;
  bool IsUnknown(int id) const;
  bool IsUnused(int id) const;
  int bos_id() const;
  int eos_id() const;
  int unk_id() const;
  int pad_id() const;

 private:
  // Null when the shim could not be loaded; every call then reports why.
  std::unique_ptr<SentencePieceBackend> sp_;
};

}  // namespace pdserve::tokenizer::internal
