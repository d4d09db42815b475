// Transport benchmark (not a test). Forks its peers; loopback only.
//   transport_bench [--no-peer-errors] [--shm-messages]
// (--shm-messages: with peer errors off, messages on the shared-memory worker
// too, as before UcxWorkerOptions::messages_over_tcp; to measure what the
// tcp message worker costs.)
// 1. Raw put bandwidth, 64 KiB .. 16 MiB: a window of puts then a flush,
//    repeated (what ucx_perftest -t ucp_put_bw measures).
// 2. KV transfer of a 4096-token prompt in the llama-110m shape (12 layers,
//    4 KV heads, head_dim 64, f32, block 16) from a 2-stage source (two
//    processes) into a 2-rank sink (this process).
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kv/kv_pool.h"
#include "transport/kv_transfer.h"
#include "transport/ucx_worker.h"

namespace pdserve::transport {
namespace {

bool g_peer_errors = true;
bool g_messages_over_tcp = true;

bool WriteFrame(int fd, const std::string& s) {
  uint64_t n = s.size();
  return write(fd, &n, 8) == 8 &&
         write(fd, s.data(), n) == static_cast<ssize_t>(n);
}
std::string ReadFrame(int fd) {
  uint64_t n = 0;
  if (read(fd, &n, 8) != 8) return "";
  std::string s(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, s.data() + got, n - got);
    if (r <= 0) return "";
    got += r;
  }
  return s;
}

std::unique_ptr<UcxWorker> NewWorker() {
  UcxWorkerOptions o;
  o.peer_error_handling = g_peer_errors;
  o.messages_over_tcp = g_messages_over_tcp;
  auto w = UcxWorker::Create(o);
  if (!w.ok()) {
    std::fprintf(stderr, "%s\n", w.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*w);
}

constexpr size_t kMaxSize = 16 << 20;
// "Cold" puts stream through this much memory on each side, far beyond the
// 32 MiB L3 here, like a KV transfer does.
constexpr size_t kColdSize = size_t{256} << 20;

// Child: the initiator of raw puts. Reports "size hot_MBps cold_MBps".
void RawPutChild(int fd) {
  auto worker = NewWorker();
  std::vector<char> buf(kColdSize, 1);
  auto local = worker->Register(buf.data(), buf.size());
  auto ep = worker->Connect(ReadFrame(fd));
  auto remote = (*ep)->ImportRegion(ReadFrame(fd));
  if (!local.ok() || !ep.ok() || !remote.ok()) std::exit(1);
  if (std::getenv("BENCH_EP_INFO")) {
    std::fprintf(stderr, "%s\n", (*ep)->TransportInfo().c_str());
  }
  std::string report;
  for (size_t size = 64 << 10; size <= kMaxSize; size *= 4) {
    const int window = 16;
    const size_t total_target = size_t{1} << 30;
    const int iters =
        static_cast<int>(std::max<size_t>(4, total_target / (size * window)));
    auto run = [&](int n, bool cold) {
      uint64_t off = 0;
      for (int i = 0; i < n; ++i) {
        std::vector<PutSegment> segs;
        for (int w = 0; w < window; ++w) {
          if (cold) {
            if (off + size > kColdSize) off = 0;
            segs.push_back(PutSegment{off, off, size});
            off += size;
          } else {
            segs.push_back(PutSegment{0, 0, size});
          }
        }
        auto h = (*ep)->PutAndFlush(**local, **remote, segs);
        if (!h.ok() || !(*h)->Wait(absl::Seconds(60)).ok()) std::exit(1);
      }
    };
    double mbs[2];
    for (int cold = 0; cold < 2; ++cold) {
      run(cold ? int(kColdSize / (size * window)) + 1 : 2,
          cold);  // warm-up / map pages
      absl::Time t0 = absl::Now();
      run(iters, cold);
      mbs[cold] = double(size) * window * iters /
                  absl::ToDoubleSeconds(absl::Now() - t0) / 1e6;
    }
    absl::StrAppend(&report, size, " ", static_cast<int64_t>(mbs[0]), " ",
                    static_cast<int64_t>(mbs[1]), "\n");
  }
  WriteFrame(fd, report);
}

void RawPut() {
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    RawPutChild(sv[1]);
    _exit(0);
  }
  close(sv[1]);
  auto worker = NewWorker();
  std::vector<char> target;
  const bool user = std::getenv("BENCH_USER_POOL") != nullptr;
  if (user) target.resize(kColdSize);
  auto region = user ? worker->Register(target.data(), target.size())
                     : worker->Allocate(kColdSize);
  if (!region.ok()) std::exit(1);
  WriteFrame(sv[0], worker->address());
  WriteFrame(sv[0], (*region)->descriptor());
  std::string report = ReadFrame(sv[0]);
  waitpid(pid, nullptr, 0);
  std::printf("raw_put peer_errors=%d target=%s (bytes hot_MB/s cold_MB/s)\n%s",
              g_peer_errors ? 1 : 0, user ? "user-memory" : "ucx-allocated",
              report.c_str());
}

// Two-sided: messages (rendezvous, zero-copy on both ends) of each size.
void AmChild(int fd) {
  auto worker = NewWorker();
  auto ep = worker->Connect(ReadFrame(fd));
  if (!ep.ok()) std::exit(1);
  WriteFrame(fd, worker->address());  // for the pings' answers
  std::string report;
  for (size_t size = 64 << 10; size <= kMaxSize; size *= 4) {
    const int iters =
        static_cast<int>(std::max<size_t>(8, (size_t{1} << 30) / size));
    std::string payload(size, 'x');
    absl::Time t0 = absl::Now();
    std::vector<std::shared_ptr<OpHandle>> hs;
    for (int i = 0; i < iters; ++i) {
      hs.push_back(*(*ep)->Send(9, payload));
      if (hs.size() >= 16) {
        if (!hs.front()->Wait(absl::Seconds(60)).ok()) std::exit(1);
        hs.erase(hs.begin());
      }
    }
    for (auto& h : hs) (void)h->Wait(absl::Seconds(60));
    auto done = (*ep)->Send(10, "");
    (void)ReadFrame(fd);  // receiver saw everything
    double secs = absl::ToDoubleSeconds(absl::Now() - t0);
    absl::StrAppend(&report, size, " ", double(size) * iters / secs / 1e6,
                    "\n");
  }
  // Round trips of 64-byte messages (what a KV chunk's notice is): one at a
  // time, each answered by the other side's handler.
  absl::Mutex mu;
  int answers = 0;
  worker->SetMessageHandler(12, [&](uint64_t, std::string) {
    absl::MutexLock l(&mu);
    ++answers;
  });
  constexpr int kPings = 2000;
  std::vector<double> micros;
  for (int i = 0; i < kPings + 100; ++i) {
    const absl::Time t0 = absl::Now();
    if (!(*ep)->Send(11, std::string(64, 'p')).ok()) std::exit(1);
    absl::MutexLock l(&mu);
    auto answered = [&, want = i + 1] { return answers >= want; };
    if (!mu.AwaitWithTimeout(absl::Condition(&answered), absl::Seconds(10))) {
      std::exit(1);
    }
    if (i >= 100)
      micros.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
  }
  std::sort(micros.begin(), micros.end());
  absl::StrAppend(&report, "round_trip_64B_us p50 ", micros[micros.size() / 2],
                  " p99 ", micros[micros.size() * 99 / 100], "\n");
  worker->SetMessageHandler(12, nullptr);
  WriteFrame(fd, report);
}

void Am() {
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    AmChild(sv[1]);
    _exit(0);
  }
  close(sv[1]);
  auto worker = NewWorker();
  worker->SetMessageHandler(9, [](uint64_t, std::string) {});
  int fd = sv[0];
  // The ping's answer goes back on an endpoint to the sender's address,
  // which the child sends first (set here, read on the progress thread).
  absl::Mutex back_mu;
  std::shared_ptr<UcxEndpoint> back;
  worker->SetMessageHandler(11, [&](uint64_t, std::string p) {
    absl::MutexLock l(&back_mu);
    if (back) (void)back->Send(12, std::move(p));
  });
  worker->SetMessageHandler(
      10, [fd](uint64_t, std::string) { WriteFrame(fd, "ok"); });
  WriteFrame(sv[0], worker->address());
  auto ep = worker->Connect(ReadFrame(sv[0]));
  if (!ep.ok()) std::exit(1);
  {
    absl::MutexLock l(&back_mu);
    back = *ep;
  }
  std::string report = ReadFrame(sv[0]);
  waitpid(pid, nullptr, 0);
  worker->SetMessageHandler(11, nullptr);
  std::printf("am_send peer_errors=%d messages_over_tcp=%d (bytes MB/s)\n%s",
              g_peer_errors ? 1 : 0,
              !g_peer_errors && g_messages_over_tcp ? 1 : 0, report.c_str());
}

KvModelSpec Llama110m() {
  return KvModelSpec{"llama-110m", kv::KvDType::kF32, 16, 64, 12, 4};
}
constexpr int64_t kTokens = 4096;

constexpr int kRounds = 4;  // round 0 warms up page mappings; not reported

void KvStageChild(int fd, int layer_begin, int layer_end) {
  auto worker = NewWorker();
  KvModelSpec spec = Llama110m();
  kv::KvCacheLayout l{
      layer_end - layer_begin, layer_begin, 4, 0, 16, 64, spec.dtype};
  const int64_t nb = kTokens / 16;
  auto pool = kv::KvPool::Create(l, nb);
  std::memset((*pool)->data(), 7, (*pool)->size_bytes());
  auto source = KvSource::Create(worker.get(), pool->get(), spec);
  for (int r = 0; r < 2; ++r) {
    if (!(*source)->Connect(ReadFrame(fd)).ok()) std::exit(1);
  }
  std::vector<int64_t> blocks(nb);
  std::iota(blocks.begin(), blocks.end(), 0);
  for (int round = 0; round < kRounds; ++round) {
    for (int r = 0; r < 2; ++r) {
      if (!(*source)->AddGrant(ReadFrame(fd)).ok()) std::exit(1);
    }
    WriteFrame(fd, "ready");
    ReadFrame(fd);  // go
    absl::Time t0 = absl::Now();
    // Layer by layer, as a stage finishes them.
    std::vector<std::shared_ptr<OpHandle>> hs;
    for (int layer = layer_begin; layer < layer_end; ++layer) {
      hs.push_back(
          *(*source)->Write(round, blocks, layer, layer + 1, 0, kTokens));
    }
    absl::Time t1 = absl::Now();
    for (auto& h : hs) {
      if (!h->Wait(absl::Seconds(60)).ok()) std::exit(1);
    }
    absl::Time t2 = absl::Now();
    if (std::getenv("BENCH_VERBOSE")) {
      std::fprintf(stderr,
                   "stage %d round %d: issue %.2f ms, complete %.2f ms\n",
                   layer_begin, round, absl::ToDoubleMilliseconds(t1 - t0),
                   absl::ToDoubleMilliseconds(t2 - t0));
    }
    (*source)->Forget(round);
  }
  ReadFrame(fd);
}

void KvTransfer() {
  KvModelSpec spec = Llama110m();
  const bool ucx_alloc = std::getenv("BENCH_USER_POOL") == nullptr;
  std::vector<std::unique_ptr<UcxWorker>> workers;
  std::vector<std::unique_ptr<kv::KvPool>> pools;
  std::vector<std::unique_ptr<KvSink>> sinks;
  const int64_t nb = kTokens / 16;
  int fds[2];
  pid_t pids[2];
  for (int s = 0; s < 2; ++s) {
    int sv[2];
    socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
    pids[s] = fork();
    if (pids[s] == 0) {
      close(sv[0]);
      KvStageChild(sv[1], s * 6, s * 6 + 6);
      _exit(0);
    }
    close(sv[1]);
    fds[s] = sv[0];
  }
  for (int r = 0; r < 2; ++r) {
    workers.push_back(NewWorker());
    kv::KvCacheLayout l{12, 0, 2, 2 * r, 16, 64, spec.dtype};
    // The decode pool: in UCX-allocated shared memory (AllocateKvPool), or a
    // plain KvPool in ordinary memory.
    auto pool = ucx_alloc ? AllocateKvPool(workers.back().get(), l, nb)
                          : kv::KvPool::Create(l, nb);
    if (!pool.ok()) std::exit(1);
    pools.push_back(std::move(*pool));
    sinks.push_back(std::move(
        *KvSink::Create(workers.back().get(), pools.back().get(), spec)));
  }
  for (int s = 0; s < 2; ++s) {
    for (auto& sink : sinks) WriteFrame(fds[s], sink->descriptor());
  }
  std::vector<int64_t> blocks(nb);
  std::iota(blocks.begin(), blocks.end(), 0);
  const double bytes = double(kTokens) * 12 * 2 * 4 * 64 * 4;
  double best = 1e9, sum = 0;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::string> grants;
    for (auto& sink : sinks)
      grants.push_back(*sink->Expect(round, kTokens, blocks));
    for (int s = 0; s < 2; ++s) {
      for (auto& g : grants) WriteFrame(fds[s], g);
    }
    for (int s = 0; s < 2; ++s) ReadFrame(fds[s]);  // ready
    absl::Time t0 = absl::Now();
    for (int s = 0; s < 2; ++s) WriteFrame(fds[s], "go");
    for (auto& sink : sinks) {
      if (!sink->Wait(round, absl::Seconds(60)).ok()) std::exit(1);
    }
    double secs = absl::ToDoubleSeconds(absl::Now() - t0);
    if (round > 0) {
      best = std::min(best, secs);
      sum += secs;
    }
  }
  for (int s = 0; s < 2; ++s) {
    WriteFrame(fds[s], "bye");
    waitpid(pids[s], nullptr, 0);
  }
  const double mean = sum / (kRounds - 1);
  std::printf(
      "kv_transfer peer_errors=%d sink_memory=%s llama-110m 4096 tokens f32, 2 "
      "stages x "
      "2 ranks: %.1f MB, mean %.2f ms = %.0f MB/s (best %.2f ms = %.0f MB/s)\n",
      g_peer_errors ? 1 : 0, ucx_alloc ? "ucx-allocated" : "user-pool",
      bytes / 1e6, mean * 1e3, bytes / mean / 1e6, best * 1e3,
      bytes / best / 1e6);
}

}  // namespace
}  // namespace pdserve::transport

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--no-peer-errors")
      pdserve::transport::g_peer_errors = false;
    if (std::string(argv[i]) == "--shm-messages")
      pdserve::transport::g_messages_over_tcp = false;
  }
  if (std::getenv("BENCH_AM")) pdserve::transport::Am();
  pdserve::transport::RawPut();
  pdserve::transport::KvTransfer();
  return 0;
}
