#include "tokenizer/detokenizer.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "tokenizer/tokenizer_internal.h"

namespace pdserve::tokenizer {
namespace {

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

bool IsTrail(unsigned char b) { return (b & 0xC0) == 0x80; }

// Bytes a character starting with `lead` needs; 1 for bytes that cannot lead.
size_t ExpectedLength(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

// Decodes one character at the front of `s` the way SentencePiece's
// IsValidDecodeUTF8 does: true and its length, or false (consume one byte).
bool DecodeOne(std::string_view s, size_t* len) {
  *len = 1;
  const auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  const size_t need = ExpectedLength(b(0));
  if (b(0) < 0x80) return true;
  if (need == 1 || s.size() < need) return false;
  for (size_t i = 1; i < need; ++i) {
    if (!IsTrail(b(i))) return false;
  }
  uint32_t cp;
  uint32_t min;
  if (need == 2) {
    cp = ((b(0) & 0x1Fu) << 6) | (b(1) & 0x3Fu);
    min = 0x80;
  } else if (need == 3) {
    cp = ((b(0) & 0x0Fu) << 12) | ((b(1) & 0x3Fu) << 6) | (b(2) & 0x3Fu);
    min = 0x800;
  } else {
    cp = ((b(0) & 0x07u) << 18) | ((b(1) & 0x3Fu) << 12) |
         ((b(2) & 0x3Fu) << 6) | (b(3) & 0x3Fu);
    min = 0x10000;
  }
  const bool valid_cp = cp < 0xD800 || (cp >= 0xE000 && cp <= 0x10FFFF);
  if (cp < min || !valid_cp) return false;
  *len = need;
  return true;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  while (!s.empty()) {
    size_t len;
    if (!DecodeOne(s, &len)) return false;
    s.remove_prefix(len);
  }
  return true;
}

namespace internal {
namespace {

// SentencePiece's decoding, one piece at a time.
class SentencePieceStream : public StreamDecoder {
 public:
  SentencePieceStream(const SentencePieceImpl& impl, bool at_text_start)
      : impl_(impl),
        text_empty_(at_text_start),
        at_start_(at_text_start && impl.strips_dummy_prefix) {}

  std::string Push(int32_t id) override;
  std::string Finish() override {
    std::string out;
    DrainPending(/*end_of_run=*/true, &out);
    if (!out.empty()) text_empty_ = false;
    return out;
  }
  size_t pending_bytes() const override { return pending_.size(); }

 private:
  // Emits complete characters (or U+FFFD for bytes that can never become
  // valid) from the front of pending_; with `end_of_run`, flushes all.
  void DrainPending(bool end_of_run, std::string* out);

  const SentencePieceImpl& impl_;
  std::string pending_;       // raw bytes from byte-fallback pieces
  bool text_empty_;           // nothing emitted yet
  bool at_start_;             // the next word-initial space may be dropped
  bool bos_ws_seen_ = false;  // the previous piece had its space dropped
};

void SentencePieceStream::DrainPending(bool end_of_run, std::string* out) {
  std::string_view rest = pending_;
  while (!rest.empty()) {
    const size_t need = ExpectedLength(static_cast<unsigned char>(rest[0]));
    if (!end_of_run && rest.size() < need) {
      // Hold back a possibly-valid prefix of a character until its remaining
      // bytes arrive; if a byte already present is not a continuation byte,
      // SentencePiece will reject the lead byte regardless, so go on.
      bool could_complete = true;
      for (size_t i = 1; i < rest.size(); ++i) {
        could_complete &= IsTrail(static_cast<unsigned char>(rest[i]));
      }
      if (could_complete) break;
    }
    size_t len;
    if (DecodeOne(rest, &len)) {
      out->append(rest.substr(0, len));
    } else {
      out->append(kReplacementChar);
    }
    rest.remove_prefix(len);
  }
  pending_.erase(0, pending_.size() - rest.size());
}

std::string SentencePieceStream::Push(int32_t id) {
  using Kind = PieceEntry::Kind;
  const PieceEntry& e = impl_.pieces[id];
  std::string out;
  if (e.kind == Kind::kByte) {
    pending_.push_back(static_cast<char>(e.byte));
    DrainPending(/*end_of_run=*/false, &out);
  } else {
    // Any other piece ends a run of byte pieces; SentencePiece then turns the
    // leftover bytes of an unfinished character into U+FFFD each.
    DrainPending(/*end_of_run=*/true, &out);
    if (!out.empty()) text_empty_ = false;
    // As in SentencePieceProcessor::Decode: only the first word-initial space
    // is dropped, and only while nothing visible precedes it. A bare "▁"
    // piece decodes to "" but still uses up the drop.
    if (bos_ws_seen_ || !text_empty_) at_start_ = false;
    bos_ws_seen_ = false;
    switch (e.kind) {
      case Kind::kControl:
        break;
      case Kind::kUnknown:
        out += e.text;
        break;
      case Kind::kText:
        // SentencePiece drops the dummy-prefix space of the first piece
        // decoded while the text is still empty.
        if (at_start_ && e.starts_with_space) {
          out.append(e.text, 1);
          bos_ws_seen_ = true;
        } else {
          out += e.text;
        }
        break;
      case Kind::kByte:
        break;
    }
  }
  if (!out.empty()) text_empty_ = false;
  return out;
}

}  // namespace

std::unique_ptr<StreamDecoder> SentencePieceImpl::NewStream(
    bool at_text_start) const {
  return std::make_unique<SentencePieceStream>(*this, at_text_start);
}

}  // namespace internal

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer,
                                               bool at_text_start)
    : tokenizer_(tokenizer),
      stream_(tokenizer.impl_->NewStream(at_text_start)) {}

IncrementalDetokenizer::~IncrementalDetokenizer() = default;

size_t IncrementalDetokenizer::pending_bytes() const {
  return stream_->pending_bytes();
}

absl::StatusOr<std::string> IncrementalDetokenizer::Push(int32_t id) {
  const internal::TokenizerImpl& impl = *tokenizer_.impl_;
  PDS_RETURN_IF_ERROR(tokenizer_.CheckId(id));
  if (id >= impl.vocab_size) return std::string();  // the model's padding
  return stream_->Push(id);
}

absl::StatusOr<std::string> IncrementalDetokenizer::PushAll(
    std::span<const int32_t> ids) {
  std::string out;
  for (int32_t id : ids) {
    absl::StatusOr<std::string> delta = Push(id);
    if (!delta.ok()) return delta.status();
    out += *delta;
  }
  return out;
}

std::string IncrementalDetokenizer::Finish() { return stream_->Finish(); }

}  // namespace pdserve::tokenizer
