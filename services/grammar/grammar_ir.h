// The grammar every front end (JSON schema, regex, choice) compiles to: rules
// of alternatives, each a sequence of byte sets and rule references — a
// context-free grammar over bytes. Repetition is right recursion (or a
// bounded chain), so the matcher's stacks stay flat on loops.
#pragma once

#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdserve::grammar::internal {

using ByteSet = std::bitset<256>;

struct Element {
  enum class Kind : uint8_t { kBytes, kRule, kEnd };
  Kind kind;
  int32_t index;  // byte set (kBytes) or rule (kRule)
};

struct Grammar {
  std::vector<Element> elements;  // alternatives, each closed by kEnd
  std::vector<std::vector<int32_t>> rule_alternatives;  // start element
  std::vector<ByteSet> byte_sets;
  int32_t root = -1;
};

// A symbol of an alternative under construction.
struct Symbol {
  bool is_rule = false;
  int32_t index = 0;
};
using Sequence = std::vector<Symbol>;

// A set of Unicode scalar values as sorted, disjoint, inclusive ranges.
class CodePointSet {
 public:
  void Add(uint32_t lo, uint32_t hi);
  void Add(const CodePointSet& other);
  CodePointSet Complement() const;  // within [0, 0x10FFFF] minus surrogates
  bool Contains(uint32_t c) const;
  bool empty() const { return ranges_.empty(); }
  const std::vector<std::pair<uint32_t, uint32_t>>& ranges() const {
    return ranges_;
  }

 private:
  void Normalize();
  std::vector<std::pair<uint32_t, uint32_t>> ranges_;
};

class GrammarBuilder {
 public:
  // `max_elements` bounds the grammar: exceeding it is INVALID_ARGUMENT
  // ("grammar too large"), reported by status().
  explicit GrammarBuilder(int64_t max_elements);

  int32_t NewRule();
  void AddAlternative(int32_t rule, const Sequence& sequence);

  Symbol Bytes(const ByteSet& set);
  Symbol Byte(uint8_t byte);
  Symbol ByteRange(uint8_t lo, uint8_t hi);
  static Symbol Ref(int32_t rule) { return Symbol{true, rule}; }

  // The bytes of `literal`, appended to `out`.
  void AppendLiteral(std::string_view literal, Sequence* out);
  // One rule matching exactly `literal`.
  int32_t Literal(std::string_view literal);
  // A rule for one of `sequences`.
  int32_t Choice(const std::vector<Sequence>& sequences);
  // A symbol standing for `sequence` (itself when it is one symbol).
  Symbol Wrap(const Sequence& sequence);
  // `symbol` repeated min..max times (max < 0: unbounded).
  Symbol Repeat(Symbol symbol, int64_t min, int64_t max);
  // The UTF-8 encodings of `set` (a rule; never matches when empty).
  Symbol Utf8(const CodePointSet& set);

  // OK, or the first limit exceeded.
  const absl::Status& status() const { return status_; }
  int64_t size() const {
    return static_cast<int64_t>(grammar_.elements.size());
  }
  absl::StatusOr<Grammar> Build(int32_t root) &&;

 private:
  bool Charge(int64_t elements);
  Grammar grammar_;
  int64_t max_elements_;
  absl::Status status_;
  absl::flat_hash_map<std::string, int32_t> byte_set_index_;
  int32_t never_rule_ = -1;
};

// Splits [lo, hi] (scalar values) into UTF-8 byte-range sequences: each
// inner vector lists one (lo, hi) byte range per encoded byte.
std::vector<std::vector<std::pair<uint8_t, uint8_t>>> Utf8RangeSequences(
    uint32_t lo, uint32_t hi);

// Appends the UTF-8 encoding of `c` to `out`.
void AppendUtf8(uint32_t c, std::string* out);

}  // namespace pdserve::grammar::internal
