// The grammar's matching machinery.
//
// A parser configuration is a set of stacks; each stack is a chain of nodes
// (grammar position, parent node), hash-consed so that equal stacks are the
// same node id. A set of stacks whose tops all sit on byte sets is an
// automaton *state* (also hash-consed), and byte transitions between states
// are computed on first use and kept in a dense table indexed by byte class
// (bytes no byte set tells apart share a class). The automaton is therefore a
// DFA built lazily out of the pushdown grammar: for a regular grammar (every
// non-recursive JSON schema, regex, choice) it is finite; for a recursive one
// (any JSON object, recursive $ref) it grows with the nesting depth actually
// generated.
//
// A state's token mask is one walk of the vocabulary's byte trie, following
// cached transitions and skipping every subtree whose prefix is dead; it is
// cached per state, so a state seen before costs one copy of the mask.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "grammar/grammar_ir.h"

namespace pdserve::grammar {
class TokenVocabulary;
}

namespace pdserve::grammar::internal {

// The token byte strings as a prefix trie in preorder: a node's subtree is
// [i, subtree_end[i]), its depth is its byte count, and the tokens spelling
// exactly its path are tokens[token_begin[i] .. token_begin[i + 1]).
class TokenTrie {
 public:
  // Tokens with empty bytes are left out (they never match).
  explicit TokenTrie(const std::vector<std::string_view>& token_bytes);

  int32_t num_nodes() const { return static_cast<int32_t>(byte_.size()); }
  int32_t max_depth() const { return max_depth_; }

  std::vector<uint8_t> byte_;
  std::vector<int32_t> parent_;
  std::vector<int32_t> depth_;
  std::vector<int32_t> subtree_end_;
  // For every token through a node, the bytes from the node on: whether they
  // are valid UTF-8 (a character cut off by the token's end allowed) and how
  // many characters they hold (a cut-off one counted), at most 255.
  std::vector<uint8_t> text_from_here_;
  std::vector<uint8_t> max_chars_;
  std::vector<uint8_t> has_non_ascii_;  // a byte >= 0x80 in the subtree
  std::vector<int32_t> token_begin_;    // num_nodes + 1 entries
  std::vector<int32_t> tokens_;
  int32_t max_depth_ = 0;
};

struct AutomatonLimits {
  int64_t max_nodes = 4'000'000;
  int64_t max_states = 500'000;
  int64_t max_stacks_per_state = 4096;
  int64_t max_mask_cache_bytes = 64 << 20;
};

class GrammarAutomaton {
 public:
  static constexpr int32_t kDead = -1;

  GrammarAutomaton(Grammar grammar, const TokenVocabulary* vocabulary,
                   AutomatonLimits limits);

  // Builds the start state. INVALID_ARGUMENT when the grammar matches
  // nothing at all.
  [[nodiscard]] absl::Status Init();
  int32_t start() const { return start_; }

  // The state after `bytes` from `state`, or kDead.
  [[nodiscard]] absl::StatusOr<int32_t> Walk(int32_t state,
                                             std::string_view bytes);
  bool IsAccepting(int32_t state);
  // The token bitmask of `state` (the first-token trie when `first_token`).
  [[nodiscard]] absl::Status FillMask(int32_t state, bool first_token,
                                      std::span<uint32_t> mask);

  int64_t num_states();
  int64_t grammar_size() const {
    return static_cast<int64_t>(grammar_.elements.size());
  }

 private:
  struct Node {
    int32_t pos;     // element index; -1 for the accept node
    int32_t parent;  // node to continue with after this alternative
  };
  struct State {
    std::vector<int32_t> stacks;  // nodes on byte sets, sorted
    bool accepting = false;
  };
  static constexpr int32_t kAcceptNode = 0;
  static constexpr int32_t kUnknown = -2;

  absl::StatusOr<int32_t> InternNode(int32_t pos, int32_t parent)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Expands `seeds_` to stacks topped by byte sets and interns the state.
  absl::StatusOr<int32_t> Close() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int32_t> Next(int32_t state, int byte_class)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ComputeMask(int32_t state, const TokenTrie& trie,
                           std::vector<uint32_t>* mask)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A state's uniform character step: `next` is where most ASCII bytes lead
  // (itself for a loop), `ascii_classes` the classes of ASCII bytes that lead
  // there. `ascii_run`: for how many ASCII characters of ascii_classes in a
  // row the steps stay uniform, following next, next's next, ... (kForever
  // for a loop). `text_run`: the same for any character, non-ASCII ones too
  // (any UTF-8 sequence of U+0080..U+10FFFF, every prefix alive) — only
  // looked for around loops (`non_ascii`); 0 otherwise.
  struct UniformStep {
    bool computed = false;
    uint64_t ascii_classes = 0;
    bool non_ascii = false;
    int32_t next = -1;
    int32_t ascii_run = -1;  // -1: not computed yet
    int32_t text_run = -1;
  };
  static constexpr int32_t kForever = 1 << 30;
  absl::Status ComputeUniformStep(int32_t state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ComputeUniformRuns(int32_t state, int32_t cap)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether every non-ASCII character leads from `state` back to it.
  absl::StatusOr<bool> NonAsciiLoops(int32_t state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Per trie node, the classes of the ASCII bytes of its subtree (itself
  // included).
  const std::vector<uint64_t>& SubtreeClasses(const TokenTrie& trie)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Grammar grammar_;
  const TokenVocabulary* vocabulary_;
  const AutomatonLimits limits_;
  uint8_t class_of_[256];
  std::vector<uint8_t> class_representative_;
  int num_classes_ = 0;
  int32_t start_ = kDead;

  absl::Mutex mu_;
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, int32_t> node_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<State> states_ ABSL_GUARDED_BY(mu_);
  // Looked up by span, so finding an existing state allocates nothing.
  struct StacksHash {
    using is_transparent = void;
    size_t operator()(absl::Span<const int32_t> s) const {
      return absl::Hash<absl::Span<const int32_t>>()(s);
    }
  };
  struct StacksEq {
    using is_transparent = void;
    bool operator()(absl::Span<const int32_t> a,
                    absl::Span<const int32_t> b) const {
      return a == b;
    }
  };
  // Key: the state's sorted stacks, then -1 when accepting.
  absl::flat_hash_map<std::vector<int32_t>, int32_t, StacksHash, StacksEq>
      state_ids_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> next_ ABSL_GUARDED_BY(mu_);  // state * classes + class
  std::vector<std::vector<uint32_t>> masks_ ABSL_GUARDED_BY(mu_);
  std::vector<UniformStep> uniform_ ABSL_GUARDED_BY(mu_);  // per state
  std::vector<int32_t> ascii_class_size_;  // ASCII bytes per class
  // The classes each byte of every UTF-8 sequence of U+0080..U+10FFFF can
  // fall in: one list of per-position class lists per sequence shape.
  std::vector<std::vector<std::vector<int>>> non_ascii_paths_;
  // SubtreeClasses for the vocabulary's trie and first-token trie.
  const TokenTrie* subtree_trie_[2] ABSL_GUARDED_BY(mu_) = {nullptr, nullptr};
  std::vector<uint64_t> subtree_classes_[2] ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> first_token_mask_ ABSL_GUARDED_BY(mu_);
  int64_t mask_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Scratch of Close().
  std::vector<int32_t> seeds_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> scratch_stacks_ ABSL_GUARDED_BY(mu_);
  // visited_epoch_[node] == epoch_: node seen by the current Close().
  std::vector<uint32_t> visited_epoch_ ABSL_GUARDED_BY(mu_);
  uint32_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int32_t> walk_states_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::grammar::internal
