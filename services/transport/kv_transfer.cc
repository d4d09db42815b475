#include "transport/kv_transfer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "transport/wire.h"

namespace pdserve::transport {
namespace {

constexpr uint32_t kSinkMagic = 0x50444b53;   // "PDKS"
constexpr uint32_t kGrantMagic = 0x50444b47;  // "PDKG"

// Message kinds of the KV protocol on the worker's message channel.
enum : uint16_t {
  kHello = 0x4b01,     // source -> sink: address, spec, layout
  kHelloAck = 0x4b02,  // sink -> source: accepted or why not
  kWritten =
      0x4b03,        // source -> sink: a (request, layers, tokens) range landed
  kRevoke = 0x4b04,  // sink -> source: stop writing this request
  kCancel = 0x4b05,  // source -> sink: this request is abandoned
  kRevokeAck = 0x4b06,  // source -> sink: no write of it can land any more
};

void PutSpec(ByteWriter& w, const KvModelSpec& s) {
  w.PutBytes(s.model_id);
  w.Put<int32_t>(static_cast<int32_t>(s.dtype));
  w.Put<int32_t>(s.block_size);
  w.Put<int32_t>(s.head_dim);
  w.Put<int32_t>(s.num_layers);
  w.Put<int32_t>(s.num_kv_heads);
}

bool GetSpec(ByteReader& r, KvModelSpec* s) {
  int32_t dtype = 0;
  if (!r.GetBytes(&s->model_id, 4096) || !r.Get(&dtype) ||
      !r.Get(&s->block_size) || !r.Get(&s->head_dim) ||
      !r.Get(&s->num_layers) || !r.Get(&s->num_kv_heads)) {
    return false;
  }
  if (dtype < 0 || dtype > 2) return false;
  s->dtype = static_cast<kv::KvDType>(dtype);
  return true;
}

void PutLayout(ByteWriter& w, const kv::KvCacheLayout& l) {
  w.Put<int32_t>(l.layer_offset);
  w.Put<int32_t>(l.num_layers);
  w.Put<int32_t>(l.kv_head_offset);
  w.Put<int32_t>(l.num_kv_heads);
}

// The block size / head dim / dtype of a layout come from the spec, which
// the handshake checks.
bool GetLayout(ByteReader& r, const KvModelSpec& spec, kv::KvCacheLayout* l) {
  if (!r.Get(&l->layer_offset) || !r.Get(&l->num_layers) ||
      !r.Get(&l->kv_head_offset) || !r.Get(&l->num_kv_heads)) {
    return false;
  }
  l->block_size = spec.block_size;
  l->head_dim = spec.head_dim;
  l->dtype = spec.dtype;
  return l->Validate().ok() &&
         l->layer_offset + l->num_layers <= spec.num_layers &&
         l->kv_head_offset + l->num_kv_heads <= spec.num_kv_heads;
}

absl::Status CheckLayoutMatchesSpec(const kv::KvCacheLayout& l,
                                    const KvModelSpec& s) {
  PDS_RETURN_IF_ERROR(l.Validate());
  if (l.block_size != s.block_size || l.head_dim != s.head_dim ||
      l.dtype != s.dtype || l.layer_offset + l.num_layers > s.num_layers ||
      l.kv_head_offset + l.num_kv_heads > s.num_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool layout ", l.DebugString(),
                     " does not fit model spec ", s.model_id));
  }
  return absl::OkStatus();
}

struct WrittenNotice {
  uint64_t request_id = 0;
  int32_t layer_begin = 0, layer_end = 0;
  int64_t token_begin = 0, token_end = 0;
};

// Adds [b, e) to the sorted disjoint interval list; returns how many new
// positions it covered.
int64_t AddInterval(std::vector<std::pair<int64_t, int64_t>>& v, int64_t b,
                    int64_t e) {
  int64_t before = 0;
  for (auto& [x, y] : v) before += y - x;
  v.emplace_back(b, e);
  std::sort(v.begin(), v.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (auto& iv : v) {
    if (!merged.empty() && iv.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, iv.second);
    } else {
      merged.push_back(iv);
    }
  }
  v = std::move(merged);
  int64_t after = 0;
  for (auto& [x, y] : v) after += y - x;
  return after - before;
}

}  // namespace

absl::Status CheckCompatible(const KvModelSpec& local,
                             const KvModelSpec& remote) {
  auto differ = [](absl::string_view field, const auto& a, const auto& b) {
    return absl::FailedPreconditionError(
        absl::StrCat("incompatible KV peer: ", field, " is ", a, " here but ",
                     b, " at the peer"));
  };
  if (local.model_id != remote.model_id) {
    return differ("model identity", absl::StrCat("'", local.model_id, "'"),
                  absl::StrCat("'", remote.model_id, "'"));
  }
  if (local.dtype != remote.dtype) {
    return differ("dtype (bytes)", kv::KvDTypeSize(local.dtype),
                  absl::StrCat(kv::KvDTypeSize(remote.dtype), " (enum ",
                               static_cast<int>(remote.dtype), ")"));
  }
  if (local.block_size != remote.block_size) {
    return differ("block size", local.block_size, remote.block_size);
  }
  if (local.head_dim != remote.head_dim) {
    return differ("head dim", local.head_dim, remote.head_dim);
  }
  if (local.num_layers != remote.num_layers) {
    return differ("layer count", local.num_layers, remote.num_layers);
  }
  if (local.num_kv_heads != remote.num_kv_heads) {
    return differ("KV head count", local.num_kv_heads, remote.num_kv_heads);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PutSegment>> PlanKvCopy(
    const kv::KvCacheLayout& src, std::span<const int64_t> src_blocks,
    const kv::KvCacheLayout& dst, std::span<const int64_t> dst_blocks,
    int layer_begin, int layer_end, int64_t token_begin, int64_t token_end) {
  PDS_RETURN_IF_ERROR(src.Validate());
  PDS_RETURN_IF_ERROR(dst.Validate());
  if (src.block_size != dst.block_size || src.head_dim != dst.head_dim ||
      src.dtype != dst.dtype) {
    return absl::InvalidArgumentError(
        "source and destination block shapes differ");
  }
  if (layer_begin >= layer_end || layer_begin < src.layer_offset ||
      layer_end > src.layer_offset + src.num_layers ||
      layer_begin < dst.layer_offset ||
      layer_end > dst.layer_offset + dst.num_layers) {
    return absl::OutOfRangeError(absl::StrCat(
        "layers [", layer_begin, ",", layer_end, ") not held by both source ",
        src.DebugString(), " and destination ", dst.DebugString()));
  }
  if (dst.kv_head_offset < src.kv_head_offset ||
      dst.kv_head_offset + dst.num_kv_heads >
          src.kv_head_offset + src.num_kv_heads) {
    return absl::OutOfRangeError("destination KV heads not held by the source");
  }
  const int bs = src.block_size;
  if (token_begin < 0 || token_begin >= token_end) {
    return absl::OutOfRangeError(
        absl::StrCat("empty token range [", token_begin, ",", token_end, ")"));
  }
  const int64_t blocks_needed = (token_end + bs - 1) / bs;
  if (blocks_needed > static_cast<int64_t>(src_blocks.size()) ||
      blocks_needed > static_cast<int64_t>(dst_blocks.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("tokens up to ", token_end, " need ", blocks_needed,
                     " blocks; source has ", src_blocks.size(),
                     ", destination ", dst_blocks.size()));
  }
  const int64_t es = static_cast<int64_t>(kv::KvDTypeSize(src.dtype));
  std::vector<PutSegment> segs;
  for (int64_t bi = token_begin / bs; bi < blocks_needed; ++bi) {
    const int64_t sb = src_blocks[bi], db = dst_blocks[bi];
    if (sb < 0 || db < 0) return absl::OutOfRangeError("negative block id");
    const int s0 = static_cast<int>(std::max(token_begin, bi * bs) - bi * bs);
    const int s1 =
        static_cast<int>(std::min(token_end, (bi + 1) * bs) - bi * bs);
    const uint64_t len = static_cast<uint64_t>(s1 - s0) * src.head_dim * es;
    for (int layer = layer_begin; layer < layer_end; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = dst.kv_head_offset;
             h < dst.kv_head_offset + dst.num_kv_heads; ++h) {
          const uint64_t so = src.Offset(sb, layer - src.layer_offset, kv,
                                         h - src.kv_head_offset, s0) *
                              es;
          const uint64_t dof = dst.Offset(db, layer - dst.layer_offset, kv,
                                          h - dst.kv_head_offset, s0) *
                               es;
          if (!segs.empty() &&
              segs.back().src_offset + segs.back().length == so &&
              segs.back().dst_offset + segs.back().length == dof) {
            segs.back().length += len;
          } else {
            segs.push_back(PutSegment{so, dof, len});
          }
        }
      }
    }
  }
  return segs;
}

absl::StatusOr<std::unique_ptr<kv::KvPool>> AllocateKvPool(
    UcxWorker* worker, const kv::KvCacheLayout& layout, int64_t num_blocks) {
  PDS_RETURN_IF_ERROR(layout.Validate());
  if (num_blocks <= 0) return absl::InvalidArgumentError("no blocks");
  const int64_t bytes = num_blocks * layout.block_bytes();
  PDS_ASSIGN_OR_RETURN(std::unique_ptr<MemoryRegion> region,
                       worker->Allocate(static_cast<size_t>(bytes)));
  // Zeroed like KvPool::Create, and touched now so that the first transfer
  // does not pay the page faults.
  std::memset(region->base(), 0, static_cast<size_t>(bytes));
  void* base = region->base();
  std::shared_ptr<MemoryRegion> owner(std::move(region));
  return kv::KvPool::Wrap(layout, num_blocks, base, bytes,
                          [owner]() mutable { owner.reset(); });
}

// ===========================================================================
// Sink
// ===========================================================================

struct KvSink::Impl : std::enable_shared_from_this<KvSink::Impl> {
  UcxWorker* worker = nullptr;
  kv::KvCacheLayout pool_layout;  // of the memory behind `region`
  int64_t num_blocks = 0;
  KvModelSpec spec;
  KvSinkOptions options;
  std::unique_ptr<MemoryRegion> region;
  std::string descriptor;

  struct Source {
    std::shared_ptr<UcxEndpoint> ep;
    kv::KvCacheLayout layout;
    bool accepted = false;
    bool dead = false;
  };
  struct Request {
    int64_t num_tokens = 0;
    std::vector<int64_t> blocks;
    absl::Duration lease;
    absl::Time deadline;
    std::vector<std::vector<std::pair<int64_t, int64_t>>>
        covered;  // per pool layer
    int64_t covered_cells = 0;
    bool done = false;
    // Failure side effects ran: every live source confirmed the revoke (or
    // the quarantine ran out) and the blocks were released. Wait reports a
    // failure only then, so its caller sees the blocks freed.
    bool settled = false;
    absl::Status status;
    std::set<uint64_t> writers;
    // Failed, not settled: sources whose revoke confirmation is awaited.
    std::set<uint64_t> awaiting_acks;
    absl::Time quarantine_deadline;
    bool erase_when_settled = false;  // nobody will Wait (sink-side Cancel)
    bool releasing = false;           // quarantine over, callback pending
  };

  mutable absl::Mutex mu;
  std::map<uint64_t, Source> sources ABSL_GUARDED_BY(mu);
  std::map<uint64_t, Request> requests ABSL_GUARDED_BY(mu);
  std::set<int64_t> blocks_in_use ABSL_GUARDED_BY(mu);

  struct Release {
    uint64_t request_id;
    absl::Status why;
    std::vector<std::shared_ptr<UcxEndpoint>> notify;
  };

  // Marks a request failed and quarantines its blocks: they stay reserved
  // until every live source confirmed (after flushing its endpoint) that no
  // write of the request can still land, or the quarantine runs out. The
  // caller runs the returned Release (the revokes) after dropping `mu`.
  Release FailLocked(uint64_t id, Request& r, absl::Status why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    r.done = true;
    r.status = why;
    r.quarantine_deadline = absl::Now() + options.revoke_quarantine;
    Release out{id, why, {}};
    for (auto& [uid, s] : sources) {
      if (s.accepted && !s.dead) {
        out.notify.push_back(s.ep);
        r.awaiting_acks.insert(uid);
      }
    }
    return out;
  }

  struct Freed {
    uint64_t request_id;
    std::vector<int64_t> blocks;
    absl::Status why;
  };

  // Ends the quarantine of a failed request: its blocks leave the in-use set
  // and go to release_blocks (RunFreed), after which it is settled.
  Freed EndQuarantineLocked(uint64_t id, Request& r)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    r.releasing = true;
    r.awaiting_acks.clear();
    for (int64_t b : r.blocks) blocks_in_use.erase(b);
    return Freed{id, r.blocks, r.status};
  }

  // Failed requests with no confirmation left or past their quarantine.
  std::vector<Freed> CollectSettledLocked(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::vector<Freed> out;
    for (auto& [id, r] : requests) {
      if (r.done && !r.settled && !r.releasing &&
          (r.awaiting_acks.empty() || now > r.quarantine_deadline)) {
        if (!r.awaiting_acks.empty()) {
          PDS_LOG(WARNING) << "transport: KV request " << id
                           << " released after its revoke quarantine without "
                           << r.awaiting_acks.size()
                           << " source confirmation(s)";
        }
        out.push_back(EndQuarantineLocked(id, r));
      }
    }
    return out;
  }

  // Releases the blocks, then marks the requests settled (Wait returns only
  // after the release callback ran).
  void RunFreed(std::vector<Freed> freed) {
    for (auto& f : freed) {
      if (options.release_blocks) {
        options.release_blocks(f.request_id, f.blocks, f.why);
      }
      absl::MutexLock l(&mu);
      auto it = requests.find(f.request_id);
      if (it == requests.end()) continue;
      if (it->second.erase_when_settled) {
        requests.erase(it);
      } else {
        it->second.settled = true;
      }
    }
  }

  // Sends the revokes, then settles what needs no confirmation.
  void RunRelease(Release rel) {
    PDS_LOG(WARNING) << "transport: KV request " << rel.request_id
                     << " failed: " << rel.why.message();
    ByteWriter w;
    w.Put(rel.request_id);
    w.PutBytes(rel.why.message());
    std::string msg = w.Take();
    for (auto& ep : rel.notify) {
      // Best effort: a dead source is caught by its failure handler or the
      // quarantine.
      auto sent = ep->Send(kRevoke, msg);
      (void)sent;
    }
    std::vector<Freed> freed;
    {
      absl::MutexLock l(&mu);
      freed = CollectSettledLocked(absl::Now());
    }
    RunFreed(std::move(freed));
  }

  void OnRevokeAck(uint64_t peer, std::string payload) {
    ByteReader r(payload);
    uint64_t id = 0;
    if (!r.Get(&id) || !r.empty()) return;
    std::vector<Freed> freed;
    {
      absl::MutexLock l(&mu);
      auto it = requests.find(id);
      if (it == requests.end()) return;
      it->second.awaiting_acks.erase(peer);
      freed = CollectSettledLocked(absl::Now());
    }
    RunFreed(std::move(freed));
  }

  void OnHello(uint64_t peer, std::string payload) {
    ByteReader r(payload);
    std::string address;
    KvModelSpec remote;
    kv::KvCacheLayout layout;
    bool ok = r.GetBytes(&address, 1 << 20) && GetSpec(r, &remote) &&
              GetLayout(r, remote, &layout) && r.empty();
    if (!ok) {
      PDS_LOG(WARNING) << "transport: malformed KV hello from "
                       << absl::StrCat(absl::Hex(peer));
      return;
    }
    auto ep = worker->Connect(address);
    if (!ep.ok()) {
      PDS_LOG(WARNING) << "transport: cannot reach KV source: " << ep.status();
      return;
    }
    absl::Status verdict = CheckCompatible(spec, remote);
    const kv::KvCacheLayout& mine = pool_layout;
    if (verdict.ok() && (mine.kv_head_offset < layout.kv_head_offset ||
                         mine.kv_head_offset + mine.num_kv_heads >
                             layout.kv_head_offset + layout.num_kv_heads)) {
      verdict = absl::FailedPreconditionError(
          absl::StrCat("incompatible KV peer: source holds KV heads [",
                       layout.kv_head_offset, ",",
                       layout.kv_head_offset + layout.num_kv_heads,
                       ") but this rank needs [", mine.kv_head_offset, ",",
                       mine.kv_head_offset + mine.num_kv_heads, ")"));
    }
    {
      absl::MutexLock l(&mu);
      sources[peer] = Source{*ep, layout, verdict.ok(), false};
    }
    if (verdict.ok()) {
      PDS_LOG(INFO) << "transport: accepted KV source "
                    << absl::StrCat(absl::Hex(peer)) << " "
                    << layout.DebugString();
    } else {
      PDS_LOG(WARNING) << "transport: refused KV source "
                       << absl::StrCat(absl::Hex(peer)) << ": "
                       << verdict.message();
    }
    ByteWriter w;
    w.Put<uint8_t>(verdict.ok() ? 1 : 0);
    w.PutBytes(verdict.message());
    auto sent = (*ep)->Send(kHelloAck, w.Take());
    (void)sent;
  }

  void OnWritten(uint64_t peer, std::string payload) {
    ByteReader r(payload);
    WrittenNotice n;
    if (!r.Get(&n.request_id) || !r.Get(&n.layer_begin) ||
        !r.Get(&n.layer_end) || !r.Get(&n.token_begin) ||
        !r.Get(&n.token_end) || !r.empty()) {
      PDS_LOG(WARNING) << "transport: malformed KV notice from "
                       << absl::StrCat(absl::Hex(peer));
      return;
    }
    absl::MutexLock l(&mu);
    auto sit = sources.find(peer);
    if (sit == sources.end() || !sit->second.accepted) {
      PDS_LOG(WARNING) << "transport: KV notice from unaccepted peer "
                       << absl::StrCat(absl::Hex(peer));
      return;
    }
    auto rit = requests.find(n.request_id);
    if (rit == requests.end() || rit->second.done)
      return;  // revoked / finished
    Request& req = rit->second;
    const kv::KvCacheLayout& mine = pool_layout;
    if (n.layer_begin < mine.layer_offset || n.layer_begin >= n.layer_end ||
        n.layer_end > mine.layer_offset + mine.num_layers ||
        n.token_begin < 0 || n.token_begin >= n.token_end ||
        n.token_end > req.num_tokens) {
      PDS_LOG(WARNING) << "transport: KV notice out of range for request "
                       << n.request_id;
      return;
    }
    for (int layer = n.layer_begin; layer < n.layer_end; ++layer) {
      req.covered_cells += AddInterval(req.covered[layer - mine.layer_offset],
                                       n.token_begin, n.token_end);
    }
    req.writers.insert(peer);
    req.deadline = absl::Now() + req.lease;
    if (req.covered_cells == int64_t{mine.num_layers} * req.num_tokens) {
      req.done = true;
      req.settled = true;
      req.status = absl::OkStatus();
      for (int64_t b : req.blocks) blocks_in_use.erase(b);
    }
  }

  void OnCancel(uint64_t peer, std::string payload) {
    ByteReader r(payload);
    uint64_t id = 0;
    std::string why;
    if (!r.Get(&id) || !r.GetBytes(&why, 4096)) return;
    std::optional<Release> rel;
    {
      absl::MutexLock l(&mu);
      auto sit = sources.find(peer);
      auto rit = requests.find(id);
      if (sit == sources.end() || !sit->second.accepted ||
          rit == requests.end() || rit->second.done) {
        return;
      }
      rel = FailLocked(
          id, rit->second,
          absl::CancelledError(absl::StrCat("cancelled by source: ", why)));
    }
    RunRelease(std::move(*rel));
  }

  void OnPeerFailure(uint64_t peer, const absl::Status& why) {
    std::vector<Release> rels;
    {
      absl::MutexLock l(&mu);
      auto sit = sources.find(peer);
      if (sit == sources.end()) return;
      sit->second.dead = true;
      for (auto& [id, req] : requests) {
        // A dead source writes nothing more: stop waiting for it.
        req.awaiting_acks.erase(peer);
        if (!req.done && req.writers.count(peer) != 0) {
          rels.push_back(FailLocked(id, req,
                                    absl::UnavailableError(absl::StrCat(
                                        "KV source died: ", why.message()))));
        }
      }
    }
    for (auto& rel : rels) RunRelease(std::move(rel));
    std::vector<Freed> freed;
    {
      absl::MutexLock l(&mu);
      freed = CollectSettledLocked(absl::Now());
    }
    RunFreed(std::move(freed));
  }

  void OnTick() {
    std::vector<Release> rels;
    {
      absl::MutexLock l(&mu);
      absl::Time now = absl::Now();
      for (auto& [id, req] : requests) {
        if (!req.done && now > req.deadline) {
          rels.push_back(FailLocked(id, req,
                                    absl::DeadlineExceededError(absl::StrCat(
                                        "KV lease expired: no write for ",
                                        absl::FormatDuration(req.lease)))));
        }
      }
    }
    for (auto& rel : rels) RunRelease(std::move(rel));
    std::vector<Freed> freed;
    {
      absl::MutexLock l(&mu);
      freed = CollectSettledLocked(absl::Now());
    }
    RunFreed(std::move(freed));
  }
};

absl::StatusOr<std::unique_ptr<KvSink>> KvSink::Create(UcxWorker* worker,
                                                       kv::KvPool* pool,
                                                       const KvModelSpec& spec,
                                                       KvSinkOptions options) {
  PDS_ASSIGN_OR_RETURN(
      std::unique_ptr<MemoryRegion> region,
      worker->Register(pool->data(), static_cast<size_t>(pool->size_bytes())));
  return Create(worker, pool->layout(), pool->num_blocks(), std::move(region),
                spec, std::move(options));
}

absl::StatusOr<std::unique_ptr<KvSink>> KvSink::Create(
    UcxWorker* worker, const kv::KvCacheLayout& layout, int64_t num_blocks,
    std::unique_ptr<MemoryRegion> region, const KvModelSpec& spec,
    KvSinkOptions options) {
  PDS_RETURN_IF_ERROR(CheckLayoutMatchesSpec(layout, spec));
  if (num_blocks <= 0 ||
      region->length() <
          static_cast<size_t>(num_blocks * layout.block_bytes())) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV sink region of ", region->length(),
                     " bytes cannot hold ", num_blocks, " blocks"));
  }
  auto impl = std::make_shared<Impl>();
  impl->worker = worker;
  impl->pool_layout = layout;
  impl->num_blocks = num_blocks;
  impl->spec = spec;
  impl->options = std::move(options);
  impl->region = std::move(region);
  ByteWriter w;
  w.Put(kSinkMagic);
  w.Put(worker->uid());
  PutSpec(w, spec);
  PutLayout(w, layout);
  w.Put<int64_t>(num_blocks);
  w.PutBytes(worker->address());
  w.PutBytes(impl->region->descriptor());
  impl->descriptor = w.Take();

  std::weak_ptr<Impl> weak = impl;
  worker->SetMessageHandler(kHello, [weak](uint64_t peer, std::string p) {
    if (auto s = weak.lock()) s->OnHello(peer, std::move(p));
  });
  worker->SetMessageHandler(kWritten, [weak](uint64_t peer, std::string p) {
    if (auto s = weak.lock()) s->OnWritten(peer, std::move(p));
  });
  worker->SetMessageHandler(kCancel, [weak](uint64_t peer, std::string p) {
    if (auto s = weak.lock()) s->OnCancel(peer, std::move(p));
  });
  worker->SetMessageHandler(kRevokeAck, [weak](uint64_t peer, std::string p) {
    if (auto s = weak.lock()) s->OnRevokeAck(peer, std::move(p));
  });
  worker->AddPeerFailureHandler([weak](uint64_t peer, absl::Status why) {
    if (auto s = weak.lock()) s->OnPeerFailure(peer, why);
  });
  worker->AddTickHandler([weak]() {
    if (auto s = weak.lock()) s->OnTick();
  });
  return std::unique_ptr<KvSink>(new KvSink(std::move(impl)));
}

KvSink::~KvSink() {
  for (uint16_t kind : {kHello, kWritten, kCancel, kRevokeAck}) {
    impl_->worker->SetMessageHandler(kind, nullptr);
  }
  // No block outlives its request: what is still in flight is cancelled and
  // revoked at its sources, and everything unsettled is released now (the
  // sink's memory is going away, so there is nothing left to quarantine).
  std::vector<Impl::Release> rels;
  {
    absl::MutexLock l(&impl_->mu);
    for (auto& [id, req] : impl_->requests) {
      if (!req.done) {
        rels.push_back(impl_->FailLocked(
            id, req, absl::CancelledError("KV sink shut down")));
      }
    }
  }
  for (auto& rel : rels) impl_->RunRelease(std::move(rel));
  std::vector<Impl::Freed> freed;
  {
    absl::MutexLock l(&impl_->mu);
    freed = impl_->CollectSettledLocked(absl::InfiniteFuture());
  }
  impl_->RunFreed(std::move(freed));
}

const std::string& KvSink::descriptor() const { return impl_->descriptor; }

absl::StatusOr<std::string> KvSink::Expect(uint64_t request_id,
                                           int64_t num_tokens,
                                           std::vector<int64_t> blocks,
                                           absl::Duration lease) {
  const kv::KvCacheLayout& layout = impl_->pool_layout;
  if (num_tokens <= 0)
    return absl::InvalidArgumentError("request with no tokens");
  const int64_t needed =
      (num_tokens + layout.block_size - 1) / layout.block_size;
  if (static_cast<int64_t>(blocks.size()) < needed) {
    return absl::InvalidArgumentError(absl::StrCat(
        num_tokens, " tokens need ", needed, " blocks, got ", blocks.size()));
  }
  std::set<int64_t> unique(blocks.begin(), blocks.end());
  if (unique.size() != blocks.size()) {
    return absl::InvalidArgumentError("duplicate destination block");
  }
  for (int64_t b : blocks) {
    if (b < 0 || b >= impl_->num_blocks) {
      return absl::OutOfRangeError(absl::StrCat(
          "block ", b, " outside the pool of ", impl_->num_blocks));
    }
  }
  if (lease <= absl::ZeroDuration()) lease = impl_->options.default_lease;
  {
    absl::MutexLock l(&impl_->mu);
    if (impl_->requests.count(request_id) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("request ", request_id, " exists"));
    }
    for (int64_t b : blocks) {
      if (impl_->blocks_in_use.count(b) != 0) {
        return absl::AlreadyExistsError(absl::StrCat(
            "block ", b, " is already granted to another request"));
      }
    }
    Impl::Request& r = impl_->requests[request_id];
    r.num_tokens = num_tokens;
    r.blocks = blocks;
    r.lease = lease;
    r.deadline = absl::Now() + lease;
    r.covered.resize(layout.num_layers);
    impl_->blocks_in_use.insert(blocks.begin(), blocks.end());
  }
  ByteWriter w;
  w.Put(kGrantMagic);
  w.Put(impl_->worker->uid());
  w.Put(request_id);
  w.Put(num_tokens);
  w.Put<uint64_t>(blocks.size());
  for (int64_t b : blocks) w.Put(b);
  return w.Take();
}

absl::Status KvSink::Wait(uint64_t request_id, absl::Duration timeout) {
  absl::MutexLock l(&impl_->mu);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mu) {
    auto it = impl_->requests.find(request_id);
    return it == impl_->requests.end() ||
           (it->second.done && it->second.settled);
  };
  bool finished = impl_->mu.AwaitWithTimeout(absl::Condition(&done), timeout);
  auto it = impl_->requests.find(request_id);
  if (it == impl_->requests.end()) {
    return absl::NotFoundError(absl::StrCat("no KV request ", request_id));
  }
  if (!finished) {
    return absl::DeadlineExceededError(
        absl::StrCat("KV request ", request_id, " incomplete after ",
                     absl::FormatDuration(timeout)));
  }
  absl::Status s = it->second.status;
  impl_->requests.erase(it);
  return s;
}

absl::Status KvSink::Cancel(uint64_t request_id, bool* settled) {
  if (settled != nullptr) *settled = false;
  std::optional<Impl::Release> rel;
  {
    absl::MutexLock l(&impl_->mu);
    auto it = impl_->requests.find(request_id);
    if (it == impl_->requests.end()) {
      return absl::NotFoundError(absl::StrCat("no KV request ", request_id));
    }
    if (it->second.settled) {
      impl_->requests.erase(it);
      if (settled != nullptr) *settled = true;
      return absl::OkStatus();
    }
    if (!it->second.done) {
      rel = impl_->FailLocked(request_id, it->second,
                              absl::CancelledError("cancelled by the sink"));
    }
    // Blocks are released once the sources confirmed the revoke.
    it->second.erase_when_settled = true;
  }
  if (rel) impl_->RunRelease(std::move(*rel));
  return absl::OkStatus();
}

int64_t KvSink::active_requests() const {
  absl::MutexLock l(&impl_->mu);
  int64_t n = 0;
  for (auto& [id, r] : impl_->requests) n += r.done ? 0 : 1;
  return n;
}

int64_t KvSink::accepted_sources() const {
  absl::MutexLock l(&impl_->mu);
  int64_t n = 0;
  for (auto& [id, s] : impl_->sources) n += s.accepted ? 1 : 0;
  return n;
}

// ===========================================================================
// Source
// ===========================================================================

struct KvSource::Impl {
  UcxWorker* worker = nullptr;
  kv::KvPool* pool = nullptr;
  KvModelSpec spec;
  KvSourceOptions options;
  std::unique_ptr<MemoryRegion> region;

  struct Sink {
    uint64_t uid = 0;
    kv::KvCacheLayout layout;
    int64_t num_blocks = 0;
    std::shared_ptr<UcxEndpoint> ep;
    std::unique_ptr<RemoteRegion> region;  // destroyed before ep
  };
  struct Grant {
    Sink* sink = nullptr;
    int64_t num_tokens = 0;
    std::vector<int64_t> blocks;
    // Byte ranges of the granted blocks in the sink's region, sorted, merged.
    std::vector<std::pair<uint64_t, uint64_t>> allowed;
  };
  struct Request {
    std::vector<Grant> grants;
    absl::Status revoked;
  };

  absl::Mutex mu;
  std::map<uint64_t, std::unique_ptr<Sink>> sinks ABSL_GUARDED_BY(mu);
  std::map<uint64_t, Request> requests ABSL_GUARDED_BY(mu);
  std::map<uint64_t, absl::Status> acks
      ABSL_GUARDED_BY(mu);  // handshake replies

  void OnHelloAck(uint64_t peer, std::string payload) {
    ByteReader r(payload);
    uint8_t ok = 0;
    std::string msg;
    if (!r.Get(&ok) || !r.GetBytes(&msg, 4096)) return;
    absl::MutexLock l(&mu);
    acks[peer] = ok ? absl::OkStatus() : absl::FailedPreconditionError(msg);
  }

  // A sink that died can take no more writes: its requests fail fast with
  // UNAVAILABLE instead of each write timing out.
  void OnPeerFailure(uint64_t peer, const absl::Status& why) {
    absl::MutexLock l(&mu);
    for (auto& [id, req] : requests) {
      for (const Grant& g : req.grants) {
        if (g.sink->uid == peer && req.revoked.ok()) {
          req.revoked = absl::UnavailableError(absl::StrCat(
              "KV sink of request ", id, " failed: ", why.message()));
        }
      }
    }
  }

  // Stops the request here, then confirms to the sink once every put issued
  // before the revoke has completed (endpoint flush): after the confirmation
  // the sink may hand the blocks to someone else.
  void OnRevoke(uint64_t peer, std::string payload) {
    ByteReader r(payload);
    uint64_t id = 0;
    std::string why;
    if (!r.Get(&id) || !r.GetBytes(&why, 4096)) return;
    // Holding `mu` orders this against Write, which issues its puts under
    // `mu`: each Write's puts are either before the flush below or refused.
    absl::MutexLock l(&mu);
    auto it = requests.find(id);
    if (it != requests.end()) {
      for (const Grant& g : it->second.grants) {
        if (g.sink->uid == peer) {
          it->second.revoked = absl::AbortedError(
              absl::StrCat("KV request ", id, " revoked by its sink: ", why));
        }
      }
    }
    auto sit = sinks.find(peer);
    if (sit == sinks.end()) return;
    std::shared_ptr<UcxEndpoint> ep = sit->second->ep;
    ByteWriter w;
    w.Put(id);
    auto flushed = ep->Flush([ep, ack = w.Take()](absl::Status s) {
      if (!s.ok())
        return;  // the sink's quarantine or failure handler covers it
      auto sent = ep->Send(kRevokeAck, ack);
      (void)sent;
    });
    (void)flushed;
  }
};

absl::StatusOr<std::unique_ptr<KvSource>> KvSource::Create(
    UcxWorker* worker, kv::KvPool* pool, const KvModelSpec& spec,
    KvSourceOptions options) {
  PDS_RETURN_IF_ERROR(CheckLayoutMatchesSpec(pool->layout(), spec));
  auto impl = std::make_shared<Impl>();
  impl->worker = worker;
  impl->pool = pool;
  impl->spec = spec;
  impl->options = options;
  PDS_ASSIGN_OR_RETURN(
      impl->region,
      worker->Register(pool->data(), static_cast<size_t>(pool->size_bytes())));
  std::weak_ptr<Impl> weak = impl;
  worker->SetMessageHandler(kHelloAck, [weak](uint64_t peer, std::string p) {
    if (auto s = weak.lock()) s->OnHelloAck(peer, std::move(p));
  });
  worker->SetMessageHandler(kRevoke, [weak](uint64_t peer, std::string p) {
    if (auto s = weak.lock()) s->OnRevoke(peer, std::move(p));
  });
  worker->AddPeerFailureHandler([weak](uint64_t peer, absl::Status why) {
    if (auto s = weak.lock()) s->OnPeerFailure(peer, why);
  });
  return std::unique_ptr<KvSource>(new KvSource(std::move(impl)));
}

void KvSource::IgnoreRevokesForTest() {
  impl_->worker->SetMessageHandler(kRevoke, [](uint64_t, std::string) {});
}

KvSource::~KvSource() {
  for (uint16_t kind : {kHelloAck, kRevoke}) {
    impl_->worker->SetMessageHandler(kind, nullptr);
  }
}

absl::StatusOr<uint64_t> KvSource::Connect(const std::string& sink_descriptor) {
  ByteReader r(sink_descriptor);
  uint32_t magic = 0;
  auto sink = std::make_unique<Impl::Sink>();
  KvModelSpec remote;
  std::string address, region_desc;
  if (!r.Get(&magic) || magic != kSinkMagic || !r.Get(&sink->uid) ||
      !GetSpec(r, &remote) || !GetLayout(r, remote, &sink->layout) ||
      !r.Get(&sink->num_blocks) || !r.GetBytes(&address, 1 << 20) ||
      !r.GetBytes(&region_desc, 1 << 20) || !r.empty() ||
      sink->num_blocks <= 0) {
    return absl::InvalidArgumentError("malformed KV sink descriptor");
  }
  {
    // Connecting twice is a no-op: grants point at the existing connection.
    absl::MutexLock l(&impl_->mu);
    if (impl_->sinks.count(sink->uid) != 0) return sink->uid;
  }
  if (!impl_->options.skip_local_compat_check_for_test) {
    PDS_RETURN_IF_ERROR(CheckCompatible(impl_->spec, remote));
    const kv::KvCacheLayout& mine = impl_->pool->layout();
    const kv::KvCacheLayout& theirs = sink->layout;
    if (theirs.kv_head_offset < mine.kv_head_offset ||
        theirs.kv_head_offset + theirs.num_kv_heads >
            mine.kv_head_offset + mine.num_kv_heads) {
      return absl::FailedPreconditionError(absl::StrCat(
          "incompatible KV peer: this source holds KV heads [",
          mine.kv_head_offset, ",", mine.kv_head_offset + mine.num_kv_heads,
          ") but the sink needs [", theirs.kv_head_offset, ",",
          theirs.kv_head_offset + theirs.num_kv_heads, ")"));
    }
  }
  PDS_ASSIGN_OR_RETURN(sink->ep, impl_->worker->Connect(address));
  PDS_ASSIGN_OR_RETURN(sink->region, sink->ep->ImportRegion(region_desc));
  if (sink->region->length() <
      static_cast<uint64_t>(sink->num_blocks * sink->layout.block_bytes())) {
    return absl::InvalidArgumentError(
        "KV sink region smaller than its advertised pool");
  }
  {
    absl::MutexLock l(&impl_->mu);
    impl_->acks.erase(sink->uid);
  }
  ByteWriter w;
  w.PutBytes(impl_->worker->address());
  PutSpec(w, impl_->spec);
  PutLayout(w, impl_->pool->layout());
  PDS_RETURN_IF_ERROR(sink->ep->Send(kHello, w.Take()).status());

  // The reply proves the sink is alive and agrees; without one the address is
  // dead or wrong.
  const uint64_t uid = sink->uid;
  absl::MutexLock l(&impl_->mu);
  auto replied = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->mu) {
    return impl_->acks.count(uid) != 0 || !sink->ep->health().ok();
  };
  if (!impl_->mu.AwaitWithTimeout(absl::Condition(&replied),
                                  impl_->options.handshake_timeout)) {
    return absl::UnavailableError(absl::StrCat(
        "KV sink ", absl::Hex(uid), " did not answer the handshake within ",
        absl::FormatDuration(impl_->options.handshake_timeout)));
  }
  PDS_RETURN_IF_ERROR(sink->ep->health());
  absl::Status verdict = impl_->acks[uid];
  impl_->acks.erase(uid);
  PDS_RETURN_IF_ERROR(verdict);
  PDS_LOG(INFO) << "transport: connected to KV sink "
                << absl::StrCat(absl::Hex(uid)) << " "
                << sink->layout.DebugString();
  impl_->sinks[uid] = std::move(sink);
  return uid;
}

absl::Status KvSource::AddGrant(const std::string& grant) {
  ByteReader r(grant);
  uint32_t magic = 0;
  uint64_t sink_uid = 0, request_id = 0, count = 0;
  Impl::Grant g;
  if (!r.Get(&magic) || magic != kGrantMagic || !r.Get(&sink_uid) ||
      !r.Get(&request_id) || !r.Get(&g.num_tokens) || !r.Get(&count) ||
      count > (1u << 24)) {
    return absl::InvalidArgumentError("malformed KV grant");
  }
  g.blocks.resize(count);
  for (auto& b : g.blocks) {
    if (!r.Get(&b)) return absl::InvalidArgumentError("malformed KV grant");
  }
  if (!r.empty()) return absl::InvalidArgumentError("malformed KV grant");
  absl::MutexLock l(&impl_->mu);
  auto sit = impl_->sinks.find(sink_uid);
  if (sit == impl_->sinks.end()) {
    return absl::InvalidArgumentError(
        "KV grant from a sink this source is not connected to");
  }
  Impl::Sink* sink = sit->second.get();
  const int bs = sink->layout.block_size;
  if (g.num_tokens <= 0 ||
      static_cast<int64_t>(g.blocks.size()) < (g.num_tokens + bs - 1) / bs) {
    return absl::InvalidArgumentError(
        "KV grant with too few blocks for its tokens");
  }
  const uint64_t bb = static_cast<uint64_t>(sink->layout.block_bytes());
  for (int64_t b : g.blocks) {
    if (b < 0 || b >= sink->num_blocks) {
      return absl::OutOfRangeError(absl::StrCat("KV grant names block ", b,
                                                " outside the sink's ",
                                                sink->num_blocks));
    }
    g.allowed.emplace_back(b * bb, (b + 1) * bb);
  }
  std::sort(g.allowed.begin(), g.allowed.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (auto& iv : g.allowed) {
    if (!merged.empty() && iv.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, iv.second);
    } else {
      merged.push_back(iv);
    }
  }
  g.allowed = std::move(merged);
  g.sink = sink;
  auto& req = impl_->requests[request_id];
  for (const auto& old : req.grants) {
    if (old.sink == sink) return absl::AlreadyExistsError("duplicate KV grant");
  }
  req.grants.push_back(std::move(g));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<OpHandle>> KvSource::Write(
    uint64_t request_id, std::span<const int64_t> src_blocks, int layer_begin,
    int layer_end, int64_t token_begin, int64_t token_end) {
  struct Job {
    std::shared_ptr<UcxEndpoint> ep;
    RemoteRegion* region;
    std::vector<PutSegment> segments;
  };
  ByteWriter w;
  w.Put(request_id);
  w.Put<int32_t>(layer_begin);
  w.Put<int32_t>(layer_end);
  w.Put(token_begin);
  w.Put(token_end);
  const std::string notice = w.Take();

  // The puts are issued under `mu` too, so that a revoke (OnRevoke, also
  // under `mu`) either precedes this whole write or flushes after all of it.
  absl::MutexLock l(&impl_->mu);
  std::vector<Job> jobs;
  auto it = impl_->requests.find(request_id);
  if (it == impl_->requests.end() || it->second.grants.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no KV grant for request ", request_id));
  }
  PDS_RETURN_IF_ERROR(it->second.revoked);
  for (const Impl::Grant& g : it->second.grants) {
    if (token_end > g.num_tokens) {
      return absl::OutOfRangeError(absl::StrCat(
          "tokens up to ", token_end, " beyond the grant's ", g.num_tokens));
    }
    PDS_ASSIGN_OR_RETURN(
        std::vector<PutSegment> segs,
        PlanKvCopy(impl_->pool->layout(), src_blocks, g.sink->layout, g.blocks,
                   layer_begin, layer_end, token_begin, token_end));
    // Independent of how the plan was made: every byte must land inside a
    // block granted for this request.
    for (const PutSegment& s : segs) {
      auto a = std::upper_bound(
          g.allowed.begin(), g.allowed.end(),
          std::make_pair(s.dst_offset, std::numeric_limits<uint64_t>::max()));
      if (a == g.allowed.begin() ||
          std::prev(a)->second < s.dst_offset + s.length) {
        return absl::PermissionDeniedError(absl::StrCat(
            "KV write [", s.dst_offset, ", +", s.length,
            ") outside the blocks granted for request ", request_id));
      }
    }
    jobs.push_back(Job{g.sink->ep, g.sink->region.get(), std::move(segs)});
  }

  auto all = std::make_shared<OpHandle>();
  all->AddParts(static_cast<int>(jobs.size()));
  for (Job& job : jobs) {
    std::shared_ptr<UcxEndpoint> ep = job.ep;
    // Bytes first (put + flush), then the notice: the sink never counts a
    // range before it is in its memory.
    auto put = ep->PutAndFlush(
        *impl_->region, *job.region, job.segments,
        [all, ep, notice](absl::Status s) {
          if (!s.ok()) {
            all->FinishPart(s);
            return;
          }
          auto sent = ep->Send(kWritten, notice,
                               [all](absl::Status s2) { all->FinishPart(s2); });
          if (!sent.ok()) all->FinishPart(sent.status());
        });
    if (!put.ok()) all->FinishPart(put.status());
  }
  return all;
}

absl::Status KvSource::Cancel(uint64_t request_id) {
  std::vector<std::shared_ptr<UcxEndpoint>> eps;
  {
    absl::MutexLock l(&impl_->mu);
    auto it = impl_->requests.find(request_id);
    if (it == impl_->requests.end()) {
      return absl::NotFoundError(absl::StrCat("no KV request ", request_id));
    }
    for (const auto& g : it->second.grants) eps.push_back(g.sink->ep);
    impl_->requests.erase(it);
  }
  ByteWriter w;
  w.Put(request_id);
  w.PutBytes("cancelled by the source");
  const std::string msg = w.Take();
  for (auto& ep : eps) {
    auto sent = ep->Send(kCancel, msg);
    (void)sent;
  }
  return absl::OkStatus();
}

void KvSource::Forget(uint64_t request_id) {
  absl::MutexLock l(&impl_->mu);
  impl_->requests.erase(request_id);
}

}  // namespace pdserve::transport
