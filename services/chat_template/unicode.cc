#include "chat_template/unicode.h"

#include <unicode/ustring.h>
#include <unicode/utypes.h>

namespace pdserve::chat_template::internal {

uint32_t DecodeUtf8(std::string_view s, size_t& pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  int len = 0;
  uint32_t cp = 0;
  uint32_t min = 0;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    ++pos;
    return 0xFFFD;
  }
  if (pos + len > s.size()) {
    ++pos;
    return 0xFFFD;
  }
  for (int i = 1; i < len; ++i) {
    const auto b = static_cast<unsigned char>(s[pos + i]);
    if ((b & 0xC0) != 0x80) {
      ++pos;
      return 0xFFFD;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF) {
    ++pos;
    return 0xFFFD;
  }
  pos += len;
  return cp;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::u16string ToUtf16(std::string_view s) {
  std::u16string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (pos < s.size()) {
    const uint32_t cp = DecodeUtf8(s, pos);
    if (cp >= 0x10000) {
      out.push_back(static_cast<char16_t>(0xD800 + ((cp - 0x10000) >> 10)));
      out.push_back(static_cast<char16_t>(0xDC00 + ((cp - 0x10000) & 0x3FF)));
    } else {
      out.push_back(static_cast<char16_t>(cp));
    }
  }
  return out;
}

std::string FromUtf16(std::u16string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    uint32_t cp = s[i];
    if (cp >= 0xD800 && cp < 0xDC00 && i + 1 < s.size() && s[i + 1] >= 0xDC00 &&
        s[i + 1] < 0xE000) {
      cp = 0x10000 + ((cp - 0xD800) << 10) + (s[i + 1] - 0xDC00);
      ++i;
    }
    AppendUtf8(cp, out);
  }
  return out;
}

std::vector<std::string> CodePoints(std::string_view s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t start = pos;
    const uint32_t cp = DecodeUtf8(s, pos);
    if (cp == 0xFFFD && pos - start == 1 &&
        static_cast<unsigned char>(s[start]) >= 0x80) {
      out.emplace_back("\xEF\xBF\xBD");
    } else {
      out.emplace_back(s.substr(start, pos - start));
    }
  }
  return out;
}

bool IsJsWhitespace(uint32_t cp) {
  if (cp <= 32) return cp == 32 || (cp >= 9 && cp <= 13);
  return cp > 127 &&
         (cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
          cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
          cp == 0x3000 || cp == 0xFEFF);
}

size_t JsWhitespaceAt(std::string_view s, size_t pos) {
  if (pos >= s.size()) return 0;
  const auto b = static_cast<unsigned char>(s[pos]);
  if (b < 0x80) return IsJsWhitespace(b) ? 1 : 0;
  size_t next = pos;
  const uint32_t cp = DecodeUtf8(s, next);
  return IsJsWhitespace(cp) ? next - pos : 0;
}

std::string_view TrimStart(std::string_view s) {
  size_t pos = 0;
  while (size_t n = JsWhitespaceAt(s, pos)) pos += n;
  return s.substr(pos);
}

std::string_view TrimEnd(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    // Step back to the start of the last code point.
    size_t start = end - 1;
    while (start > 0 && end - start < 4 &&
           (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) {
      --start;
    }
    if (JsWhitespaceAt(s.substr(0, end), start) != end - start) break;
    end = start;
  }
  return s.substr(0, end);
}

std::string_view Trim(std::string_view s) { return TrimEnd(TrimStart(s)); }

size_t Utf16Length(std::string_view s) {
  size_t n = 0;
  size_t pos = 0;
  while (pos < s.size()) n += DecodeUtf8(s, pos) >= 0x10000 ? 2 : 1;
  return n;
}

namespace {

std::string MapCase(std::string_view s, bool upper) {
  bool ascii = true;
  for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
  if (ascii) {
    std::string out(s);
    for (char& c : out) {
      if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
      if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    }
    return out;
  }
  const std::u16string in = ToUtf16(s);
  // Case mapping can grow a string (ß -> SS); ICU reports the size needed.
  std::u16string out(in.size() + 16, u'\0');
  for (int attempt = 0; attempt < 2; ++attempt) {
    UErrorCode status = U_ZERO_ERROR;
    const auto* src = reinterpret_cast<const UChar*>(in.data());
    auto* dst = reinterpret_cast<UChar*>(out.data());
    const int32_t n =
        upper ? u_strToUpper(dst, static_cast<int32_t>(out.size()), src,
                             static_cast<int32_t>(in.size()), "", &status)
              : u_strToLower(dst, static_cast<int32_t>(out.size()), src,
                             static_cast<int32_t>(in.size()), "", &status);
    if (status == U_BUFFER_OVERFLOW_ERROR) {
      out.assign(static_cast<size_t>(n) + 1, u'\0');
      continue;
    }
    if (U_FAILURE(status)) return std::string(s);
    out.resize(static_cast<size_t>(n));
    return FromUtf16(out);
  }
  return std::string(s);
}

}  // namespace

std::string ToUpper(std::string_view s) { return MapCase(s, true); }
std::string ToLower(std::string_view s) { return MapCase(s, false); }

}  // namespace pdserve::chat_template::internal
