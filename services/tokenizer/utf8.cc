#include "tokenizer/utf8.h"

namespace pdserve::tokenizer::utf8 {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// WHATWG UTF-8 decoder state for the byte after `lead`: how many
// continuation bytes follow and the allowed range of the first one.
struct LeadInfo {
  int need = -1;  // -1: not a valid lead byte
  unsigned char lo = 0x80, hi = 0xBF;
};

LeadInfo Lead(unsigned char b) {
  LeadInfo info;
  if (b < 0x80) {
    info.need = 0;
  } else if (b >= 0xC2 && b <= 0xDF) {
    info.need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    info.need = 2;
    if (b == 0xE0) info.lo = 0xA0;
    if (b == 0xED) info.hi = 0x9F;  // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    info.need = 3;
    if (b == 0xF0) info.lo = 0x90;
    if (b == 0xF4) info.hi = 0x8F;  // <= U+10FFFF
  }
  return info;
}

// Length of the well-formed character at s[i], or 0 with *subpart set to the
// bytes of the maximal subpart to replace (at least 1), or -1 when the input
// ends inside a still-valid prefix (only when !at_end matters).
int Scan(std::string_view s, size_t i, size_t* subpart, bool* truncated) {
  *truncated = false;
  const LeadInfo info = Lead(static_cast<unsigned char>(s[i]));
  if (info.need == 0) return 1;
  if (info.need < 0) {
    *subpart = 1;
    return 0;
  }
  size_t j = i + 1;
  for (int k = 0; k < info.need; ++k, ++j) {
    if (j >= s.size()) {
      *truncated = true;
      *subpart = j - i;
      return 0;
    }
    const unsigned char c = static_cast<unsigned char>(s[j]);
    const unsigned char lo = k == 0 ? info.lo : 0x80;
    const unsigned char hi = k == 0 ? info.hi : 0xBF;
    if (c < lo || c > hi) {
      *subpart = j - i;
      return 0;
    }
  }
  return info.need + 1;
}

}  // namespace

void AppendLossy(std::string_view bytes, std::string* out) {
  size_t i = 0;
  while (i < bytes.size()) {
    // Fast path for ASCII runs.
    size_t j = i;
    while (j < bytes.size() && static_cast<unsigned char>(bytes[j]) < 0x80) ++j;
    if (j > i) {
      out->append(bytes.substr(i, j - i));
      i = j;
      continue;
    }
    size_t subpart = 0;
    bool truncated = false;
    const int len = Scan(bytes, i, &subpart, &truncated);
    if (len > 0) {
      out->append(bytes.substr(i, len));
      i += len;
    } else {
      out->append(kReplacement);
      i += subpart;
    }
  }
}

bool IsWellFormed(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t subpart = 0;
    bool truncated = false;
    const int len = Scan(bytes, i, &subpart, &truncated);
    if (len <= 0) return false;
    i += len;
  }
  return true;
}

size_t DecodablePrefix(std::string_view bytes) {
  // Only the last (up to 3) bytes can be an unfinished sequence.
  const size_t start = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (size_t i = start; i < bytes.size(); ++i) {
    const unsigned char b = static_cast<unsigned char>(bytes[i]);
    if (b < 0x80 || (b & 0xC0) == 0x80) continue;  // not a lead byte
    size_t subpart = 0;
    bool truncated = false;
    if (Scan(bytes, i, &subpart, &truncated) == 0 && truncated) return i;
  }
  return bytes.size();
}

uint32_t DecodeAt(std::string_view s, size_t pos, size_t* len) {
  const auto b = [&](size_t k) {
    return static_cast<uint32_t>(static_cast<unsigned char>(s[pos + k]));
  };
  const uint32_t c0 = b(0);
  *len = CharLength(static_cast<unsigned char>(c0));
  switch (*len) {
    case 1:
      return c0;
    case 2:
      return ((c0 & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((c0 & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((c0 & 0x07) << 18) | ((b(1) & 0x3F) << 12) |
             ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

void AppendCodePoint(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace pdserve::tokenizer::utf8
