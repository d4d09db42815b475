// The BPE model of tokenizer.json: merges ranked in a hash map keyed by the
// pair of token ids, lowest rank first (leftmost on ties), byte fallback,
// unk, fuse_unk, ignore_merges, and a bounded cache of recent words.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::tokenizer::hf {

// Token string -> id over the model vocabulary with added tokens laid over
// it (the reference resolves every token string through this one map).
using TokenMap = absl::flat_hash_map<std::string, int32_t>;

struct BpeOptions {
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  int32_t unk_id = -1;  // -1: no unk token
};

class BpeModel {
 public:
  // `merges` in rank order. Each pair's halves and their concatenation must
  // be in `tokens`; on failure returns the index of the bad merge and why
  // (the caller names the file and key).
  struct MergeError {
    size_t index;
    std::string what;
  };
  static std::unique_ptr<BpeModel> Create(
      const TokenMap* tokens,
      const std::vector<std::pair<std::string, std::string>>& merges,
      const BpeOptions& options, MergeError* error);

  // Appends the ids of pre-tokenized `words` (one section) to `out`. Thread-
  // safe (the cache is sharded and locked).
  void Tokenize(const std::vector<std::string>& words,
                std::vector<int32_t>* out) const;

 private:
  BpeModel(const TokenMap* tokens, const BpeOptions& options);
  void TokenizeWord(std::string_view word, std::vector<int32_t>* out) const;
  void MergeWord(std::string_view word, std::vector<int32_t>* out) const;

  const TokenMap* tokens_;  // owned by the HfTokenizer
  BpeOptions options_;
  // (left id << 32 | right id) -> (rank, merged id).
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  std::vector<int32_t> byte_ids_;  // <0xXX> ids, -1 when missing

  struct CacheShard {
    mutable absl::Mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> words
        ABSL_GUARDED_BY(mu);
  };
  static constexpr int kShards = 16;
  static constexpr size_t kShardCapacity = 4096;
  static constexpr size_t kMaxCachedWord = 256;  // bytes
  mutable std::unique_ptr<CacheShard[]> cache_;
};

}  // namespace pdserve::tokenizer::hf
