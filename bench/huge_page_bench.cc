// What backing the streamed buffers with transparent huge pages
// (common/large_buffer.h) buys, measured side by side in one process: the
// same 512 MiB streaming read and the same engine (default llama-110m, dummy
// weights) on small pages and on huge pages, interleaved, steady and on the
// first pass after the process slept (an idle worker's next request).
//
//   build/bench/huge_page_bench [--config PATH] [--threads N]
//       [--gaps 0.5,1,2,3] [--repeats 5] [--steps 32] [--prompt 32]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/large_buffer.h"
#include "engine/llama_engine.h"
#include "kv/kv_pool.h"
#include "model/weight_source.h"
#include "stream_read.h"

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Options {
  std::string config =
      std::string(PDSERVE_MODELS_DIR) + "/bench-configs/llama-110m.json";
  int threads = 0;
  std::vector<double> gaps = {0.5, 1, 2, 3};
  int repeats = 5;
  int steps = 32;
  int prompt = 32;
};

// One streaming read of `buffer` over `threads` threads, seconds.
double StreamOnce(const LargeBuffer& buffer, int threads) {
  return bench::StreamReadSeconds(static_cast<const float*>(buffer.data()),
                                  buffer.size() / sizeof(float), threads);
}

// A model's engine, its KV pool and one sequence with `context` tokens of
// KV, on the pages `huge` says.
struct Subject {
  std::unique_ptr<engine::LlamaEngine> engine;
  std::unique_ptr<kv::KvPool> pool;
  std::vector<int32_t> table;
  int position = 0;
  int vocab = 0;
};

absl::StatusOr<Subject> MakeSubject(const model::WeightSource& weights,
                                    int threads, bool huge, int capacity) {
  SetHugePagesWanted(huge);
  Subject s;
  engine::EngineOptions options;
  options.num_threads = threads;
  auto engine = engine::LlamaEngine::Create(weights, options);
  if (!engine.ok()) return engine.status();
  s.engine = *std::move(engine);
  constexpr int kBlockSize = 16;
  const int blocks = (capacity + kBlockSize - 1) / kBlockSize;
  auto pool = kv::KvPool::Create(s.engine->KvLayout(kBlockSize), blocks);
  SetHugePagesWanted(true);
  if (!pool.ok()) return pool.status();
  s.pool = *std::move(pool);
  for (int b = 0; b < blocks; ++b) s.table.push_back(b);
  s.vocab = weights.config().vocab_size;
  return s;
}

// One step of `tokens` new tokens (1: a decode step, more: a prompt chunk)
// continuing the sequence, seconds; the sequence starts over when full.
double Step(Subject& s, int tokens) {
  if (s.position + tokens > static_cast<int>(s.table.size()) * 16) {
    s.position = 0;
  }
  std::vector<int32_t> ids(tokens);
  for (int i = 0; i < tokens; ++i) ids[i] = (s.position + i) * 7919 % s.vocab;
  engine::ForwardBatch batch;
  engine::SequenceStep step;
  step.tokens = ids;
  step.num_tokens = tokens;
  step.start_position = s.position;
  step.block_table = s.table;
  step.logit_indices = {tokens - 1};
  batch.sequences.push_back(step);
  engine::ForwardResult result;
  const auto start = Clock::now();
  if (auto st = s.engine->Forward(batch, *s.pool, &result); !st.ok()) {
    std::fprintf(stderr, "%s\n", st.ToString().c_str());
    std::exit(1);
  }
  const double seconds = Seconds(start);
  s.position += tokens;
  return seconds;
}

void Sleep(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

int Run(const Options& opt) {
  const int threads =
      opt.threads > 0 ? opt.threads
                      : static_cast<int>(std::thread::hardware_concurrency());
  std::printf("transparent huge pages: %s; %d threads\n",
              TransparentHugePagesAvailable() ? "available" : "not available",
              threads);

  // The machine: a 512 MiB streaming read.
  constexpr size_t kBytes = size_t{512} << 20;
  LargeBuffer buffers[2];
  for (int huge = 0; huge < 2; ++huge) {
    SetHugePagesWanted(huge == 1);
    auto b = LargeBuffer::Allocate(kBytes);
    if (!b.ok()) {
      std::fprintf(stderr, "%s\n", b.status().ToString().c_str());
      return 1;
    }
    std::fill_n(static_cast<char*>(b->data()), kBytes, 1);
    buffers[huge] = *std::move(b);
  }
  SetHugePagesWanted(true);
  std::printf(
      "\n| 512 MiB streaming read (median of %d) | small pages | huge pages "
      "| small / huge |\n|---|---|---|---|\n",
      opt.repeats);
  {
    std::vector<double> steady[2];
    for (int r = 0; r < opt.repeats; ++r) {
      for (int huge = 0; huge < 2; ++huge) {
        steady[huge].push_back(StreamOnce(buffers[huge], threads));
      }
    }
    std::printf(
        "| steady | %.1f ms (%.1f GB/s) | %.1f ms (%.1f GB/s) | %.2f |\n",
        Median(steady[0]) * 1e3, kBytes / Median(steady[0]) / 1e9,
        Median(steady[1]) * 1e3, kBytes / Median(steady[1]) / 1e9,
        Median(steady[0]) / Median(steady[1]));
    for (double gap : opt.gaps) {
      std::vector<double> first[2];
      for (int r = 0; r < opt.repeats; ++r) {
        for (int huge = 0; huge < 2; ++huge) {
          Sleep(gap);
          first[huge].push_back(StreamOnce(buffers[huge], threads));
        }
      }
      std::printf(
          "| first pass after %.1f s asleep | %.1f ms (%.2fx steady) "
          "| %.1f ms (%.2fx steady) | %.2f |\n",
          gap, Median(first[0]) * 1e3, Median(first[0]) / Median(steady[0]),
          Median(first[1]) * 1e3, Median(first[1]) / Median(steady[1]),
          Median(first[0]) / Median(first[1]));
    }
  }
  buffers[0] = LargeBuffer();
  buffers[1] = LargeBuffer();

  // The engine.
  auto weights = model::OpenModel(opt.config, model::LoadFormat::kDummy);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  const int capacity = 1024;
  Subject subjects[2];
  for (int huge = 0; huge < 2; ++huge) {
    auto s = MakeSubject(**weights, threads, huge == 1, capacity);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    subjects[huge] = *std::move(s);
    Step(subjects[huge], opt.prompt);  // warm: every weight page touched
  }
  std::printf(
      "\n| %s, batch 1 (median of %d) | small pages | huge pages | small / "
      "huge |\n|---|---|---|---|\n",
      opt.config.c_str(), opt.repeats);
  std::vector<double> steady_decode[2], steady_prompt[2];
  for (int i = 0; i < opt.steps; ++i) {
    for (int huge = 0; huge < 2; ++huge) {
      steady_decode[huge].push_back(Step(subjects[huge], 1));
      if (i % 4 == 0) {
        steady_prompt[huge].push_back(Step(subjects[huge], opt.prompt));
      }
    }
  }
  auto row = [](const std::string& what, const std::vector<double>* v,
                const double* steady) {
    const double small = Median(v[0]), huge = Median(v[1]);
    if (steady == nullptr) {
      std::printf("| %s | %.2f ms | %.2f ms | %.2f |\n", what.c_str(),
                  small * 1e3, huge * 1e3, small / huge);
    } else {
      std::printf(
          "| %s | %.2f ms (%.2fx steady) | %.2f ms (%.2fx steady) | "
          "%.2f |\n",
          what.c_str(), small * 1e3, small / steady[0], huge * 1e3,
          huge / steady[1], small / huge);
    }
  };
  row("decode step, steady", steady_decode, nullptr);
  row(std::to_string(opt.prompt) + "-token prompt step, steady", steady_prompt,
      nullptr);
  const double decode_steady[2] = {Median(steady_decode[0]),
                                   Median(steady_decode[1])};
  const double prompt_steady[2] = {Median(steady_prompt[0]),
                                   Median(steady_prompt[1])};
  for (double gap : opt.gaps) {
    std::vector<double> decode[2], prompt[2];
    for (int r = 0; r < opt.repeats; ++r) {
      for (int huge = 0; huge < 2; ++huge) {
        Sleep(gap);
        prompt[huge].push_back(Step(subjects[huge], opt.prompt));
        Sleep(gap);
        decode[huge].push_back(Step(subjects[huge], 1));
      }
    }
    char label[96];
    std::snprintf(label, sizeof(label),
                  "%d-token prompt step after %.1f s idle", opt.prompt, gap);
    row(label, prompt, prompt_steady);
    std::snprintf(label, sizeof(label), "decode step after %.1f s idle", gap);
    row(label, decode, decode_steady);
  }
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  pdserve::Options opt;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    bool ok = i + 1 < argc;
    if (flag == "--config") {
      opt.config = value;
    } else if (flag == "--threads") {
      ok = ok && absl::SimpleAtoi(value, &opt.threads) && opt.threads >= 0;
    } else if (flag == "--repeats") {
      ok = ok && absl::SimpleAtoi(value, &opt.repeats) && opt.repeats > 0;
    } else if (flag == "--steps") {
      ok = ok && absl::SimpleAtoi(value, &opt.steps) && opt.steps > 0;
    } else if (flag == "--prompt") {
      ok = ok && absl::SimpleAtoi(value, &opt.prompt) && opt.prompt > 0 &&
           opt.prompt <= 512;
    } else if (flag == "--gaps") {
      opt.gaps.clear();
      for (auto part : absl::StrSplit(value, ',')) {
        double g = 0;
        ok = ok && absl::SimpleAtod(part, &g) && g >= 0 && g <= 60;
        opt.gaps.push_back(g);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "bad flag %s %s (see the file's header)\n",
                   flag.c_str(), value.c_str());
      return 2;
    }
  }
  return pdserve::Run(opt);
}
