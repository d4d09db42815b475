#include "tokenizer/hf_bpe.h"

#include <queue>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tokenizer/utf8.h"

namespace pdserve::tokenizer::hf {
namespace {

absl::string_view Absl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
         static_cast<uint32_t>(b);
}

}  // namespace

BpeModel::BpeModel(const TokenMap* tokens, const BpeOptions& options)
    : tokens_(tokens),
      options_(options),
      byte_ids_(256, -1),
      cache_(new CacheShard[kShards]) {}

std::unique_ptr<BpeModel> BpeModel::Create(
    const TokenMap* tokens,
    const std::vector<std::pair<std::string, std::string>>& merges,
    const BpeOptions& options, MergeError* error) {
  std::unique_ptr<BpeModel> model(new BpeModel(tokens, options));
  model->merges_.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const auto& [a, b] = merges[i];
    const auto ia = tokens->find(a);
    const auto ib = tokens->find(b);
    const auto iab = tokens->find(a + b);
    const char* missing = ia == tokens->end()    ? "its first token"
                          : ib == tokens->end()  ? "its second token"
                          : iab == tokens->end() ? "the merged token"
                                                 : nullptr;
    if (missing != nullptr) {
      *error = {i, absl::StrCat("merge \"", a, " ", b, "\": ", missing, " \"",
                                ia == tokens->end()   ? a
                                : ib == tokens->end() ? b
                                                      : a + b,
                                "\" is not in the vocabulary")};
      return nullptr;
    }
    // The first occurrence of a pair keeps its (lower) rank.
    model->merges_.try_emplace(PairKey(ia->second, ib->second),
                               static_cast<int32_t>(i), iab->second);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = tokens->find(absl::StrFormat("<0x%02X>", b));
    if (it != tokens->end()) model->byte_ids_[b] = it->second;
  }
  return model;
}

void BpeModel::Tokenize(const std::vector<std::string>& words,
                        std::vector<int32_t>* out) const {
  const size_t first = out->size();
  for (const std::string& word : words) TokenizeWord(word, out);
  if (options_.fuse_unk && options_.unk_id >= 0) {
    // Consecutive unknowns collapse into one (over the whole section, as the
    // reference fuses after encoding all of a section's words).
    size_t w = first;
    for (size_t r = first; r < out->size(); ++r) {
      if ((*out)[r] == options_.unk_id && w > first &&
          (*out)[w - 1] == options_.unk_id) {
        continue;
      }
      (*out)[w++] = (*out)[r];
    }
    out->resize(w);
  }
}

void BpeModel::TokenizeWord(std::string_view word,
                            std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    auto it = tokens_->find(Absl(word));
    if (it != tokens_->end()) {
      out->push_back(it->second);
      return;
    }
  }
  if (word.size() > kMaxCachedWord) {
    MergeWord(word, out);
    return;
  }
  const size_t hash = absl::HashOf(Absl(word));
  CacheShard& shard = cache_[hash % kShards];
  {
    absl::MutexLock lock(&shard.mu);
    auto it = shard.words.find(Absl(word));
    if (it != shard.words.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out->size();
  MergeWord(word, out);
  absl::MutexLock lock(&shard.mu);
  // A full shard starts over: cheaper than LRU bookkeeping, and hot words
  // come back at once.
  if (shard.words.size() >= kShardCapacity) shard.words.clear();
  shard.words.try_emplace(std::string(word), out->begin() + first, out->end());
}

void BpeModel::MergeWord(std::string_view word,
                         std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t id;  // -1: a character outside the vocabulary
    int32_t prev, next;
    uint32_t begin, len;  // bytes of `word` (for byte fallback)
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (size_t pos = 0; pos < word.size();) {
    const size_t len = utf8::CharLength(static_cast<unsigned char>(word[pos]));
    auto it = tokens_->find(Absl(word.substr(pos, len)));
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back({it == tokens_->end() ? -1 : it->second, index - 1,
                       index + 1, static_cast<uint32_t>(pos),
                       static_cast<uint32_t>(len)});
    pos += len;
  }
  symbols.back().next = -1;

  // Lowest rank first, then leftmost: (rank, left index) is unique.
  struct Candidate {
    int32_t rank, left, left_id, right_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto consider = [&](int32_t left) {
    const int32_t right = symbols[left].next;
    if (right < 0 || symbols[left].id < 0 || symbols[right].id < 0) return;
    auto it = merges_.find(PairKey(symbols[left].id, symbols[right].id));
    if (it == merges_.end()) return;
    queue.push({it->second.first, left, symbols[left].id, symbols[right].id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) {
    consider(i);
  }
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = symbols[c.left];
    // Stale when either side changed since it was queued: a merged symbol
    // always has a new id, so comparing ids is enough.
    if (left.id != c.left_id || left.next < 0 ||
        symbols[left.next].id != c.right_id) {
      continue;
    }
    Symbol& right = symbols[left.next];
    left.id = merges_.find(PairKey(c.left_id, c.right_id))->second.second;
    left.len += right.len;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = c.left;
    right.id = -2;  // removed
    if (left.prev >= 0) consider(left.prev);
    consider(c.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const Symbol& s = symbols[i];
    if (s.id >= 0) {
      out->push_back(s.id);
      continue;
    }
    bool done = false;
    if (options_.byte_fallback) {
      done = true;
      for (uint32_t k = 0; k < s.len; ++k) {
        done &= byte_ids_[static_cast<unsigned char>(word[s.begin + k])] >= 0;
      }
      if (done) {
        for (uint32_t k = 0; k < s.len; ++k) {
          out->push_back(
              byte_ids_[static_cast<unsigned char>(word[s.begin + k])]);
        }
      }
    }
    // Without an unk token the reference drops the character.
    if (!done && options_.unk_id >= 0) out->push_back(options_.unk_id);
  }
}

}  // namespace pdserve::tokenizer::hf
