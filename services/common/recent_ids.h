// Request ids remembered for a while after something happened to them (a
// cancel or abort that may overtake the request's own messages), bounded in
// count and, optionally, in age, so a flood of made-up ids cannot grow it
// without limit. What "cancelled before it arrived" needs in every process:
// the decode service's aborts ahead of their Admit, a stage's KV writes of a
// cancelled request, a stage's straggler chunks of a forgotten one.
//
// Not thread-safe: its owner's lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve {

class RecentIds {
 public:
  // At most `capacity` ids (the oldest goes first), none older than
  // `memory`.
  explicit RecentIds(size_t capacity,
                     absl::Duration memory = absl::InfiniteDuration())
      : capacity_(capacity), memory_(memory) {}

  // Remembers `id` (again: its first time counts); false if it was known.
  bool Insert(uint64_t id, absl::Time now = absl::Now()) {
    Prune(now);
    if (!ids_.try_emplace(id, now).second) return false;
    order_.emplace_back(now, id);
    // Erased ids leave entries behind in the order: bound it too.
    while (!order_.empty() &&
           (ids_.size() > capacity_ || order_.size() > 2 * capacity_)) {
      PopOldest();
    }
    return true;
  }
  bool Contains(uint64_t id) const { return ids_.contains(id); }
  // Forgets `id`; true if it was known.
  bool Erase(uint64_t id) { return ids_.erase(id) > 0; }
  size_t size() const { return ids_.size(); }

 private:
  // Drops the oldest entry of the order, and its id unless the id was
  // erased and remembered again since (a later entry of its own).
  void PopOldest() {
    const auto [when, id] = order_.front();
    order_.pop_front();
    auto it = ids_.find(id);
    if (it != ids_.end() && it->second == when) ids_.erase(it);
  }
  void Prune(absl::Time now) {
    while (!order_.empty() && order_.front().first < now - memory_) {
      PopOldest();
    }
  }

  const size_t capacity_;
  const absl::Duration memory_;
  absl::flat_hash_map<uint64_t, absl::Time> ids_;  // id -> remembered at
  std::deque<std::pair<absl::Time, uint64_t>> order_;
};

}  // namespace pdserve
