#include "prefill_worker/ucx_stage_link.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "pdserve/v1/common.pb.h"
#include "rpc/request_contract.h"
#include "transport/wire.h"

namespace pdserve::prefill {
namespace {

// Version 2: chunk flags + next token, prompt scores in events. A stage of
// another version fails its peers' messages as malformed.
constexpr uint32_t kMessageMagic = 0x324d5350;  // "PSM2"
constexpr uint32_t kEventMagic = 0x32455350;    // "PSE2"
constexpr uint32_t kEndMagic = 0x21444e45;      // "END!"

absl::Status Malformed(std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed stage message: ",
                   absl::string_view(what.data(), what.size())));
}

template <typename T>
void PutVector(transport::ByteWriter& w, const std::vector<T>& v) {
  w.Put<uint64_t>(v.size());
  for (const T& x : v) w.Put<T>(x);
}

// Reads a count-prefixed vector; the count is checked against what the blob
// can still hold by reading element by element.
template <typename T>
bool GetVector(transport::ByteReader& r, std::vector<T>* v,
               uint64_t max_count) {
  uint64_t n = 0;
  if (!r.Get(&n) || n > max_count) return false;
  v->clear();
  for (uint64_t i = 0; i < n; ++i) {
    T x;
    if (!r.Get(&x)) return false;
    v->push_back(x);
  }
  return true;
}

constexpr uint64_t kMaxItems = uint64_t{1} << 31;
// The grammar library refuses more (10,000); this only bounds the allocation.
constexpr uint32_t kMaxStructuredChoices = 1 << 20;

// ChunkHeader flag bits on the wire.
constexpr uint8_t kScorePrompt = 1;
constexpr uint8_t kWriteKv = 2;

void PutLogprobs(transport::ByteWriter& w, float logprob,
                 const std::vector<engine::TopLogprob>& top) {
  w.Put<float>(logprob);
  w.Put<uint32_t>(static_cast<uint32_t>(top.size()));
  for (const engine::TopLogprob& t : top) {
    w.Put<int32_t>(t.token);
    w.Put<float>(t.logprob);
  }
}

bool GetLogprobs(transport::ByteReader& r, engine::TokenLogprobs* l) {
  uint32_t alternatives = 0;
  if (!r.Get(&l->logprob) || !r.Get(&alternatives) ||
      alternatives > engine::kMaxTopLogprobs) {
    return false;
  }
  l->top.resize(alternatives);
  for (engine::TopLogprob& t : l->top) {
    if (!r.Get(&t.token) || !r.Get(&t.logprob)) return false;
  }
  return true;
}

// A chunk's sampling fields in the request contract's own encoding (the
// pdserve.v1.SamplingParams the router and workers exchange), not a second
// hand-kept codec: a field added to the contract crosses the stages too.
void PutSampling(transport::ByteWriter& w, const engine::SamplingParams& s) {
  v1::SamplingParams wire;
  rpc::SamplingToWire(s, &wire);
  w.PutBytes(wire.SerializeAsString());
}

// The values are checked where the chunk is used (SamplingParams::Validate).
bool GetSampling(transport::ByteReader& r, engine::SamplingParams* s) {
  std::string bytes;
  v1::SamplingParams wire;
  if (!r.GetBytes(&bytes) || !wire.ParseFromString(bytes)) return false;
  // Every stage link message carries its seed (SamplingToWire sets it).
  if (!wire.has_seed()) return false;
  *s = rpc::SamplingFromWire(wire, /*seed_if_unset=*/0);
  return s->logit_bias.size() <=
             static_cast<size_t>(engine::kMaxLogitBiasEntries) &&
         s->structured_output.choices.size() <= kMaxStructuredChoices;
}

}  // namespace

std::string EncodeStageMessage(const StageMessage& message) {
  transport::ByteWriter w;
  w.Put<uint32_t>(kMessageMagic);
  w.Put<uint64_t>(message.hidden.size());
  w.Put<uint64_t>(message.microbatch_id);
  w.Put<uint32_t>(static_cast<uint32_t>(message.chunks.size()));
  for (const ChunkHeader& c : message.chunks) {
    w.Put<uint64_t>(c.request_id);
    w.Put<int32_t>(c.token_begin);
    w.Put<int32_t>(c.token_end);
    w.Put<int32_t>(c.kv_begin);
    w.Put<int32_t>(c.kv_dst_offset);
    w.Put<uint8_t>(c.final_chunk ? 1 : 0);
    PutVector(w, c.tokens);
    PutVector(w, c.block_table);
    PutSampling(w, c.sampling);
    PutVector(w, c.penalized_prompt_tokens);
    w.Put<int32_t>(c.top_logprobs);
    w.Put<uint8_t>((c.prompt_logprobs ? kScorePrompt : 0) |
                   (c.write_kv ? kWriteKv : 0));
    w.Put<int32_t>(c.next_token);
    w.Put<uint32_t>(static_cast<uint32_t>(c.kv_grants.size()));
    for (const std::string& g : c.kv_grants) w.PutBytes(g);
  }
  std::string out = w.Take();
  out.append(reinterpret_cast<const char*>(message.hidden.data()),
             message.hidden.size() * sizeof(float));
  return out;
}

absl::StatusOr<StageMessage> DecodeStageMessage(std::string_view blob) {
  // [magic][hidden count][header ...][hidden floats]: the count fixes where
  // the header ends, and the header must be consumed exactly.
  uint32_t magic = 0;
  uint64_t hidden = 0;
  {
    transport::ByteReader r(blob);
    if (!r.Get(&magic) || magic != kMessageMagic) return Malformed("bad magic");
    if (!r.Get(&hidden)) return Malformed("truncated header");
  }
  constexpr size_t kPrefix = sizeof(uint32_t) + sizeof(uint64_t);
  if (hidden > (blob.size() - kPrefix) / sizeof(float)) {
    return Malformed("hidden states do not match their size");
  }
  const size_t header_end = blob.size() - hidden * sizeof(float);
  transport::ByteReader r(blob.substr(kPrefix, header_end - kPrefix));
  uint32_t chunks = 0;
  StageMessage m;
  if (!r.Get(&m.microbatch_id) || !r.Get(&chunks)) return Malformed("header");
  if (chunks > blob.size()) return Malformed("chunk count");
  int64_t total_tokens = 0;
  for (uint32_t i = 0; i < chunks; ++i) {
    ChunkHeader c;
    uint8_t final_chunk = 0;
    uint8_t flags = 0;
    uint32_t grants = 0;
    if (!r.Get(&c.request_id) || !r.Get(&c.token_begin) ||
        !r.Get(&c.token_end) || !r.Get(&c.kv_begin) ||
        !r.Get(&c.kv_dst_offset) || !r.Get(&final_chunk) ||
        !GetVector(r, &c.tokens, kMaxItems) ||
        !GetVector(r, &c.block_table, kMaxItems) ||
        !GetSampling(r, &c.sampling) ||
        !GetVector(r, &c.penalized_prompt_tokens, kMaxItems) ||
        !r.Get(&c.top_logprobs) || !r.Get(&flags) || !r.Get(&c.next_token) ||
        !r.Get(&grants) || grants > blob.size()) {
      return Malformed(absl::StrCat("chunk ", i, " is truncated"));
    }
    for (uint32_t g = 0; g < grants; ++g) {
      std::string grant;
      if (!r.GetBytes(&grant)) return Malformed("grant");
      c.kv_grants.push_back(std::move(grant));
    }
    c.final_chunk = final_chunk != 0;
    c.prompt_logprobs = (flags & kScorePrompt) != 0;
    c.write_kv = (flags & kWriteKv) != 0;
    if ((flags & ~(kScorePrompt | kWriteKv)) != 0) {
      return Malformed(absl::StrCat("chunk ", i, " has unknown flags"));
    }
    if (c.token_begin < 0 || c.token_end <= c.token_begin || c.kv_begin < 0 ||
        c.kv_begin > c.token_begin || c.kv_dst_offset < 0 ||
        c.top_logprobs < 0 || c.top_logprobs > engine::kMaxTopLogprobs ||
        (!c.tokens.empty() &&
         static_cast<int64_t>(c.tokens.size()) != c.num_tokens())) {
      return Malformed(absl::StrCat("chunk ", i, " has inconsistent ranges"));
    }
    total_tokens += c.num_tokens();
    m.chunks.push_back(std::move(c));
  }
  if (!r.empty()) return Malformed("trailing bytes after the chunk headers");
  if (hidden != 0 && (total_tokens == 0 || hidden % total_tokens != 0)) {
    return Malformed("hidden states are not [tokens, hidden]");
  }
  m.hidden.resize(hidden);
  if (hidden > 0) {
    std::memcpy(m.hidden.data(), blob.data() + header_end,
                hidden * sizeof(float));
  }
  return m;
}

std::string EncodeStageEvent(const StageEvent& e) {
  transport::ByteWriter w;
  w.Put<uint32_t>(kEventMagic);
  w.Put<uint8_t>(static_cast<uint8_t>(e.kind));
  w.Put<int32_t>(e.stage);
  w.Put<uint64_t>(e.microbatch_id);
  PutVector(w, e.request_ids);
  w.Put<uint64_t>(e.request_id);
  w.Put<int32_t>(static_cast<int32_t>(e.status.code()));
  w.PutBytes(absl::string_view(e.status.message()));
  w.Put<int32_t>(e.token.token);
  PutLogprobs(w, e.token.logprob, e.token.top);
  w.Put<int64_t>(absl::ToUnixNanos(e.start));
  w.Put<int64_t>(absl::ToUnixNanos(e.end));
  w.Put<int32_t>(e.tokens);
  w.Put<int32_t>(e.first_scored);
  w.Put<uint64_t>(e.prompt_logprobs.size());
  for (const engine::TokenLogprobs& l : e.prompt_logprobs) {
    PutLogprobs(w, l.logprob, l.top);
  }
  return w.Take();
}

absl::StatusOr<StageEvent> DecodeStageEvent(std::string_view blob) {
  transport::ByteReader r(blob);
  uint32_t magic = 0;
  uint8_t kind = 0;
  int32_t code = 0;
  std::string message;
  int64_t start = 0, end = 0;
  uint64_t scored = 0;
  StageEvent e;
  engine::TokenLogprobs first;
  if (!r.Get(&magic) || magic != kEventMagic || !r.Get(&kind) ||
      kind > static_cast<uint8_t>(StageEvent::Kind::kPromptLogprobs) ||
      !r.Get(&e.stage) || !r.Get(&e.microbatch_id) ||
      !GetVector(r, &e.request_ids, kMaxItems) || !r.Get(&e.request_id) ||
      !r.Get(&code) || !r.GetBytes(&message, 1 << 20) ||
      !r.Get(&e.token.token) || !GetLogprobs(r, &first) || !r.Get(&start) ||
      !r.Get(&end) || !r.Get(&e.tokens) || !r.Get(&e.first_scored) ||
      // Each entry takes at least 8 bytes.
      !r.Get(&scored) || scored > blob.size() / 8) {
    return absl::InvalidArgumentError("malformed stage event");
  }
  e.token.logprob = first.logprob;
  e.token.top = std::move(first.top);
  e.prompt_logprobs.resize(scored);
  for (engine::TokenLogprobs& l : e.prompt_logprobs) {
    if (!GetLogprobs(r, &l)) {
      return absl::InvalidArgumentError("malformed stage event");
    }
  }
  if (!r.empty() || code < 0 ||
      code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError("malformed stage event");
  }
  e.kind = static_cast<StageEvent::Kind>(kind);
  e.status = absl::Status(static_cast<absl::StatusCode>(code), message);
  e.start = absl::FromUnixNanos(start);
  e.end = absl::FromUnixNanos(end);
  return e;
}

// ---------------------------------------------------------------------------

UcxStageSender::UcxStageSender(std::shared_ptr<transport::UcxEndpoint> endpoint)
    : endpoint_(std::move(endpoint)) {}

absl::Status UcxStageSender::CollectFinished() {
  absl::Status first;
  std::vector<std::shared_ptr<transport::OpHandle>> still;
  for (auto& h : pending_) {
    switch (h->state()) {
      case transport::OpState::kInProgress:
        still.push_back(h);
        break;
      case transport::OpState::kFailed:
        if (first.ok()) first = h->status();
        break;
      case transport::OpState::kSucceeded:
        break;
    }
  }
  pending_ = std::move(still);
  return first;
}

absl::Status UcxStageSender::Send(StageMessage message) {
  if (closed_) return absl::UnavailableError("stage link is closed");
  if (absl::Status s = CollectFinished(); !s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("next stage unreachable: ", s.message()));
  }
  if (absl::Status s = endpoint_->health(); !s.ok()) return s;
  auto handle = endpoint_->Send(kStageMessageKind, EncodeStageMessage(message));
  if (!handle.ok()) return handle.status();
  pending_.push_back(std::move(*handle));
  return absl::OkStatus();
}

void UcxStageSender::Close() {
  if (closed_) return;
  closed_ = true;
  transport::ByteWriter w;
  w.Put<uint32_t>(kEndMagic);
  auto handle = endpoint_->Send(kStageMessageKind, w.Take());
  if (handle.ok()) (void)(*handle)->Wait(absl::Seconds(5));
}

UcxStageReceiver::UcxStageReceiver(transport::UcxWorker* worker)
    : worker_(worker) {
  worker_->SetMessageHandler(
      kStageMessageKind, [this](uint64_t peer, std::string payload) {
        if (payload.size() == sizeof(uint32_t)) {
          uint32_t magic = 0;
          std::memcpy(&magic, payload.data(), sizeof(magic));
          if (magic == kEndMagic) {
            queue_.Close();
            return;
          }
        }
        absl::StatusOr<StageMessage> message = DecodeStageMessage(payload);
        if (!message.ok()) {
          PDS_LOG(WARNING) << "prefill: dropped a stage message from peer "
                           << peer << ": " << message.status();
          absl::MutexLock lock(&mu_);
          ++malformed_;
          return;
        }
        queue_.Push(std::move(*message));
      });
}

UcxStageReceiver::~UcxStageReceiver() {
  worker_->SetMessageHandler(kStageMessageKind, nullptr);
  queue_.Close();
}

std::optional<StageMessage> UcxStageReceiver::Receive() { return queue_.Pop(); }

int64_t UcxStageReceiver::malformed() const {
  absl::MutexLock lock(&mu_);
  return malformed_;
}

void UcxEventSender::Report(StageEvent event) {
  auto handle = endpoint_->Send(kStageEventKind, EncodeStageEvent(event));
  if (!handle.ok()) {
    PDS_LOG(WARNING) << "prefill: could not report to the coordinator: "
                     << handle.status();
  }
}

UcxEventReceiver::UcxEventReceiver(transport::UcxWorker* worker,
                                   StageEventSink* target)
    : worker_(worker) {
  worker_->SetMessageHandler(
      kStageEventKind, [target](uint64_t peer, std::string payload) {
        absl::StatusOr<StageEvent> event = DecodeStageEvent(payload);
        if (!event.ok()) {
          PDS_LOG(WARNING) << "prefill: dropped a stage event from peer "
                           << peer << ": " << event.status();
          return;
        }
        target->Report(std::move(*event));
      });
}

UcxEventReceiver::~UcxEventReceiver() {
  worker_->SetMessageHandler(kStageEventKind, nullptr);
}

}  // namespace pdserve::prefill
