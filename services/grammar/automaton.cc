#include "grammar/automaton.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grammar/grammar.h"

namespace pdserve::grammar::internal {
namespace {

// Subtrees smaller than this are walked node by node: asking whether a state
// loops costs a transition per byte class.
constexpr int32_t kMinSkippedSubtree = 8;

}  // namespace

// ---------------------------------------------------------------------------
// TokenTrie

TokenTrie::TokenTrie(const std::vector<std::string_view>& token_bytes) {
  std::vector<int32_t> order;
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (!token_bytes[id].empty()) order.push_back(static_cast<int32_t>(id));
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return token_bytes[a] != token_bytes[b] ? token_bytes[a] < token_bytes[b]
                                            : a < b;
  });
  // Root.
  byte_.push_back(0);
  parent_.push_back(-1);
  depth_.push_back(0);
  subtree_end_.push_back(0);
  token_begin_.push_back(0);
  std::vector<int32_t> path = {0};  // nodes of the current prefix
  std::string_view previous;
  for (int32_t id : order) {
    const std::string_view s = token_bytes[id];
    size_t common = 0;
    while (common < s.size() && common < previous.size() &&
           s[common] == previous[common]) {
      ++common;
    }
    while (path.size() > common + 1) {
      subtree_end_[path.back()] = num_nodes();
      path.pop_back();
    }
    for (size_t k = common; k < s.size(); ++k) {
      parent_.push_back(path.back());
      path.push_back(num_nodes());
      byte_.push_back(static_cast<uint8_t>(s[k]));
      depth_.push_back(static_cast<int32_t>(k + 1));
      subtree_end_.push_back(0);
      token_begin_.push_back(static_cast<int32_t>(tokens_.size()));
    }
    max_depth_ = std::max<int32_t>(max_depth_, static_cast<int32_t>(s.size()));
    tokens_.push_back(id);
    text_from_here_.resize(num_nodes(), 1);
    max_chars_.resize(num_nodes(), 0);
    has_non_ascii_.resize(num_nodes(), 0);
    // From each offset of s: valid UTF-8 (a cut-off last character allowed)
    // and how many characters.
    std::vector<uint8_t> valid(s.size() + 1, 1);
    std::vector<int32_t> chars(s.size() + 1, 0);
    for (size_t p = s.size(); p-- > 0;) {
      const uint8_t b = static_cast<uint8_t>(s[p]);
      size_t length = 0;
      uint8_t lo = 0x80, hi = 0xBF;  // the second byte's range
      if (b < 0x80) {
        length = 1;
      } else if (b >= 0xC2 && b <= 0xDF) {
        length = 2;
      } else if (b >= 0xE0 && b <= 0xEF) {
        length = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
      } else if (b >= 0xF0 && b <= 0xF4) {
        length = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
      }
      bool ok = length > 0;
      for (size_t k = 1; ok && k < length && p + k < s.size(); ++k) {
        const uint8_t c = static_cast<uint8_t>(s[p + k]);
        ok = k == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
      }
      const size_t next = std::min(p + std::max<size_t>(length, 1), s.size());
      valid[p] = ok && valid[next];
      chars[p] = std::min(255, 1 + chars[next]);
    }
    bool non_ascii = false;
    for (size_t p = s.size(); p-- > 0;) {
      const int32_t node = path[p + 1];
      non_ascii = non_ascii || static_cast<uint8_t>(s[p]) >= 0x80;
      text_from_here_[node] &= valid[p];
      max_chars_[node] = std::max<uint8_t>(max_chars_[node], chars[p]);
      if (non_ascii) has_non_ascii_[node] = 1;
    }
    previous = s;
  }
  while (!path.empty()) {
    subtree_end_[path.back()] = num_nodes();
    path.pop_back();
  }
  text_from_here_.resize(num_nodes(), 1);
  max_chars_.resize(num_nodes(), 0);
  has_non_ascii_.resize(num_nodes(), 0);
  token_begin_.push_back(static_cast<int32_t>(tokens_.size()));
}

// ---------------------------------------------------------------------------
// GrammarAutomaton

GrammarAutomaton::GrammarAutomaton(Grammar grammar,
                                   const TokenVocabulary* vocabulary,
                                   AutomatonLimits limits)
    : grammar_(std::move(grammar)), vocabulary_(vocabulary), limits_(limits) {
  // Bytes that every byte set treats alike share a class.
  absl::flat_hash_map<std::string, uint8_t> classes;
  for (int b = 0; b < 256; ++b) {
    std::string signature(grammar_.byte_sets.size(), '0');
    for (size_t i = 0; i < grammar_.byte_sets.size(); ++i) {
      if (grammar_.byte_sets[i].test(b)) signature[i] = '1';
    }
    auto [it, inserted] =
        classes.try_emplace(signature, static_cast<uint8_t>(classes.size()));
    if (inserted) class_representative_.push_back(static_cast<uint8_t>(b));
    class_of_[b] = it->second;
  }
  num_classes_ = static_cast<int>(class_representative_.size());
  ascii_class_size_.assign(num_classes_, 0);
  for (int b = 0; b < 0x80; ++b) ++ascii_class_size_[class_of_[b]];
  for (const auto& sequence : Utf8RangeSequences(0x80, 0x10FFFF)) {
    std::vector<std::vector<int>> path;
    for (const auto& [lo, hi] : sequence) {
      std::vector<int> classes;
      for (int b = lo; b <= hi; ++b) {
        if (std::find(classes.begin(), classes.end(), class_of_[b]) ==
            classes.end()) {
          classes.push_back(class_of_[b]);
        }
      }
      path.push_back(std::move(classes));
    }
    non_ascii_paths_.push_back(std::move(path));
  }
}

absl::Status GrammarAutomaton::Init() {
  absl::MutexLock lock(&mu_);
  nodes_.push_back({-1, -1});  // kAcceptNode
  seeds_.clear();
  for (int32_t alt : grammar_.rule_alternatives[grammar_.root]) {
    PDS_ASSIGN_OR_RETURN(int32_t node, InternNode(alt, kAcceptNode));
    seeds_.push_back(node);
  }
  PDS_ASSIGN_OR_RETURN(start_, Close());
  if (num_classes_ <= 64) {  // at compile time, not on the first mask
    SubtreeClasses(vocabulary_->trie());
    SubtreeClasses(vocabulary_->first_token_trie());
  }
  if (start_ == kDead) {
    return absl::InvalidArgumentError("the grammar matches no string at all");
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> GrammarAutomaton::InternNode(int32_t pos,
                                                     int32_t parent) {
  const uint64_t key =
      (static_cast<uint64_t>(static_cast<uint32_t>(pos)) << 32) |
      static_cast<uint32_t>(parent);
  auto [it, inserted] =
      node_ids_.try_emplace(key, static_cast<int32_t>(nodes_.size()));
  if (inserted) {
    if (static_cast<int64_t>(nodes_.size()) >= limits_.max_nodes) {
      node_ids_.erase(it);
      return absl::ResourceExhaustedError(absl::StrCat(
          "grammar automaton reached its limit of ", limits_.max_nodes,
          " parser stack nodes (output nested too deep or grammar too "
          "ambiguous)"));
    }
    nodes_.push_back({pos, parent});
  }
  return it->second;
}

absl::StatusOr<int32_t> GrammarAutomaton::Close() {
  scratch_stacks_.clear();
  if (++epoch_ == 0) {  // wrapped: forget every old mark
    std::fill(visited_epoch_.begin(), visited_epoch_.end(), 0);
    epoch_ = 1;
  }
  bool accepting = false;
  while (!seeds_.empty()) {
    const int32_t n = seeds_.back();
    seeds_.pop_back();
    if (static_cast<size_t>(n) >= visited_epoch_.size()) {
      visited_epoch_.resize(
          std::max<size_t>(2 * visited_epoch_.size(), n + 1024), 0);
    }
    if (visited_epoch_[n] == epoch_) continue;
    visited_epoch_[n] = epoch_;
    if (n == kAcceptNode) {
      accepting = true;
      continue;
    }
    const Node node = nodes_[n];
    const Element& e = grammar_.elements[node.pos];
    switch (e.kind) {
      case Element::Kind::kBytes:
        scratch_stacks_.push_back(n);
        if (static_cast<int64_t>(scratch_stacks_.size()) >
            limits_.max_stacks_per_state) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "grammar automaton state exceeds ", limits_.max_stacks_per_state,
              " parser stacks (the grammar is too ambiguous)"));
        }
        break;
      case Element::Kind::kEnd:
        seeds_.push_back(node.parent);
        break;
      case Element::Kind::kRule: {
        // A rule in tail position continues straight with our parent: loops
        // written as right recursion keep the stack flat.
        int32_t continuation = node.parent;
        if (grammar_.elements[node.pos + 1].kind != Element::Kind::kEnd) {
          PDS_ASSIGN_OR_RETURN(continuation,
                               InternNode(node.pos + 1, node.parent));
        }
        for (int32_t alt : grammar_.rule_alternatives[e.index]) {
          PDS_ASSIGN_OR_RETURN(int32_t child, InternNode(alt, continuation));
          seeds_.push_back(child);
        }
        break;
      }
    }
  }
  if (scratch_stacks_.empty() && !accepting) return kDead;
  std::sort(scratch_stacks_.begin(), scratch_stacks_.end());
  const size_t stacks = scratch_stacks_.size();
  if (accepting) scratch_stacks_.push_back(-1);
  const absl::Span<const int32_t> key(scratch_stacks_);
  auto found = state_ids_.find(key);
  if (found != state_ids_.end()) return found->second;
  if (static_cast<int64_t>(states_.size()) >= limits_.max_states) {
    return absl::ResourceExhaustedError(
        absl::StrCat("grammar automaton reached its limit of ",
                     limits_.max_states, " states"));
  }
  const int32_t id = static_cast<int32_t>(states_.size());
  state_ids_.emplace(std::vector<int32_t>(key.begin(), key.end()), id);
  states_.push_back({std::vector<int32_t>(scratch_stacks_.begin(),
                                          scratch_stacks_.begin() + stacks),
                     accepting});
  next_.resize(next_.size() + num_classes_, kUnknown);
  masks_.emplace_back();
  uniform_.emplace_back();
  return id;
}

absl::StatusOr<int32_t> GrammarAutomaton::Next(int32_t state, int byte_class) {
  const size_t slot = static_cast<size_t>(state) * num_classes_ + byte_class;
  if (next_[slot] != kUnknown) return next_[slot];
  const uint8_t byte = class_representative_[byte_class];
  seeds_.clear();
  for (int32_t n : states_[state].stacks) {
    const Node node = nodes_[n];
    if (grammar_.byte_sets[grammar_.elements[node.pos].index].test(byte)) {
      PDS_ASSIGN_OR_RETURN(int32_t advanced,
                           InternNode(node.pos + 1, node.parent));
      seeds_.push_back(advanced);
    }
  }
  int32_t result = kDead;
  if (!seeds_.empty()) {
    PDS_ASSIGN_OR_RETURN(result, Close());
  }
  next_[slot] = result;
  return result;
}

absl::StatusOr<int32_t> GrammarAutomaton::Walk(int32_t state,
                                               std::string_view bytes) {
  absl::MutexLock lock(&mu_);
  for (char c : bytes) {
    PDS_ASSIGN_OR_RETURN(state,
                         Next(state, class_of_[static_cast<uint8_t>(c)]));
    if (state == kDead) return kDead;
  }
  return state;
}

bool GrammarAutomaton::IsAccepting(int32_t state) {
  absl::MutexLock lock(&mu_);
  return states_[state].accepting;
}

int64_t GrammarAutomaton::num_states() {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(states_.size());
}

absl::Status GrammarAutomaton::ComputeUniformStep(int32_t state) {
  if (uniform_[state].computed) return absl::OkStatus();
  // The target most ASCII bytes lead to.
  std::vector<int32_t> targets(num_classes_, kDead);
  absl::flat_hash_map<int32_t, int32_t> bytes_to;
  int32_t best = kDead, best_bytes = 0;
  for (int c = 0; c < num_classes_; ++c) {
    if (ascii_class_size_[c] == 0) continue;
    PDS_ASSIGN_OR_RETURN(targets[c], Next(state, c));
    if (targets[c] == kDead) continue;
    const int32_t b = (bytes_to[targets[c]] += ascii_class_size_[c]);
    if (b > best_bytes) best = targets[c], best_bytes = b;
  }
  uint64_t ascii_classes = 0;
  if (best != kDead) {
    for (int c = 0; c < num_classes_; ++c) {
      if (ascii_class_size_[c] > 0 && targets[c] == best) {
        ascii_classes |= 1ull << c;
      }
    }
  }
  UniformStep& step = uniform_[state];
  step.computed = true;
  step.next = best;
  step.ascii_classes = ascii_classes;
  return absl::OkStatus();
}

absl::StatusOr<bool> GrammarAutomaton::NonAsciiLoops(int32_t state) {
  const int32_t best = state;
  bool non_ascii = true;
  // Every class path of every non-ASCII UTF-8 shape must stay alive and end
  // back at `state` (bounded: give up past a few thousand paths).
  int budget = 4096;
  std::vector<std::pair<int32_t, size_t>> stack;
  for (const auto& shape : non_ascii_paths_) {
    stack.assign(1, {state, 0});
    while (non_ascii && !stack.empty()) {
      const auto [at, position] = stack.back();
      stack.pop_back();
      if (position == shape.size()) {
        non_ascii = at == best;
        continue;
      }
      for (int c : shape[position]) {
        if (--budget < 0) {
          non_ascii = false;
          break;
        }
        PDS_ASSIGN_OR_RETURN(int32_t to, Next(at, c));
        if (to == kDead) {
          non_ascii = false;
          break;
        }
        stack.push_back({to, position + 1});
      }
    }
    if (!non_ascii) break;
  }
  return non_ascii;
}

absl::Status GrammarAutomaton::ComputeUniformRuns(int32_t state, int32_t cap) {
  PDS_RETURN_IF_ERROR(ComputeUniformStep(state));
  const uint64_t classes = uniform_[state].ascii_classes;
  int32_t run = 0;
  int32_t u = state;
  while (run < cap) {
    PDS_RETURN_IF_ERROR(ComputeUniformStep(u));
    const UniformStep& step = uniform_[u];
    if (step.next == kDead || (step.ascii_classes & classes) != classes) break;
    ++run;
    if (step.next == u) {
      run = kForever;
      break;
    }
    u = step.next;
  }
  // A run cut short by `cap` is stored as is: callers pass the same cap.
  uniform_[state].ascii_run = run;
  // Non-ASCII characters are followed only around a loop (free text): along
  // a chain of length-counting states every count would need its own
  // mid-character states built up front.
  bool non_ascii = false;
  if (run == kForever) {
    PDS_ASSIGN_OR_RETURN(non_ascii, NonAsciiLoops(state));
  }
  uniform_[state].non_ascii = non_ascii;
  uniform_[state].text_run = non_ascii ? kForever : 0;
  return absl::OkStatus();
}

const std::vector<uint64_t>& GrammarAutomaton::SubtreeClasses(
    const TokenTrie& trie) {
  const int slot =
      subtree_trie_[0] == nullptr || subtree_trie_[0] == &trie ? 0 : 1;
  if (subtree_trie_[slot] != &trie) {
    subtree_trie_[slot] = &trie;
    std::vector<uint64_t>& classes = subtree_classes_[slot];
    classes.assign(trie.num_nodes(), 0);
    for (int32_t i = trie.num_nodes() - 1; i >= 1; --i) {
      if (trie.byte_[i] < 0x80) classes[i] |= 1ull << class_of_[trie.byte_[i]];
      classes[trie.parent_[i]] |= classes[i];
    }
  }
  return subtree_classes_[slot];
}

absl::Status GrammarAutomaton::ComputeMask(int32_t state, const TokenTrie& trie,
                                           std::vector<uint32_t>* mask) {
  mask->assign((vocabulary_->size() + 31) / 32, 0);
  walk_states_.resize(trie.max_depth() + 1);
  walk_states_[0] = state;
  const int32_t n = trie.num_nodes();
  const uint8_t* bytes = trie.byte_.data();
  const int32_t* depths = trie.depth_.data();
  const int32_t* ends = trie.subtree_end_.data();
  const uint8_t* text_from_here = trie.text_from_here_.data();
  const uint8_t* max_chars = trie.max_chars_.data();
  const uint8_t* non_ascii = trie.has_non_ascii_.data();
  const int32_t* token_begin = trie.token_begin_.data();
  const int32_t* tokens = trie.tokens_.data();
  uint32_t* out = mask->data();
  // A subtree whose bytes all lead from the current state back to it is
  // accepted whole without walking it (text inside a JSON string, say).
  const bool can_skip = num_classes_ <= 64;
  const uint64_t* subtree_classes =
      can_skip ? SubtreeClasses(trie).data() : nullptr;
  for (int32_t i = 1; i < n;) {
    const int32_t from = walk_states_[depths[i] - 1];
    if (can_skip && ends[i] - i >= kMinSkippedSubtree && text_from_here[i]) {
      // Every token of the subtree is text (valid UTF-8 from here) whose
      // characters all step uniformly for as many characters as it has: all
      // accepted (inside a string, also a length-bounded one, where each
      // remaining length is its own state).
      if (uniform_[from].ascii_run < 0) {
        PDS_RETURN_IF_ERROR(ComputeUniformRuns(from, trie.max_depth()));
      }
      const UniformStep& step = uniform_[from];
      const int32_t run = non_ascii[i] ? step.text_run : step.ascii_run;
      if ((subtree_classes[i] & ~step.ascii_classes) == 0 &&
          max_chars[i] <= run) {
        for (int32_t k = token_begin[i]; k < token_begin[ends[i]]; ++k) {
          out[tokens[k] >> 5] |= 1u << (tokens[k] & 31);
        }
        i = ends[i];
        continue;
      }
    }
    const int byte_class = class_of_[bytes[i]];
    int32_t to = next_[static_cast<size_t>(from) * num_classes_ + byte_class];
    if (to == kUnknown) {
      PDS_ASSIGN_OR_RETURN(to, Next(from, byte_class));
    }
    if (to == kDead) {
      i = ends[i];
      continue;
    }
    walk_states_[depths[i]] = to;
    for (int32_t k = token_begin[i]; k < token_begin[i + 1]; ++k) {
      out[tokens[k] >> 5] |= 1u << (tokens[k] & 31);
    }
    ++i;
  }
  if (states_[state].accepting) {
    for (int32_t eos : vocabulary_->eos_ids())
      out[eos >> 5] |= 1u << (eos & 31);
  }
  return absl::OkStatus();
}

absl::Status GrammarAutomaton::FillMask(int32_t state, bool first_token,
                                        std::span<uint32_t> mask) {
  absl::MutexLock lock(&mu_);
  std::vector<uint32_t>* cached =
      first_token ? &first_token_mask_ : &masks_[state];
  if (cached->empty()) {
    const TokenTrie& trie =
        first_token ? vocabulary_->first_token_trie() : vocabulary_->trie();
    std::vector<uint32_t> computed;
    PDS_RETURN_IF_ERROR(ComputeMask(state, trie, &computed));
    const int64_t bytes = static_cast<int64_t>(computed.size()) * 4;
    if (mask_bytes_ + bytes > limits_.max_mask_cache_bytes) {
      // Simple bound: start the cache over.
      for (auto& m : masks_) std::vector<uint32_t>().swap(m);
      mask_bytes_ = static_cast<int64_t>(first_token_mask_.size()) * 4;
    }
    mask_bytes_ += bytes;
    cached = first_token ? &first_token_mask_ : &masks_[state];
    *cached = std::move(computed);
  }
  std::memcpy(mask.data(), cached->data(), cached->size() * sizeof(uint32_t));
  return absl::OkStatus();
}

}  // namespace pdserve::grammar::internal
