// UTF-8 helpers shared by the Hugging Face backend: the WHATWG decoder's
// replacement rules (what TextDecoder and TextEncoder do in the JavaScript
// reference), and incremental completeness checks for streaming.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pdserve::tokenizer::utf8 {

// Appends `bytes` to `out` with every ill-formed subsequence replaced by one
// U+FFFD per maximal subpart (WHATWG "decode" with replacement: what
// JavaScript's TextDecoder produces). Valid input is copied unchanged.
void AppendLossy(std::string_view bytes, std::string* out);
inline std::string Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  AppendLossy(bytes, &out);
  return out;
}

// True when `bytes` is well-formed UTF-8 (same rules as AppendLossy).
bool IsWellFormed(std::string_view bytes);

// Length of the longest prefix of `bytes` that AppendLossy could decode
// without knowing what follows: everything except a trailing, still
// completable prefix of a multi-byte sequence.
size_t DecodablePrefix(std::string_view bytes);

// Length in bytes of the character starting at s[0] (s must be valid UTF-8
// and non-empty).
inline size_t CharLength(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// Decodes the code point at the front of valid UTF-8 `s`.
uint32_t DecodeAt(std::string_view s, size_t pos, size_t* len);

void AppendCodePoint(uint32_t cp, std::string* out);

}  // namespace pdserve::tokenizer::utf8
