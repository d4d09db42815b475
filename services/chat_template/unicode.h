// Text helpers that reproduce JavaScript string semantics on UTF-8 strings.
//
// @huggingface/jinja (the renderer of record) runs on JavaScript strings:
// UTF-16 code units for `length` and indexing, code points for slicing,
// JavaScript's whitespace set for trim/strip/split, and Unicode default case
// mapping for upper/lower. pdserve keeps strings as UTF-8 and converts at
// these few points. Invalid UTF-8 never crashes: each bad byte reads as
// U+FFFD. Lone surrogates are kept as WTF-8 (3-byte) sequences.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pdserve::chat_template::internal {

// Decodes one code point at `pos` (advancing it). Bad bytes give U+FFFD and
// advance by one; WTF-8 surrogates decode as themselves.
uint32_t DecodeUtf8(std::string_view s, size_t& pos);
void AppendUtf8(uint32_t cp, std::string& out);

std::u16string ToUtf16(std::string_view s);
std::string FromUtf16(std::u16string_view s);

// The code points of `s`, each as its own UTF-8 string (JavaScript's
// Array.from(string)).
std::vector<std::string> CodePoints(std::string_view s);

// JavaScript's `\s` / String.prototype.trim set (WhiteSpace + LineTerminator).
bool IsJsWhitespace(uint32_t cp);
// Length in bytes of the whitespace code point at `pos`, or 0.
size_t JsWhitespaceAt(std::string_view s, size_t pos);

std::string_view TrimStart(std::string_view s);
std::string_view TrimEnd(std::string_view s);
std::string_view Trim(std::string_view s);

// String.prototype.length: UTF-16 code units.
size_t Utf16Length(std::string_view s);

// String.prototype.toUpperCase / toLowerCase (locale-independent, via ICU).
std::string ToUpper(std::string_view s);
std::string ToLower(std::string_view s);

}  // namespace pdserve::chat_template::internal
