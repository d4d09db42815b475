// The other process of the transport tests. Talks to the test over the
// socketpair fd given as --fd (the stand-in for the gRPC control plane) and
// over UCX for everything else.
//
//   --mode=kv_source  one prefill stage: connects to T sinks, writes its layers
//   --mode=kv_sink    one decode rank: publishes a descriptor and a grant
//   --mode=echo       echoes every message back, in order
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "kv/kv_pool.h"
#include "test_support.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::transport {
namespace {

using testing::ReadFrame;
using testing::WriteFrame;

std::map<std::string, std::string> g_args;

int64_t IntArg(const std::string& name, int64_t def = 0) {
  auto it = g_args.find(name);
  int64_t v = def;
  if (it != g_args.end() && !absl::SimpleAtoi(it->second, &v)) std::abort();
  return v;
}

std::string StrArg(const std::string& name, const std::string& def = "") {
  auto it = g_args.find(name);
  return it == g_args.end() ? def : it->second;
}

KvModelSpec SpecFromArgs() {
  KvModelSpec s;
  s.model_id = StrArg("model_id", "test-model");
  s.dtype = static_cast<kv::KvDType>(IntArg("dtype"));
  s.block_size = static_cast<int>(IntArg("block_size"));
  s.head_dim = static_cast<int>(IntArg("head_dim"));
  s.num_layers = static_cast<int>(IntArg("num_layers"));
  s.num_kv_heads = static_cast<int>(IntArg("num_kv_heads"));
  return s;
}

int Fail(int fd, const absl::Status& s) {
  (void)WriteFrame(fd, absl::StrCat("ERR ", s.ToString()));
  return 0;
}

// One prefill stage holding model layers [layer_begin, layer_end) and all
// heads. Frames in: num_sinks descriptors, then num_sinks grants. Frames
// out: "CONNECTED", then "OK" (or "STALLED" with --stall=1) / "ERR ...".
int RunKvSource(int fd) {
  const KvModelSpec spec = SpecFromArgs();
  const int layer_begin = static_cast<int>(IntArg("layer_begin"));
  const int layer_end = static_cast<int>(IntArg("layer_end"));
  const int64_t num_tokens = IntArg("num_tokens");
  const int num_sinks = static_cast<int>(IntArg("num_sinks"));
  const uint64_t seed = static_cast<uint64_t>(IntArg("seed"));
  const int chunks = static_cast<int>(IntArg("chunks", 2));

  UcxWorkerOptions wopts;
  wopts.peer_error_handling = IntArg("no_peer_errors") == 0;
  auto worker = UcxWorker::Create(wopts);
  if (!worker.ok()) return Fail(fd, worker.status());
  const int src_heads =
      static_cast<int>(IntArg("src_heads", spec.num_kv_heads));
  kv::KvCacheLayout layout{layer_end - layer_begin, layer_begin,   src_heads, 0,
                           spec.block_size,         spec.head_dim, spec.dtype};
  const int64_t nb = (num_tokens + spec.block_size - 1) / spec.block_size;
  auto pool = kv::KvPool::Create(layout, nb + 5);
  if (!pool.ok()) return Fail(fd, pool.status());
  // Scattered source blocks, as a paged prefill cache would hold them.
  std::vector<int64_t> blocks(nb + 5);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::mt19937_64 rng(seed * 31 + layer_begin);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  blocks.resize(nb);
  testing::FillKv(layout, static_cast<char*>((*pool)->data()), blocks,
                  num_tokens, seed);

  KvSourceOptions opts;
  opts.handshake_timeout = absl::Seconds(IntArg("handshake_s", 20));
  opts.skip_local_compat_check_for_test = IntArg("skip_compat") != 0;
  auto source = KvSource::Create(worker->get(), pool->get(), spec, opts);
  if (!source.ok()) return Fail(fd, source.status());
  for (int i = 0; i < num_sinks; ++i) {
    auto desc = ReadFrame(fd, absl::Seconds(30));
    if (!desc.ok()) return Fail(fd, desc.status());
    auto c = (*source)->Connect(*desc);
    if (!c.ok()) return Fail(fd, c.status());
  }
  (void)WriteFrame(fd, "CONNECTED");
  uint64_t request_id = 0;
  for (int i = 0; i < num_sinks; ++i) {
    auto grant = ReadFrame(fd, absl::Seconds(30));
    if (!grant.ok()) return Fail(fd, grant.status());
    absl::Status s = (*source)->AddGrant(*grant);
    if (!s.ok()) return Fail(fd, s);
  }
  request_id = static_cast<uint64_t>(IntArg("request_id", 1));
  // Chunked prefill: each chunk of tokens is written layer by layer as the
  // stage would finish them.
  std::vector<std::shared_ptr<OpHandle>> handles;
  for (int c = 0; c < chunks; ++c) {
    int64_t tb = num_tokens * c / chunks, te = num_tokens * (c + 1) / chunks;
    if (tb == te) continue;
    for (int layer = layer_begin; layer < layer_end; ++layer) {
      auto h = (*source)->Write(request_id, blocks, layer, layer + 1, tb, te);
      if (!h.ok()) return Fail(fd, h.status());
      handles.push_back(*h);
    }
    if (IntArg("stall") != 0) {
      for (auto& h : handles) {
        absl::Status s = h->Wait(absl::Seconds(30));
        if (!s.ok()) return Fail(fd, s);
      }
      (void)WriteFrame(fd, "STALLED");
      absl::SleepFor(absl::Seconds(120));  // killed by the test
      return 0;
    }
  }
  for (auto& h : handles) {
    absl::Status s = h->Wait(absl::Seconds(30));
    if (!s.ok()) return Fail(fd, s);
  }
  (void)WriteFrame(fd, "OK");
  // Stay until the test has seen the data (the pipe closes).
  (void)ReadFrame(fd, absl::Seconds(30));
  return 0;
}

// One decode rank holding all layers and all heads; grants blocks 0..nb-1
// for request 1. Frames out: descriptor, grant. Then waits to be killed.
int RunKvSink(int fd) {
  const KvModelSpec spec = SpecFromArgs();
  const int64_t num_tokens = IntArg("num_tokens");
  auto worker = UcxWorker::Create();
  if (!worker.ok()) return Fail(fd, worker.status());
  kv::KvCacheLayout layout{
      spec.num_layers, 0,         spec.num_kv_heads, 0, spec.block_size,
      spec.head_dim,   spec.dtype};
  const int64_t nb = (num_tokens + spec.block_size - 1) / spec.block_size;
  auto pool = kv::KvPool::Create(layout, nb);
  if (!pool.ok()) return Fail(fd, pool.status());
  auto sink = KvSink::Create(worker->get(), pool->get(), spec);
  if (!sink.ok()) return Fail(fd, sink.status());
  std::vector<int64_t> blocks(nb);
  std::iota(blocks.begin(), blocks.end(), 0);
  auto grant = (*sink)->Expect(1, num_tokens, blocks, absl::Seconds(60));
  if (!grant.ok()) return Fail(fd, grant.status());
  (void)WriteFrame(fd, (*sink)->descriptor());
  (void)WriteFrame(fd, *grant);
  absl::SleepFor(absl::Seconds(120));  // killed by the test
  return 0;
}

// Frame in: the test's worker address. Frame out: ours. Every message of
// kind 1 is sent back as kind 2, in arrival order.
int RunEcho(int fd) {
  UcxWorkerOptions wopts;
  wopts.peer_error_handling = IntArg("no_peer_errors") == 0;
  auto worker = UcxWorker::Create(wopts);
  if (!worker.ok()) return Fail(fd, worker.status());
  auto peer_addr = ReadFrame(fd, absl::Seconds(30));
  if (!peer_addr.ok()) return Fail(fd, peer_addr.status());
  auto ep = (*worker)->Connect(*peer_addr);
  if (!ep.ok()) return Fail(fd, ep.status());
  std::shared_ptr<UcxEndpoint> e = *ep;
  (*worker)->SetMessageHandler(1, [e](uint64_t, std::string payload) {
    auto s = e->Send(2, std::move(payload));
    (void)s;
  });
  (void)WriteFrame(fd, (*worker)->address());
  // Until the test closes the pipe.
  (void)ReadFrame(fd, absl::Seconds(60));
  (*worker)->SetMessageHandler(1, nullptr);
  return 0;
}

}  // namespace
}  // namespace pdserve::transport

int main(int argc, char** argv) {
  using pdserve::transport::g_args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) continue;
    auto eq = a.find('=');
    g_args[a.substr(2, eq - 2)] =
        eq == std::string::npos ? "1" : a.substr(eq + 1);
  }
  int fd = static_cast<int>(pdserve::transport::IntArg("fd", -1));
  std::string mode = pdserve::transport::StrArg("mode");
  if (mode == "kv_source") return pdserve::transport::RunKvSource(fd);
  if (mode == "kv_sink") return pdserve::transport::RunKvSink(fd);
  if (mode == "echo") return pdserve::transport::RunEcho(fd);
  return 2;
}
