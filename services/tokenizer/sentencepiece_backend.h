// Private to services/tokenizer: the interface the SentencePiece shim library
// implements. Abseil-free and header-only, so that both sides of the dlopen
// boundary share it without sharing any symbol.
//
// Why a shim: Debian's libsentencepiece carries its own copy of protobuf 3.14
// and exports those symbols. In a process that also links gRPC's libprotobuf
// 3.21 one of the two binds to the other's symbols and the process dies at
// start-up (segfault or protobuf version check). So libsentencepiece is only
// ever linked into `libpdserve_sentencepiece_shim.so`, which the tokenizer
// opens with dlopen(RTLD_LOCAL | RTLD_DEEPBIND): sentencepiece resolves its
// own protobuf first, and nothing of it enters the global symbol scope. The
// only symbol looked up is the factory below; all calls are virtual.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pdserve::tokenizer::internal {

// A SentencePiece status; `code` uses absl::StatusCode numbering (SentencePiece
// mirrors it value for value).
struct SpStatus {
  int code = 0;
  std::string message;
  bool ok() const { return code == 0; }
};

class SentencePieceBackend {
 public:
  virtual ~SentencePieceBackend() = default;
  virtual SpStatus LoadFromSerializedProto(std::string_view serialized) = 0;
  virtual SpStatus Load(const std::string& path) = 0;
  virtual SpStatus Encode(std::string_view text,
                          std::vector<int>* ids) const = 0;
  virtual SpStatus Decode(const std::vector<int>& ids,
                          std::string* text) const = 0;
  virtual int GetPieceSize() const = 0;
  virtual const std::string& IdToPiece(int id) const = 0;
  virtual float GetScore(int id) const = 0;
  virtual bool IsByte(int id) const = 0;
  virtual bool IsControl(int id) const = 0;
  virtual bool IsUnknown(int id) const = 0;
  virtual bool IsUnused(int id) const = 0;
  virtual int bos_id() const = 0;
  virtual int eos_id() const = 0;
  virtual int unk_id() const = 0;
  virtual int pad_id() const = 0;
};

}  // namespace pdserve::tokenizer::internal

// Exported by the shim; returns a new backend owned by the caller.
extern "C" {
using PdserveCreateSentencePieceBackendFn =
    pdserve::tokenizer::internal::SentencePieceBackend* (*)();
}
inline constexpr char kPdserveSentencePieceFactorySymbol[] =
    "pdserve_create_sentencepiece_backend";
inline constexpr char kPdserveSentencePieceShimName[] =
    "libpdserve_sentencepiece_shim.so";
