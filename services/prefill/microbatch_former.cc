#include "prefill/microbatch_former.h"

#include <algorithm>

namespace pdserve::prefill {

int Microbatch::num_tokens() const {
  int total = 0;
  for (const ChunkWork& c : chunks) total += c.num_tokens();
  return total;
}

MicrobatchFormer::MicrobatchFormer(int token_budget)
    : token_budget_(std::max(token_budget, 1)) {}

void MicrobatchFormer::Add(uint64_t request_id, int begin,
                           const std::vector<int>& chunk_lengths) {
  Pending pending{request_id, {}, 0};
  int at = begin;
  for (size_t i = 0; i < chunk_lengths.size(); ++i) {
    ChunkWork chunk;
    chunk.request_id = request_id;
    chunk.chunk_index = static_cast<int>(i);
    chunk.token_begin = at;
    chunk.token_end = at + chunk_lengths[i];
    chunk.kv_begin = i == 0 ? 0 : at;
    chunk.final_chunk = i + 1 == chunk_lengths.size();
    at = chunk.token_end;
    queued_tokens_ += chunk.num_tokens();
    pending.chunks.push_back(chunk);
  }
  if (!pending.chunks.empty()) queue_.push_back(std::move(pending));
}

bool MicrobatchFormer::Remove(uint64_t request_id) {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (it->request_id != request_id) continue;
    for (size_t i = it->next; i < it->chunks.size(); ++i) {
      queued_tokens_ -= it->chunks[i].num_tokens();
    }
    queue_.erase(it);
    return true;
  }
  return false;
}

std::optional<Microbatch> MicrobatchFormer::Next() {
  if (queue_.empty()) return std::nullopt;
  Microbatch batch;
  batch.id = next_id_++;
  int room = token_budget_;
  for (auto it = queue_.begin(); it != queue_.end() && room > 0;) {
    const ChunkWork& chunk = it->chunks[it->next];
    const bool alone_and_too_big =
        batch.chunks.empty() && chunk.num_tokens() > token_budget_;
    if (chunk.num_tokens() <= room || alone_and_too_big) {
      batch.chunks.push_back(chunk);
      room -= chunk.num_tokens();
      queued_tokens_ -= chunk.num_tokens();
      if (++it->next == it->chunks.size()) {
        it = queue_.erase(it);
        continue;
      }
    }
    ++it;
  }
  return batch;
}

}  // namespace pdserve::prefill
