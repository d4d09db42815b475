#include "grammar/grammar_ir.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::grammar::internal {

// ---------------------------------------------------------------------------
// CodePointSet

void CodePointSet::Add(uint32_t lo, uint32_t hi) {
  if (lo > hi) return;
  ranges_.emplace_back(lo, std::min<uint32_t>(hi, 0x10FFFF));
  Normalize();
}

void CodePointSet::Add(const CodePointSet& other) {
  ranges_.insert(ranges_.end(), other.ranges_.begin(), other.ranges_.end());
  Normalize();
}

void CodePointSet::Normalize() {
  std::sort(ranges_.begin(), ranges_.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (const auto& r : ranges_) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges_ = std::move(merged);
}

CodePointSet CodePointSet::Complement() const {
  CodePointSet out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : ranges_) {
    if (lo > next) out.ranges_.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= 0x10FFFF) out.ranges_.emplace_back(next, 0x10FFFF);
  return out;
}

bool CodePointSet::Contains(uint32_t c) const {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(),
                             std::make_pair(c, 0xFFFFFFFFu));
  if (it == ranges_.begin()) return false;
  --it;
  return c >= it->first && c <= it->second;
}

// ---------------------------------------------------------------------------
// UTF-8 ranges (the classic split: by encoded length, then so that every
// continuation byte spans a whole 6-bit block except at the ends).

void AppendUtf8(uint32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

namespace {

void SplitUtf8(uint32_t lo, uint32_t hi,
               std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {  // surrogates are not scalar values
    if (lo < 0xD800) SplitUtf8(lo, 0xD7FF, out);
    if (hi > 0xDFFF) SplitUtf8(0xE000, hi, out);
    return;
  }
  for (uint32_t max : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= max && hi > max) {
      SplitUtf8(lo, max, out);
      SplitUtf8(max + 1, hi, out);
      return;
    }
  }
  if (hi <= 0x7F) {
    out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
    return;
  }
  const int length = hi <= 0x7FF ? 2 : hi <= 0xFFFF ? 3 : 4;
  for (int i = 1; i < length; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        SplitUtf8(lo, lo | m, out);
        SplitUtf8((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        SplitUtf8(lo, (hi & ~m) - 1, out);
        SplitUtf8(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  AppendUtf8(lo, &a);
  AppendUtf8(hi, &b);
  std::vector<std::pair<uint8_t, uint8_t>> seq;
  for (size_t i = 0; i < a.size(); ++i) {
    seq.emplace_back(static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i]));
  }
  out->push_back(std::move(seq));
}

}  // namespace

std::vector<std::vector<std::pair<uint8_t, uint8_t>>> Utf8RangeSequences(
    uint32_t lo, uint32_t hi) {
  std::vector<std::vector<std::pair<uint8_t, uint8_t>>> out;
  SplitUtf8(lo, std::min<uint32_t>(hi, 0x10FFFF), &out);
  return out;
}

// ---------------------------------------------------------------------------
// GrammarBuilder

GrammarBuilder::GrammarBuilder(int64_t max_elements)
    : max_elements_(max_elements) {}

bool GrammarBuilder::Charge(int64_t elements) {
  if (!status_.ok()) return false;
  if (size() + elements > max_elements_) {
    status_ = absl::InvalidArgumentError(absl::StrCat(
        "grammar too large: it needs more than ", max_elements_,
        " elements (bounded repetitions, lengths and item counts multiply; "
        "use smaller bounds)"));
    return false;
  }
  return true;
}

int32_t GrammarBuilder::NewRule() {
  grammar_.rule_alternatives.emplace_back();
  return static_cast<int32_t>(grammar_.rule_alternatives.size() - 1);
}

void GrammarBuilder::AddAlternative(int32_t rule, const Sequence& sequence) {
  if (!Charge(static_cast<int64_t>(sequence.size()) + 1)) return;
  grammar_.rule_alternatives[rule].push_back(
      static_cast<int32_t>(grammar_.elements.size()));
  for (const Symbol& s : sequence) {
    grammar_.elements.push_back(
        {s.is_rule ? Element::Kind::kRule : Element::Kind::kBytes, s.index});
  }
  grammar_.elements.push_back({Element::Kind::kEnd, -1});
}

Symbol GrammarBuilder::Bytes(const ByteSet& set) {
  std::string key = set.to_string();
  auto [it, inserted] = byte_set_index_.try_emplace(
      key, static_cast<int32_t>(grammar_.byte_sets.size()));
  if (inserted) grammar_.byte_sets.push_back(set);
  return Symbol{false, it->second};
}

Symbol GrammarBuilder::Byte(uint8_t byte) {
  ByteSet s;
  s.set(byte);
  return Bytes(s);
}

Symbol GrammarBuilder::ByteRange(uint8_t lo, uint8_t hi) {
  ByteSet s;
  for (int b = lo; b <= hi; ++b) s.set(b);
  return Bytes(s);
}

void GrammarBuilder::AppendLiteral(std::string_view literal, Sequence* out) {
  for (char c : literal) out->push_back(Byte(static_cast<uint8_t>(c)));
}

int32_t GrammarBuilder::Literal(std::string_view literal) {
  Sequence seq;
  AppendLiteral(literal, &seq);
  const int32_t rule = NewRule();
  AddAlternative(rule, seq);
  return rule;
}

int32_t GrammarBuilder::Choice(const std::vector<Sequence>& sequences) {
  const int32_t rule = NewRule();
  for (const Sequence& s : sequences) AddAlternative(rule, s);
  return rule;
}

Symbol GrammarBuilder::Wrap(const Sequence& sequence) {
  if (sequence.size() == 1) return sequence[0];
  const int32_t rule = NewRule();
  AddAlternative(rule, sequence);
  return Ref(rule);
}

Symbol GrammarBuilder::Repeat(Symbol symbol, int64_t min, int64_t max) {
  const int64_t optional = max < 0 ? 1 : max - min;
  if (!Charge(min + 4 * optional)) return Ref(NewRule());
  Sequence seq(static_cast<size_t>(min), symbol);
  if (max < 0) {
    const int32_t star = NewRule();
    AddAlternative(star, {symbol, Ref(star)});
    AddAlternative(star, {});
    seq.push_back(Ref(star));
  } else if (optional > 0) {
    // R_k = symbol R_{k-1} | ε: at most `optional` more.
    int32_t previous = -1;
    for (int64_t i = 0; i < optional; ++i) {
      const int32_t rule = NewRule();
      if (previous < 0) {
        AddAlternative(rule, {symbol});
      } else {
        AddAlternative(rule, {symbol, Ref(previous)});
      }
      AddAlternative(rule, {});
      previous = rule;
    }
    seq.push_back(Ref(previous));
  }
  if (seq.empty()) {
    const int32_t empty = NewRule();
    AddAlternative(empty, {});
    return Ref(empty);
  }
  return Wrap(seq);
}

Symbol GrammarBuilder::Utf8(const CodePointSet& set) {
  const int32_t rule = NewRule();
  for (const auto& [lo, hi] : set.ranges()) {
    for (const auto& byte_ranges : Utf8RangeSequences(lo, hi)) {
      Sequence seq;
      for (const auto& [a, b] : byte_ranges) seq.push_back(ByteRange(a, b));
      AddAlternative(rule, seq);
    }
  }
  return Ref(rule);
}

absl::StatusOr<Grammar> GrammarBuilder::Build(int32_t root) && {
  if (!status_.ok()) return status_;
  grammar_.root = root;
  return std::move(grammar_);
}

}  // namespace pdserve::grammar::internal
