// A draft-model proposer: a smaller Llama (sharing the target's tokenizer)
// run unsharded in the scheduler thread, with its own KvPool, block manager
// and one KvSequence per request. Each Propose brings the draft's cache in
// line with the request's accepted history — truncating to the longest common
// prefix (rolling back rejected drafts) and prefilling what is missing — then
// drafts γ tokens autoregressively, batched across requests. Greedy requests
// get arg-max drafts (deterministic, q one-hot); sampling requests draw from
// the draft's SamplingDistribution with kDraftStream and report q.
// A request the draft pool cannot hold simply gets no proposal.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/engine_types.h"
#include "model/weight_source.h"
#include "speculative/proposer.h"

namespace pdserve::speculative {

struct DraftModelOptions {
  int num_threads = 1;
  int block_size = 16;
  int64_t num_blocks = 256;
  // Draft cost per token relative to one target decode step (feeds the
  // adaptive γ); e.g. draft layers / target layers.
  double cost_per_token = 0.2;
  // Where the draft runs: a decode worker on GPUs runs its draft on rank 0's
  // GPU too (KV pool in device memory), so drafting never waits on the CPU.
  engine::Backend backend = engine::Backend::kCpu;
  engine::CudaOptions cuda;
};

// `weights` must outlive the proposer. INVALID_ARGUMENT if the engine cannot
// be built or the options are out of range.
[[nodiscard]] absl::StatusOr<std::unique_ptr<Proposer>> MakeDraftModelProposer(
    const model::WeightSource& weights, const DraftModelOptions& options);

}  // namespace pdserve::speculative
