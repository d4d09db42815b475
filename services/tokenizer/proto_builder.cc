// Why a hand-written protobuf wire encoder instead of a .proto compiled by
// protoc: we only ever *write* a handful of scalar/string fields of one
// message, which takes ~40 lines of code; Debian's libsentencepiece already
// links its own copy of the generated `sentencepiece.ModelProto` (protobuf
// lite), so generating a second message with the same full name risks
// duplicate-registration/ODR trouble, and a protoc step would also tie our
// build to the exact libprotobuf version. Field numbers below are those of
// sentencepiece_model.proto, confirmed by `protoc --decode_raw` on the
// stories260K tokenizer.model (which this encoder reproduces byte for byte).
#include "tokenizer/proto_builder.h"

#include <cstring>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::tokenizer {
namespace {

// ModelProto
constexpr int kModelPieces = 1;
constexpr int kModelTrainerSpec = 2;
constexpr int kModelNormalizerSpec = 3;
// ModelProto.SentencePiece
constexpr int kPiecePiece = 1;
constexpr int kPieceScore = 2;
constexpr int kPieceType = 3;
// TrainerSpec
constexpr int kTrainerModelType = 3;
constexpr int kTrainerVocabSize = 4;
constexpr int kTrainerByteFallback = 35;
constexpr int kTrainerUnkId = 40;
constexpr int kTrainerBosId = 41;
constexpr int kTrainerEosId = 42;
constexpr int kTrainerPadId = 43;
constexpr int kTrainerUnkPiece = 45;
constexpr int kTrainerBosPiece = 46;
constexpr int kTrainerEosPiece = 47;
constexpr int kTrainerPadPiece = 48;
constexpr int kModelTypeBpe = 2;
// NormalizerSpec
constexpr int kNormName = 1;
constexpr int kNormAddDummyPrefix = 3;
constexpr int kNormRemoveExtraWhitespaces = 4;
constexpr int kNormEscapeWhitespaces = 5;

enum WireType { kVarint = 0, kFixed32 = 5, kLengthDelimited = 2 };

class WireWriter {
 public:
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>((v & 0x7F) | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void Tag(int field, WireType type) {
    Varint((static_cast<uint64_t>(field) << 3) | type);
  }
  // proto2 int32/enum: negative values are sign-extended to 64 bits.
  void Int32(int field, int32_t v) {
    Tag(field, kVarint);
    Varint(static_cast<uint64_t>(static_cast<int64_t>(v)));
  }
  void Bool(int field, bool v) {
    Tag(field, kVarint);
    Varint(v ? 1 : 0);
  }
  void Float(int field, float v) {
    Tag(field, kFixed32);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    for (int i = 0; i < 4; ++i)
      out_.push_back(static_cast<char>(bits >> (8 * i)));
  }
  void Bytes(int field, std::string_view v) {
    Tag(field, kLengthDelimited);
    Varint(v.size());
    out_.append(v);
  }
  const std::string& str() const { return out_; }

 private:
  std::string out_;
};

bool IsBytePiece(std::string_view piece) {
  // SentencePiece requires byte pieces to be spelled exactly "<0xXX>".
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>')
    return false;
  auto hex = [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F');
  };
  return hex(piece[3]) && hex(piece[4]);
}

}  // namespace

absl::StatusOr<std::string> BuildSentencePieceModelProto(
    const model::TokenizerSpec& spec) {
  if (spec.ggml_model != "llama") {
    return absl::UnimplementedError(
        absl::StrCat("tokenizer.ggml.model \"", spec.ggml_model,
                     "\" is not supported; only \"llama\" (SentencePiece) "
                     "vocabularies are"));
  }
  const size_t n = spec.tokens.size();
  if (n == 0)
    return absl::InvalidArgumentError("tokenizer.ggml.tokens is empty");
  if (spec.scores.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.ggml.scores has ", spec.scores.size(),
                     " entries but tokenizer.ggml.tokens has ", n));
  }
  if (spec.token_types.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.ggml.token_type has ", spec.token_types.size(),
                     " entries but tokenizer.ggml.tokens has ", n));
  }
  if (n > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("tokenizer.ggml.tokens is too large");
  }
  auto check_id = [n](const char* name, int32_t id) -> absl::Status {
    if (id < -1 || id >= static_cast<int64_t>(n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.ggml.", name, " = ", id,
                       " is outside the vocabulary of ", n));
    }
    return absl::OkStatus();
  };
  for (auto [name, id] : {std::pair{"bos_token_id", spec.bos_token_id},
                          std::pair{"eos_token_id", spec.eos_token_id},
                          std::pair{"unknown_token_id", spec.unk_token_id},
                          std::pair{"padding_token_id", spec.pad_token_id}}) {
    if (absl::Status s = check_id(name, id); !s.ok()) return s;
  }

  WireWriter model;
  bool has_byte_pieces = false;
  int32_t first_unknown = -1;
  for (size_t i = 0; i < n; ++i) {
    int32_t type = spec.token_types[i];
    if (type == 0) type = static_cast<int32_t>(PieceType::kNormal);
    if (type < static_cast<int32_t>(PieceType::kNormal) ||
        type > static_cast<int32_t>(PieceType::kByte)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokenizer.ggml.token_type[", i, "] = ", spec.token_types[i],
          " is not a known token type (0..6)"));
    }
    if (spec.tokens[i].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.ggml.tokens[", i, "] is empty"));
    }
    if (type == static_cast<int32_t>(PieceType::kByte)) {
      if (!IsBytePiece(spec.tokens[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.ggml.tokens[", i, "] = \"", spec.tokens[i],
                         "\" has byte type but is not <0xXX>"));
      }
      has_byte_pieces = true;
    }
    if (type == static_cast<int32_t>(PieceType::kUnknown) &&
        first_unknown < 0) {
      first_unknown = static_cast<int32_t>(i);
    }
    WireWriter piece;
    piece.Bytes(kPiecePiece, spec.tokens[i]);
    piece.Float(kPieceScore, spec.scores[i]);
    piece.Int32(kPieceType, type);
    model.Bytes(kModelPieces, piece.str());
  }
  if (first_unknown < 0) {
    // SentencePiece refuses to load a model without an unknown piece; say so
    // in GGUF terms rather than surfacing its internal message.
    return absl::InvalidArgumentError(
        "tokenizer.ggml.token_type marks no token as unknown (type 2)");
  }

  const int32_t unk_id =
      spec.unk_token_id >= 0 ? spec.unk_token_id : first_unknown;
  WireWriter trainer;
  trainer.Int32(kTrainerModelType, kModelTypeBpe);
  trainer.Int32(kTrainerVocabSize, static_cast<int32_t>(n));
  if (has_byte_pieces) trainer.Bool(kTrainerByteFallback, true);
  trainer.Int32(kTrainerUnkId, unk_id);
  trainer.Int32(kTrainerBosId, spec.bos_token_id);
  trainer.Int32(kTrainerEosId, spec.eos_token_id);
  trainer.Int32(kTrainerPadId, spec.pad_token_id);
  // SentencePieceProcessor::bos_id()/eos_id()/... look the special tokens up
  // by *piece* (default "<unk>", "<s>", "</s>", "<pad>"), not by id; name the
  // pieces only when they differ so the common case matches tokenizer.model.
  auto maybe_piece = [&](int field, int32_t id,
                         std::string_view default_piece) {
    if (id >= 0 && spec.tokens[id] != default_piece)
      trainer.Bytes(field, spec.tokens[id]);
  };
  maybe_piece(kTrainerUnkPiece, unk_id, "<unk>");
  maybe_piece(kTrainerBosPiece, spec.bos_token_id, "<s>");
  maybe_piece(kTrainerEosPiece, spec.eos_token_id, "</s>");
  maybe_piece(kTrainerPadPiece, spec.pad_token_id, "<pad>");
  model.Bytes(kModelTrainerSpec, trainer.str());

  // llama's normalizer: no Unicode normalization, a dummy-prefix space, keep
  // runs of spaces, and spell spaces as U+2581.
  WireWriter normalizer;
  normalizer.Bytes(kNormName, "identity");
  normalizer.Bool(kNormAddDummyPrefix, true);
  normalizer.Bool(kNormRemoveExtraWhitespaces, false);
  normalizer.Bool(kNormEscapeWhitespaces, true);
  model.Bytes(kModelNormalizerSpec, normalizer.str());
  return model.str();
}

}  // namespace pdserve::tokenizer
