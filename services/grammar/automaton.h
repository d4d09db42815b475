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
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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
  std::vector<int32_t> height_;  // bytes from a node to its deepest descendant, +1
  std::vector<int32_t> token_begin_;  // num_nodes + 1 entries
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
  // A state's uniform step: the byte classes (bit c) that all lead to one
  // state `next` (the most bytes' target; itself for a loop), and `run`: for
  // how many bytes in a row those classes keep stepping uniformly, following
  // next, next's next, ... (kForever for a loop). Computed on first use.
  struct UniformStep {
    uint64_t classes = 0;
    int32_t next = -1;
    int32_t run = -1;  // -1: not computed yet
  };
  static constexpr int32_t kForever = 1 << 30;
  absl::Status ComputeUniformStep(int32_t state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int32_t> UniformRun(int32_t state, int32_t cap)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Per trie node, the byte classes of its subtree (itself included).
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
  absl::flat_hash_map<std::vector<int32_t>, int32_t> state_ids_
      ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> next_ ABSL_GUARDED_BY(mu_);  // state * classes + class
  std::vector<std::vector<uint32_t>> masks_ ABSL_GUARDED_BY(mu_);
  std::vector<UniformStep> uniform_ ABSL_GUARDED_BY(mu_);  // per state
  std::vector<int32_t> class_size_;  // bytes per class
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
