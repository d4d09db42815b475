#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/mapped_file.h"
#include "common/status_macros.h"
#include "tokenizer/hf_tokenizer.h"
#include "tokenizer/proto_builder.h"
#include "tokenizer/tokenizer_internal.h"

namespace pdserve::tokenizer {
namespace {

constexpr absl::string_view kSpaceSymbol = "\xE2\x96\x81";  // U+2581 "▁"

// Debian's Abseil keeps its own absl::string_view class (not an alias of
// std::string_view), so std::string_view must be converted for StrCat & co.
absl::string_view Absl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

absl::Status FromSentencePiece(const internal::SpStatus& s,
                               std::string_view context) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.code),
                      absl::StrCat(Absl(context), ": ", s.message));
}

int HexDigit(char c) { return c <= '9' ? c - '0' : c - 'A' + 10; }

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<internal::TokenizerImpl> impl)
    : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(
    const model::TokenizerSpec& spec) {
  const bool has_hf = !spec.hf_tokenizer_json_path.empty();
  const bool has_file = !spec.sentencepiece_model_path.empty();
  const bool has_vocab = !spec.tokens.empty() || !spec.ggml_model.empty();
  if (has_hf && (has_file || has_vocab)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer spec sets both a tokenizer.json (",
                     spec.hf_tokenizer_json_path,
                     ") and another vocabulary; exactly one is expected"));
  }
  if (has_hf) {
    PDS_ASSIGN_OR_RETURN(
        std::unique_ptr<internal::TokenizerImpl> impl,
        hf::HfTokenizer::FromFiles(spec.hf_tokenizer_json_path,
                                   spec.hf_tokenizer_config_path));
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  }
  if (has_vocab && spec.ggml_model == "gpt2") {
    PDS_ASSIGN_OR_RETURN(std::unique_ptr<internal::TokenizerImpl> impl,
                         hf::HfTokenizer::FromGgufGpt2(spec));
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
  }
  if (has_file && has_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokenizer spec sets both a SentencePiece model (",
        spec.sentencepiece_model_path,
        ") and an embedded GGUF vocabulary; exactly one is expected"));
  }
  if (has_file) {
    const std::string& path = spec.sentencepiece_model_path;
    PDS_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
    if (bytes.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer model ", path, " is empty"));
    }
    return CreateFromSerializedProto(bytes, path);
  }
  if (has_vocab) {
    PDS_ASSIGN_OR_RETURN(std::string proto, BuildSentencePieceModelProto(spec));
    return CreateFromSerializedProto(proto, "GGUF tokenizer.ggml.* vocabulary");
  }
  return absl::InvalidArgumentError(
      "tokenizer spec has neither a SentencePiece model path nor an embedded "
      "vocabulary");
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::CreateFromSerializedProto(
    std::string_view serialized, std::string_view description) {
  auto impl = std::make_unique<internal::SentencePieceImpl>();
  internal::SentencePieceModel& sp = impl->sp;
  // SentencePiece validates the proto (parse errors, missing <unk>, duplicate
  // or malformed pieces) and reports failures as a status, never aborting.
  PDS_RETURN_IF_ERROR(
      FromSentencePiece(sp.LoadFromSerializedProto(serialized),
                        absl::StrCat("cannot load SentencePiece model from ",
                                     Absl(description))));
  const int n = sp.GetPieceSize();
  if (n <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("SentencePiece model from ",
                                                   Absl(description),
                                                   " has an empty vocabulary"));
  }
  impl->vocab_size = n;
  impl->bos_id = sp.bos_id();
  impl->eos_id = sp.eos_id();
  impl->unk_id = sp.unk_id();

  impl->pieces.resize(n);
  for (int id = 0; id < n; ++id) {
    internal::PieceEntry& e = impl->pieces[id];
    const std::string& piece = sp.IdToPiece(id);
    if (sp.IsByte(id)) {
      // SentencePiece only accepts byte pieces spelled "<0xXX>" (uppercase).
      e.kind = internal::PieceEntry::Kind::kByte;
      e.byte =
          static_cast<uint8_t>(HexDigit(piece[3]) * 16 + HexDigit(piece[4]));
    } else if (sp.IsControl(id)) {
      e.kind = internal::PieceEntry::Kind::kControl;
    } else if (sp.IsUnknown(id)) {
      // The surface may be customized (trainer_spec.unk_surface); ask the
      // library rather than assuming its default " ⁇ ".
      e.kind = internal::PieceEntry::Kind::kUnknown;
      PDS_RETURN_IF_ERROR(
          FromSentencePiece(sp.Decode({id}, &e.text), "decode <unk>"));
    } else {
      e.kind = internal::PieceEntry::Kind::kText;
      e.starts_with_space = absl::StartsWith(piece, kSpaceSymbol);
      e.text = absl::StrReplaceAll(piece, {{kSpaceSymbol, " "}});
    }
  }
  // Ask the library whether a lone word keeps its leading space rather than
  // re-deriving it from normalizer_spec, which we cannot read back here.
  for (int id = 0; id < n; ++id) {
    const internal::PieceEntry& e = impl->pieces[id];
    if (e.kind == internal::PieceEntry::Kind::kText && e.starts_with_space &&
        e.text.size() > 1) {
      std::string lone;
      PDS_RETURN_IF_ERROR(FromSentencePiece(sp.Decode({id}, &lone), "decode"));
      impl->strips_dummy_prefix = lone.size() < e.text.size();
      break;
    }
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       bool add_bos) const {
  return impl_->Encode(text, add_bos);
}

absl::StatusOr<std::string> Tokenizer::Decode(
    std::span<const int32_t> ids) const {
  const int32_t limit = std::max(impl_->vocab_size, impl_->model_vocab_size);
  bool padded = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= limit) {
      return absl::OutOfRangeError(
          absl::StrCat("token id ", ids[i], " at position ", i,
                       " is outside the vocabulary of ", limit));
    }
    padded |= ids[i] >= impl_->vocab_size;
  }
  if (!padded) return impl_->Decode(ids);
  // A model's padding ids stand for no text.
  std::vector<int32_t> text_ids;
  for (int32_t id : ids) {
    if (id < impl_->vocab_size) text_ids.push_back(id);
  }
  return impl_->Decode(text_ids);
}

bool Tokenizer::IsPadding(int32_t id) const {
  return id >= impl_->vocab_size && id < impl_->model_vocab_size;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
int32_t Tokenizer::bos_id() const { return impl_->bos_id; }
int32_t Tokenizer::eos_id() const { return impl_->eos_id; }
int32_t Tokenizer::unk_id() const { return impl_->unk_id; }

absl::Status Tokenizer::CheckId(int32_t id) const {
  const int32_t limit = std::max(impl_->vocab_size, impl_->model_vocab_size);
  if (id < 0 || id >= limit) {
    return absl::OutOfRangeError(
        absl::StrCat("token id ", id, " is outside the vocabulary of ", limit));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string_view> Tokenizer::IdToPiece(int32_t id) const {
  PDS_RETURN_IF_ERROR(CheckId(id));
  if (IsPadding(id)) return std::string_view();
  return impl_->IdToPiece(id);
}

absl::StatusOr<std::string> Tokenizer::TokenBytes(int32_t id) const {
  PDS_RETURN_IF_ERROR(CheckId(id));
  if (IsPadding(id)) return std::string();
  return impl_->TokenBytes(id);
}

bool Tokenizer::IsControl(int32_t id) const {
  return CheckId(id).ok() && !IsPadding(id) && impl_->IsControl(id);
}

// ---------------------------------------------------------------------------
// SentencePiece backend

namespace internal {

absl::StatusOr<std::vector<int32_t>> SentencePieceImpl::Encode(
    std::string_view text, bool add_bos) const {
  std::vector<int> ids;
  PDS_RETURN_IF_ERROR(FromSentencePiece(sp.Encode(text, &ids), "encode"));
  std::vector<int32_t> out;
  out.reserve(ids.size() + 1);
  if (add_bos && bos_id >= 0) out.push_back(bos_id);
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

absl::StatusOr<std::string> SentencePieceImpl::Decode(
    std::span<const int32_t> ids) const {
  std::vector<int> sp_ids(ids.begin(), ids.end());
  std::string text;
  PDS_RETURN_IF_ERROR(FromSentencePiece(sp.Decode(sp_ids, &text), "decode"));
  return text;
}

std::string_view SentencePieceImpl::IdToPiece(int32_t id) const {
  return sp.IdToPiece(id);
}

std::string SentencePieceImpl::TokenBytes(int32_t id) const {
  const PieceEntry& e = pieces[id];
  switch (e.kind) {
    case PieceEntry::Kind::kByte:
      return std::string(1, static_cast<char>(e.byte));
    case PieceEntry::Kind::kControl:
      return sp.IdToPiece(id);
    case PieceEntry::Kind::kUnknown:
    case PieceEntry::Kind::kText:
      break;
  }
  return e.text;
}

bool SentencePieceImpl::IsControl(int32_t id) const {
  return pieces[id].kind == PieceEntry::Kind::kControl;
}

}  // namespace internal

absl::Status Tokenizer::CheckCompatibleWith(int model_vocab_size) const {
  // Models pad their embedding to a round size (Qwen3: +267 rows, Phi-3:
  // +53); a larger gap means another tokenizer.
  if (model_vocab_size < impl_->vocab_size ||
      model_vocab_size > impl_->vocab_size + kMaxVocabPadding) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tokenizer vocabulary size ", impl_->vocab_size,
        " does not match the model's vocab_size ", model_vocab_size,
        model_vocab_size < impl_->vocab_size
            ? " (the model has no embedding for the tokenizer's last ids)"
            : absl::StrCat(" (more than ", kMaxVocabPadding,
                           " padding rows: another tokenizer?)")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerForModel(
    const model::WeightSource& source) {
  PDS_ASSIGN_OR_RETURN(model::TokenizerSpec spec, source.tokenizer_spec());
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::Create(spec);
  if (!tokenizer.ok()) {
    return absl::Status(tokenizer.status().code(),
                        absl::StrCat("tokenizer of ", source.description(),
                                     ": ", tokenizer.status().message()));
  }
  absl::Status compatible =
      (*tokenizer)->CheckCompatibleWith(source.config().vocab_size);
  if (!compatible.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(source.description(), ": ", compatible.message()));
  }
  // Not shared yet: the only change after Create.
  (*tokenizer)->impl_->model_vocab_size = source.config().vocab_size;
  return tokenizer;
}

}  // namespace pdserve::tokenizer
