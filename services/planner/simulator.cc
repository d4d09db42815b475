#include "planner/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <list>
#include <memory>
#include <optional>
#include <queue>
#include <random>

#include "absl/strings/str_cat.h"
#include "prefill/chunk_policy.h"
#include "prefill/microbatch_former.h"

namespace pdserve::planner {

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t i =
      std::min(values.size() - 1, static_cast<size_t>(p * values.size()));
  return values[i];
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// What a job on the cores is: a prefill stage's or a decode worker's step
// (compute), or anything else (the router's streaming), which neither slows
// nor is slowed by co-running.
enum class JobKind { kOther, kPrefill, kDecode };

// How much longer a compute job takes while a step of each kind runs beside
// it on its node (PerfModel::co_running).
struct CoRunningSlowdowns {
  double beside_prefill = 0;
  double beside_decode = 0;
};

// The event core: compute jobs share their node's `cores` (processor
// sharing), transfers share the nodes' links, timers fire at fixed times. A
// compute job that runs while another one does on its node (two or more on
// two or more cores) also runs slower by its co-running slow-down beside
// that kind of step (PerfModel::co_running): processes on neighbouring cores
// share the memory bus and the last-level cache, which a step profiled alone
// does not.
class EventLoop {
 public:
  // `gang_model`: where the gang exponent comes from
  // (PerfModel::GangExponentAt); null: processor sharing for gangs too.
  EventLoop(int nodes, int cores, const PerfModel* gang_model)
      : nodes_(nodes), cores_(cores), gang_model_(gang_model) {}

  // Starts a job of `work` seconds (at full speed) on `node`, keeping
  // `demand` cores busy (its threads, or fewer where they wait on each
  // other). A compute job (kind prefill or decode) takes `co_running`'s
  // slow-down longer while another compute job runs on its node — the larger
  // one where both kinds do. `gang`: its threads, which wait for each other
  // at every layer.
  void StartJob(int node, double work, double demand,
                std::function<void(double)> done,
                JobKind kind = JobKind::kOther,
                CoRunningSlowdowns co_running = {}, int gang = 1) {
    co_running.beside_prefill = std::max(co_running.beside_prefill, 0.0);
    co_running.beside_decode = std::max(co_running.beside_decode, 0.0);
    jobs_.push_back(Job{std::max(work, 0.0), demand, kind, co_running, node, -1,
                        std::move(done), gang});
  }
  // Starts sending what takes `seconds` at a link's full speed from node
  // `from` to node `to`. Links are full duplex: the transfers leaving a node
  // share its sending side, those arriving share its receiving side, and a
  // transfer moves at the smaller of its two equal shares.
  void StartTransfer(int from, int to, double seconds,
                     std::function<void(double)> done) {
    jobs_.push_back(Job{std::max(seconds, 0.0),
                        0,
                        JobKind::kOther,
                        {},
                        from,
                        to,
                        std::move(done)});
  }
  void At(double time, std::function<void(double)> fn) {
    timers_.push(Timer{time, next_timer_++, std::move(fn)});
  }
  double now() const { return now_; }

  // Runs until nothing is left.
  void Run() {
    while (!jobs_.empty() || !timers_.empty()) {
      const Shares& shares = ShareOut();
      double job_end = kInf;
      for (const Job& j : jobs_) {
        job_end = std::min(job_end, j.remaining / Rate(j, shares));
      }
      job_end += now_;
      const double timer_at = timers_.empty() ? kInf : timers_.top().time;
      const double next = std::min(job_end, timer_at);
      const double elapsed = next - now_;
      for (Job& j : jobs_) j.remaining -= elapsed * Rate(j, shares);
      now_ = next;
      if (timer_at <= job_end) {
        auto fn = timers_.top().fn;
        timers_.pop();
        fn(now_);
        continue;
      }
      // Every job done by now (a tolerance for the subtraction's rounding).
      std::vector<std::function<void(double)>> finished;
      for (auto it = jobs_.begin(); it != jobs_.end();) {
        if (it->remaining <= 1e-12) {
          finished.push_back(std::move(it->done));
          it = jobs_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto& fn : finished) fn(now_);
    }
  }

 private:
  struct Job {
    double remaining;
    double demand;
    JobKind kind;
    CoRunningSlowdowns co_running;
    int node;     // where it runs; a transfer's sender
    int to = -1;  // a transfer's receiver; -1: a job on the cores
    std::function<void(double)> done;
    int gang = 1;
    bool transfer() const { return to >= 0; }
    bool compute() const { return kind != JobKind::kOther; }
  };
  struct Timer {
    double time;
    uint64_t order;  // FIFO among equal times
    std::function<void(double)> fn;
    bool operator>(const Timer& o) const {
      return time != o.time ? time > o.time : order > o.order;
    }
  };
  // Per node: every job's share of its demand, the compute jobs of each kind
  // running (co-running needs two or more cores), and the transfers leaving
  // and arriving.
  struct Shares {
    std::vector<double> rate;
    std::vector<int> prefill_jobs, decode_jobs;
    // Of those, the ones whose threads wait for each other (Job::gang > 1).
    std::vector<int> gang_jobs;
    std::vector<int> sending, receiving;
    // The compute jobs alone ask for more than the cores (not only the
    // router's short streaming bursts beside them).
    std::vector<char> compute_oversubscribed;
  };
  // Refilled at every event (into the same vectors: the planner simulates
  // thousands of events per layout).
  const Shares& ShareOut() {
    Shares& s = shares_;
    demand_.assign(nodes_, 0);
    compute_demand_.assign(nodes_, 0);
    s.rate.assign(nodes_, 1.0);
    s.prefill_jobs.assign(nodes_, 0);
    s.decode_jobs.assign(nodes_, 0);
    s.gang_jobs.assign(nodes_, 0);
    s.sending.assign(nodes_, 0);
    s.receiving.assign(nodes_, 0);
    s.compute_oversubscribed.assign(nodes_, 0);
    for (const Job& j : jobs_) {
      if (j.transfer()) {
        ++s.sending[j.node];
        ++s.receiving[j.to];
        continue;
      }
      demand_[j.node] += j.demand;
      if (j.compute()) compute_demand_[j.node] += j.demand;
      if (j.kind == JobKind::kPrefill) ++s.prefill_jobs[j.node];
      if (j.kind == JobKind::kDecode) ++s.decode_jobs[j.node];
      if (j.compute() && j.gang > 1) ++s.gang_jobs[j.node];
    }
    for (int n = 0; n < nodes_; ++n) {
      if (demand_[n] > cores_) s.rate[n] = cores_ / demand_[n];
      s.compute_oversubscribed[n] = compute_demand_[n] > cores_;
    }
    return s;
  }
  double Rate(const Job& j, const Shares& s) const {
    if (j.transfer()) {
      return 1.0 / std::max(s.sending[j.node], s.receiving[j.to]);
    }
    const double shared = s.rate[j.node];
    if (!j.compute()) return shared;
    // How much slower than its processor share the job runs: neighbours on
    // the memory bus and the last-level cache (two compute jobs at once: on
    // ≥ 2 cores they are on neighbouring cores however the OS shares them;
    // on one core they take turns) ...
    double slowdown = 1;
    if (cores_ >= 2) {
      const int other_prefills =
          s.prefill_jobs[j.node] - (j.kind == JobKind::kPrefill ? 1 : 0);
      const int other_decodes =
          s.decode_jobs[j.node] - (j.kind == JobKind::kDecode ? 1 : 0);
      if (other_prefills > 0) {
        slowdown = std::max(slowdown, 1 + j.co_running.beside_prefill);
      }
      if (other_decodes > 0) {
        slowdown = std::max(slowdown, 1 + j.co_running.beside_decode);
      }
    }
    // ... or, for threads that meet at every layer (TP ranks at an
    // all-reduce, a pool's workers at a barrier), that they progress only
    // while all of them hold a core: time-sliced apart they lose more than
    // their share. The larger of the two, not both: the gang exponent is
    // fitted (tools/planner_profile.cc) to a gang's whole slow-down beside
    // busy neighbours, which holds their memory-bus contention too, and
    // applying both counted it twice (docs/PERFORMANCE.md, run 19). Beside
    // other gangs only, the exponent measured there: a rank blocked at its
    // all-reduce yields its core to a rank of the other gang, as ready to run
    // as its own.
    if (j.gang > 1 && shared < 1 && s.compute_oversubscribed[j.node] &&
        gang_model_ != nullptr) {
      const bool beside_gangs_only =
          s.gang_jobs[j.node] >= 2 &&
          s.prefill_jobs[j.node] + s.decode_jobs[j.node] == s.gang_jobs[j.node];
      const double gang_slowdown =
          std::pow(shared, -(j.gang - 1) * gang_model_->GangExponentAt(
                                               shared, beside_gangs_only));
      if (beside_gangs_only && gang_model_->gang_beside_gang) {
        // Measured beside a decoding gang, memory bus and all, and below
        // processor sharing's slow-down where the gangs fill each other's
        // waits (e < 0): the whole of it, never faster than alone.
        return std::min(1.0, shared / gang_slowdown);
      }
      slowdown = std::max(slowdown, gang_slowdown);
    }
    return shared / slowdown;
  }

  int nodes_;
  int cores_;
  const PerfModel* gang_model_;
  Shares shares_;
  // ShareOut's per-node tallies: all jobs' demand, the compute jobs'.
  std::vector<double> demand_, compute_demand_;
  double now_ = 0;
  std::list<Job> jobs_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;
  uint64_t next_timer_ = 0;
};

struct Req {
  int id = 0;
  double arrival = 0;
  int prompt = 1;
  int output = 1;
  int kv = 0;  // positions whose KV is computed
  int emitted = 0;
  // Disaggregated across nodes: KV writes still on the network, and whether
  // the last stage has finished the prompt (the hand-off waits for both).
  int kv_in_flight = 0;
  bool prefilled = false;
  // Seconds from a step emitting a token to the client having it (the TTFT
  // offset with this request's scatter draw), set at the first delivery.
  std::optional<double> delivery_delay;
  std::vector<double> deliveries;  // when each streamed item reaches the client
  std::vector<int> item_tokens;
  double end = 0;
  int history() const { return prompt + emitted; }
};

class Simulation {
 public:
  Simulation(const PerfModel& model, const Layout& layout,
             const SimOptions& options)
      : model_(model),
        layout_(layout),
        options_(options),
        loop_(options.nodes, options.cores,
              options.gang_sharing ? &model : nullptr),
        rng_(options.seed),
        spread_rng_(options.seed ^ 0x9E3779B97F4A7C15ull),
        scatter_rng_(options.seed ^ 0xD1B54A32D192ED03ull) {}

  absl::Status Init() {
    placement_ = PlaceLayout(layout_, options_.nodes);
    if (placement_.CrossesNodes()) {
      if (!(options_.network_bytes_per_second > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("layout ", layout_.Name(), " spans nodes (",
                         FormatPlacement(layout_, placement_),
                         "): the simulation needs the nodes' link bandwidth "
                         "(SimOptions::network_bytes_per_second)"));
      }
      if (!(model_.kv_bytes_per_token > 0) ||
          !(model_.activation_bytes_per_token > 0)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layout ", layout_.Name(),
            " spans nodes, and the perf model does not say how many KV and "
            "hidden-state bytes a token sends (a profile from before "
            "multi-node planning): profile again"));
      }
    }
    auto decode_cost =
        model_.Step(ComputeConfig{layout_.tp, layout_.decode_threads});
    if (!decode_cost.ok()) return decode_cost.status();
    for (int w = 0; w < layout_.decode_workers; ++w) {
      decode_.push_back(std::make_unique<DecodeSim>());
      decode_.back()->cost = *decode_cost;
      decode_.back()->node = placement_.decode_node[w];
    }
    if (!layout_.colocated) {
      auto stage_cost = model_.Step(ComputeConfig{1, layout_.prefill_threads});
      if (!stage_cost.ok()) return stage_cost.status();
      auto policy =
          prefill::ParseChunkPolicy("equal-cost", layout_.chunk_tokens);
      if (!policy.ok()) return policy.status();
      for (int g = 0; g < layout_.prefill_groups; ++g) {
        auto group = std::make_unique<GroupSim>(layout_.microbatch_tokens);
        group->cost = *stage_cost;
        group->policy = *policy;
        group->stages.resize(layout_.stages);
        // Layers split as evenly as they go (the `auto` split balances
        // estimated cost, which for a uniform model is the same).
        for (int s = 0; s < layout_.stages; ++s) {
          const int begin = model_.num_layers * s / layout_.stages;
          const int end = model_.num_layers * (s + 1) / layout_.stages;
          group->stages[s].share =
              static_cast<double>(end - begin) / model_.num_layers;
          group->stages[s].node = placement_.stage_node[g][s];
        }
        group->max_in_flight = 2 * layout_.stages;
        prefill_.push_back(std::move(group));
      }
    }
    return absl::OkStatus();
  }

  Prediction Run(const std::vector<SimRequest>& requests, const Slo& slo) {
    reqs_.resize(requests.size());
    decode_of_.assign(requests.size(), nullptr);
    group_of_.assign(requests.size(), nullptr);
    for (size_t i = 0; i < requests.size(); ++i) {
      Req& r = reqs_[i];
      r.id = static_cast<int>(i);
      r.arrival = requests[i].arrival;
      r.prompt = std::max(1, requests[i].prompt_tokens);
      r.output = std::max(1, requests[i].output_tokens);
      loop_.At(r.arrival, [this, &r](double t) { Arrive(r, t); });
    }
    loop_.Run();
    return Summarize(slo);
  }

 private:
  struct DecodeSim {
    const StepCost* cost = nullptr;
    int node = 0;
    std::deque<Req*> waiting;
    std::vector<Req*> running;  // admission order
    bool busy = false;
    double busy_seconds = 0;
    int assigned = 0;  // requests routed here and not finished
  };
  struct StageSim {
    double share = 1;  // of the model's layers
    int node = 0;
    std::deque<std::shared_ptr<prefill::Microbatch>> queue;
    bool busy = false;
    double busy_seconds = 0;
  };
  struct GroupSim {
    explicit GroupSim(int budget) : former(budget) {}
    const StepCost* cost = nullptr;
    prefill::ChunkPolicy policy;
    prefill::MicrobatchFormer former;
    std::vector<StageSim> stages;
    int max_in_flight = 2;
    int in_flight = 0;
    int assigned = 0;
  };

  // The router: least-loaded by requests assigned and not finished (random
  // prompts give the prefix-aware policy nothing to match, so it balances
  // by load too).
  template <typename T>
  T* LeastLoaded(std::vector<std::unique_ptr<T>>& workers) {
    T* best = workers.front().get();
    for (auto& w : workers) {
      if (w->assigned < best->assigned) best = w.get();
    }
    return best;
  }

  void Arrive(Req& r, double t) {
    DecodeSim* decode = LeastLoaded(decode_);
    ++decode->assigned;
    decode_of_[r.id] = decode;
    if (layout_.colocated) {
      decode->waiting.push_back(&r);
      Kick(*decode, t);
      return;
    }
    GroupSim* group = LeastLoaded(prefill_);
    ++group->assigned;
    group_of_[r.id] = group;
    group->former.Add(r.id, 0, prefill::PlanChunks(group->policy, 0, r.prompt));
    IssueMicrobatches(*group, t);
  }

  void Deliver(Req& r, int tokens, double t) {
    if (!r.delivery_delay) {
      const LinearCost offset =
          layout_.colocated
              ? model_.ColocatedTtft({layout_.tp, layout_.decode_threads})
              : model_.disaggregated_ttft;
      const double line = offset.At(r.prompt);
      double scatter = 0;
      if (options_.ttft_scatter && !offset.scatter.empty()) {
        scatter = offset.ScatterAt(
            std::uniform_real_distribution<double>(0.0, 1.0)(scatter_rng_));
      }
      // A draw below the line never makes the offset negative where the
      // line is not (a client never has a token before it is emitted).
      r.delivery_delay = std::max(std::min(line, 0.0), line + scatter);
    }
    r.deliveries.push_back(t + *r.delivery_delay);
    // The router streams from node 0.
    if (options_.router_shares_cores && model_.delivery_cpu_seconds > 0) {
      loop_.StartJob(/*node=*/0, model_.delivery_cpu_seconds * tokens, 1,
                     [](double) {});
    }
    r.item_tokens.push_back(tokens);
    r.emitted += tokens;
  }

  void Finish(Req& r, double t) {
    r.end = r.deliveries.empty() ? t : r.deliveries.back();
    --decode_of_[r.id]->assigned;
    if (!layout_.colocated) --group_of_[r.id]->assigned;
  }

  // ---- Prefill pipeline -------------------------------------------------

  void IssueMicrobatches(GroupSim& g, double t) {
    while (g.in_flight < g.max_in_flight) {
      std::optional<prefill::Microbatch> mb = g.former.Next();
      if (!mb) break;
      ++g.in_flight;
      g.stages[0].queue.push_back(
          std::make_shared<prefill::Microbatch>(*std::move(mb)));
      StartStage(g, 0, t);
    }
  }

  void StartStage(GroupSim& g, int s, double t) {
    StageSim& stage = g.stages[s];
    if (stage.busy || stage.queue.empty()) return;
    std::shared_ptr<prefill::Microbatch> mb = stage.queue.front();
    stage.queue.pop_front();
    StepShape shape;
    int final_chunks = 0;
    for (const prefill::ChunkWork& c : mb->chunks) {
      shape.tokens += c.num_tokens();
      shape.attended_positions +=
          AttendedPositions(c.token_begin, c.num_tokens());
      if (c.final_chunk) ++final_chunks;
    }
    const bool last = s + 1 == static_cast<int>(g.stages.size());
    // The layers' share of the step; the LM head only on the last stage.
    shape.logit_rows = 0;
    double work = g.cost->Seconds(shape) * Spread(*g.cost) * stage.share;
    if (last) work += g.cost->seconds_per_logit_row() * final_chunks;
    stage.busy = true;
    const double start = t;
    loop_.StartJob(
        stage.node, work, model_.BusyCores({1, layout_.prefill_threads}),
        [this, &g, s, mb, last, start](double now) {
          StageSim& st = g.stages[s];
          st.busy = false;
          st.busy_seconds += now - start;
          SendKv(st, *mb);
          if (last) {
            --g.in_flight;
            for (const prefill::ChunkWork& c : mb->chunks) {
              if (c.final_chunk) PrefillDone(reqs_[c.request_id], now);
            }
            IssueMicrobatches(g, now);
          } else if (g.stages[s + 1].node == st.node) {
            g.stages[s + 1].queue.push_back(mb);
            StartStage(g, s + 1, now);
          } else {
            int tokens = 0;
            for (const prefill::ChunkWork& c : mb->chunks) {
              tokens += c.num_tokens();
            }
            loop_.StartTransfer(st.node, g.stages[s + 1].node,
                                tokens * model_.activation_bytes_per_token /
                                    options_.network_bytes_per_second,
                                [this, &g, s, mb](double then) {
                                  g.stages[s + 1].queue.push_back(mb);
                                  StartStage(g, s + 1, then);
                                });
          }
          StartStage(g, s, now);
        },
        JobKind::kPrefill,
        CoRunningSlowdowns{model_.co_running.PrefillBesidePrefill(),
                           model_.co_running.prefill_stage},
        layout_.prefill_threads);
  }

  // The stage's layers' KV of each chunk it finished, to the request's
  // decode worker: through memory on the same node (in the hand-off's
  // measured costs), over the link from another.
  void SendKv(const StageSim& stage, const prefill::Microbatch& mb) {
    for (const prefill::ChunkWork& c : mb.chunks) {
      Req& r = reqs_[c.request_id];
      const int to = decode_of_[r.id]->node;
      if (to == stage.node) continue;
      ++r.kv_in_flight;
      loop_.StartTransfer(stage.node, to,
                          c.num_tokens() * model_.kv_bytes_per_token *
                              stage.share / options_.network_bytes_per_second,
                          [this, &r](double now) {
                            if (--r.kv_in_flight == 0 && r.prefilled) {
                              HandOff(r, now);
                            }
                          });
    }
  }

  void PrefillDone(Req& r, double t) {
    r.kv = r.prompt;
    Deliver(r, 1, t);  // the last stage sampled token 0
    if (r.emitted >= r.output) {
      Finish(r, t);
      return;
    }
    r.prefilled = true;
    // The decode worker takes it once its KV is all there.
    if (r.kv_in_flight == 0) HandOff(r, t);
  }

  void HandOff(Req& r, double t) {
    DecodeSim* decode = decode_of_[r.id];
    loop_.At(t + model_.handoff_seconds, [this, decode, &r](double now) {
      decode->waiting.push_back(&r);
      Kick(*decode, now);
    });
  }

  // ---- Decode worker (decode/step_planner.h's rule) ----------------------

  struct Planned {
    Req* r;
    int feed;
    int drafts;
    bool logits;
  };

  void Kick(DecodeSim& w, double t) {
    if (w.busy) return;
    while (!w.waiting.empty() &&
           static_cast<int>(w.running.size()) < layout_.max_running) {
      w.running.push_back(w.waiting.front());
      w.waiting.pop_front();
    }
    if (w.running.empty()) return;
    int decoding = 0;
    for (Req* r : w.running) decoding += r->kv + 1 == r->history() ? 1 : 0;
    // Speculation is off for a step with more decodes than this
    // (decode::SpeculationOptions::max_batch).
    const bool speculate = layout_.gamma > 0 && decoding <= 4;
    std::vector<Planned> plan;
    StepShape shape;
    int budget = layout_.max_step_tokens;
    for (Req* r : w.running) {
      if (budget <= 0) break;
      Planned p{r, std::min(r->history() - r->kv, budget), 0, false};
      p.logits = r->kv + p.feed == r->history();
      if (p.logits && p.feed == 1 && speculate) {
        p.drafts =
            std::min({layout_.gamma, budget - 1, r->output - r->emitted - 1});
        p.drafts = std::max(p.drafts, 0);
      }
      budget -= p.feed + p.drafts;
      shape.tokens += p.feed + p.drafts;
      shape.logit_rows += p.logits ? 1 + p.drafts : 0;
      shape.attended_positions += AttendedPositions(r->kv, p.feed + p.drafts);
      plan.push_back(p);
    }
    w.busy = true;
    const double start = t;
    loop_.StartJob(
        w.node,
        w.cost->Seconds(shape) * Spread(*w.cost) +
            model_.StepOverhead({layout_.tp, layout_.decode_threads}),
        model_.BusyCores({layout_.tp, layout_.decode_threads}),
        [this, &w, plan = std::move(plan), start](double now) {
          w.busy = false;
          w.busy_seconds += now - start;
          Apply(w, plan, now);
          Kick(w, now);
        },
        JobKind::kDecode,
        CoRunningSlowdowns{model_.co_running.decode_step,
                           model_.co_running.DecodeBesideDecode()},
        layout_.tp * layout_.decode_threads);
  }

  void Apply(DecodeSim& w, const std::vector<Planned>& plan, double t) {
    std::bernoulli_distribution accept(options_.ngram_acceptance);
    for (const Planned& p : plan) {
      Req& r = *p.r;
      r.kv += p.feed;
      if (!p.logits) continue;
      int accepted = 0;
      while (accepted < p.drafts && accept(rng_)) ++accepted;
      Deliver(r, std::min(1 + accepted, r.output - r.emitted), t);
      r.kv = r.history() - 1;  // the newest token is fed next step
      if (r.emitted >= r.output) {
        w.running.erase(std::find(w.running.begin(), w.running.end(), &r));
        Finish(r, t);
      }
    }
  }

  Prediction Summarize(const Slo& slo) {
    Prediction p;
    std::vector<double> ttft, tpot, itl;
    int good = 0;
    int64_t tokens = 0;
    double end = 0;
    for (const Req& r : reqs_) {
      const double first = r.deliveries.front() - r.arrival;
      ttft.push_back(first);
      double request_tpot = 0;
      if (r.emitted > 1) {
        request_tpot =
            (r.deliveries.back() - r.deliveries.front()) / (r.emitted - 1);
        tpot.push_back(request_tpot);
      }
      for (size_t i = 1; i < r.deliveries.size(); ++i) {
        itl.push_back(r.deliveries[i] - r.deliveries[i - 1]);
      }
      if (options_.per_request) {
        p.request_ttft.push_back(first);
        p.request_tpot.push_back(request_tpot);
        p.request_first_gap.push_back(
            r.deliveries.size() > 1 ? r.deliveries[1] - r.deliveries[0] : 0);
      }
      tokens += r.emitted;
      end = std::max(end, r.end);
      if (first <= slo.ttft_seconds &&
          (r.emitted <= 1 || request_tpot <= slo.tpot_seconds)) {
        ++good;
      }
    }
    for (double v : ttft) p.ttft_mean += v / ttft.size();
    p.ttft_p50 = Percentile(ttft, 0.5);
    p.ttft_p99 = Percentile(ttft, 0.99);
    p.tpot_p50 = Percentile(tpot, 0.5);
    p.tpot_p99 = Percentile(tpot, 0.99);
    p.itl_p50 = Percentile(itl, 0.5);
    p.itl_p99 = Percentile(itl, 0.99);
    p.duration = end;
    p.goodput = end > 0 ? good / end : 0;
    p.slo_attainment = static_cast<double>(good) / reqs_.size();
    p.tokens_per_s = end > 0 ? tokens / end : 0;
    if (end > 0) {
      double busy = 0;
      for (auto& w : decode_) busy += w->busy_seconds;
      p.decode_busy_seconds = busy;
      p.decode_utilisation = busy / (end * decode_.size());
      if (!prefill_.empty()) {
        busy = 0;
        int stages = 0;
        for (auto& g : prefill_) {
          for (auto& s : g->stages) {
            busy += s.busy_seconds;
            ++stages;
          }
        }
        p.prefill_busy_seconds = busy;
        p.prefill_utilisation = busy / (end * stages);
      }
    }
    return p;
  }

  const PerfModel& model_;
  const Layout& layout_;
  const SimOptions options_;
  Placement placement_;
  EventLoop loop_;
  // The factor a step of `cost` takes its fitted time by this time.
  double Spread(const StepCost& cost) {
    if (!options_.step_spread || cost.spread().empty()) return 1.0;
    return cost.SpreadAt(
        std::uniform_real_distribution<double>(0.0, 1.0)(spread_rng_));
  }

  std::mt19937_64 rng_;
  // Its own stream, so turning the spread on or off leaves the acceptance
  // draws as they were.
  std::mt19937_64 spread_rng_;
  // And the TTFT offsets' scatter draws theirs.
  std::mt19937_64 scatter_rng_;
  std::vector<Req> reqs_;
  std::vector<std::unique_ptr<DecodeSim>> decode_;
  std::vector<std::unique_ptr<GroupSim>> prefill_;
  // By request id: where the router sent it.
  std::vector<DecodeSim*> decode_of_;
  std::vector<GroupSim*> group_of_;
};

// Each figure's median over the runs, with goodput's range.
Prediction MedianPrediction(const std::vector<Prediction>& runs) {
  auto median = [&runs](double Prediction::*field) {
    std::vector<double> v;
    for (const Prediction& p : runs) v.push_back(p.*field);
    return Median(std::move(v));
  };
  Prediction out;
  for (double Prediction::*field :
       {&Prediction::ttft_mean, &Prediction::ttft_p50, &Prediction::ttft_p99,
        &Prediction::tpot_p50, &Prediction::tpot_p99, &Prediction::itl_p50,
        &Prediction::itl_p99, &Prediction::goodput, &Prediction::slo_attainment,
        &Prediction::tokens_per_s, &Prediction::duration,
        &Prediction::decode_utilisation, &Prediction::prefill_utilisation,
        &Prediction::decode_busy_seconds, &Prediction::prefill_busy_seconds}) {
    out.*field = median(field);
  }
  out.goodput_low = out.goodput_high = runs.front().goodput;
  for (const Prediction& p : runs) {
    out.goodput_low = std::min(out.goodput_low, p.goodput);
    out.goodput_high = std::max(out.goodput_high, p.goodput);
  }
  out.replications = static_cast<int>(runs.size());
  for (std::vector<double> Prediction::*field :
       {&Prediction::request_ttft, &Prediction::request_tpot,
        &Prediction::request_first_gap}) {
    const size_t n = (runs.front().*field).size();
    for (size_t i = 0; i < n; ++i) {
      std::vector<double> v;
      for (const Prediction& p : runs) v.push_back((p.*field)[i]);
      (out.*field).push_back(Median(std::move(v)));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<Prediction> Simulate(const PerfModel& model,
                                    const Layout& layout,
                                    const std::vector<SimRequest>& requests,
                                    const Slo& slo, const SimOptions& options) {
  if (requests.empty()) {
    return absl::InvalidArgumentError("simulating needs at least one request");
  }
  if (layout.decode_workers < 1 || layout.tp < 1 || layout.decode_threads < 1 ||
      layout.max_step_tokens < 1 || layout.max_running < 1 ||
      (!layout.colocated &&
       (layout.prefill_groups < 1 || layout.stages < 1 ||
        layout.prefill_threads < 1 || layout.chunk_tokens < 1 ||
        layout.stages > model.num_layers))) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout ", layout.Name(),
                     " needs ≥ 1 of each worker, thread, token budget, and "
                     "no more stages than layers"));
  }
  if (options.cores < 1 || options.nodes < 1 ||
      options.nodes > kMaxPlannedNodes ||
      !(options.network_bytes_per_second >= 0) ||
      !(options.ngram_acceptance >= 0) || options.ngram_acceptance >= 1 ||
      options.replications < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("simulation needs 1..", kMaxPlannedNodes,
                     " nodes of ≥ 1 core, a link bandwidth ≥ 0, an "
                     "acceptance in [0, 1) and ≥ 1 replication"));
  }
  const LinearCost& ttft_offset =
      layout.colocated ? model.ColocatedTtft({layout.tp, layout.decode_threads})
                       : model.disaggregated_ttft;
  const bool draws = options.step_spread ||
                     (options.ttft_scatter && !ttft_offset.scatter.empty()) ||
                     (layout.gamma > 0 && options.ngram_acceptance > 0);
  const int runs = draws ? options.replications : 1;
  std::vector<Prediction> predictions;
  for (int i = 0; i < runs; ++i) {
    SimOptions run = options;
    run.seed = options.seed + static_cast<uint64_t>(i);
    Simulation sim(model, layout, run);
    if (absl::Status s = sim.Init(); !s.ok()) return s;
    predictions.push_back(sim.Run(requests, slo));
  }
  return MedianPrediction(predictions);
}

}  // namespace pdserve::planner
