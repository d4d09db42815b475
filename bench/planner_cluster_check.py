#!/usr/bin/env python3
"""Checks the planner's calibrations on a running `pdserve local` cluster.

Start the default layout first (its OpenAI HTTP on 127.0.0.1:8000, worker
metrics on the default ports 9110/9111/9120), speculation off:

  build/pdserve local --model ../shared/models/bench-configs/llama-110m.json \\
      --format dummy --speculation off &

  bench/planner_cluster_check.py gang   # decode alone vs beside a prefill flood
  bench/planner_cluster_check.py busy   # the long workload; workers' busy seconds

gang: six rounds of a batch of 4 streamed requests (32-token prompts, 64
tokens) decoded alone, then while `--flood` clients send 256-token prompts
(max_tokens 1) back to back; prints the mean TPOT of each and beside over alone
— what the profile's side-by-side gang calibration measures in-process.

busy: `--requests` Poisson arrivals at 1/s, prompts 256..400, outputs 16..64
(planner_bench's long workload); prints TTFT/TPOT/ITL percentiles and each
worker's busy seconds (pdserve_prefill_stage_busy_seconds_total,
pdserve_decode_step_seconds_sum) over the run, to set beside `pdserve plan`'s
dec% and pre% for the same workload. Standard library only.
"""
import argparse
import http.client
import json
import random
import statistics
import threading
import time
import urllib.request

BUSY_METRICS = ("pdserve_prefill_stage_busy_seconds_total",
                "pdserve_decode_step_seconds_sum",
                "pdserve_decode_step_seconds_count")


def stream(port, prompt, tokens, stream_tokens=True):
    """Times of the streamed chunks (one per token with logprobs on)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "temperature": 0, "stream": stream_tokens, "logprobs": 0}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]}")
    response_times = []
    while True:
        line = response.readline()
        if not line:
            break
        if line.startswith(b"data: {"):
            response_times.append(time.monotonic())
    conn.close()
    return response_times


def random_prompt(rng, length):
    return [1] + [rng.randrange(3, 30000) for _ in range(length - 1)]


def gang(args):
    rng = random.Random(1)
    busy, stop = threading.Event(), threading.Event()

    def flood():
        own = random.Random()
        while not stop.is_set():
            if not busy.is_set():
                time.sleep(0.005)
                continue
            stream(args.port, random_prompt(own, 256), 1, stream_tokens=False)

    def batch():
        results = [None] * 4

        def one(i):
            results[i] = stream(args.port, random_prompt(rng, 32), 64)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return statistics.mean((r[-1] - r[0]) / (len(r) - 1) for r in results)

    floods = [threading.Thread(target=flood) for _ in range(args.flood)]
    for t in floods:
        t.start()
    try:
        batch()  # warm-up
        tpot = {0: [], 1: []}
        for round_ in range(6):
            for beside in (0, 1):
                (busy.set if beside else busy.clear)()
                time.sleep(0.8)
                tpot[beside].append(batch())
                print(f"round {round_} {'beside' if beside else 'alone '} "
                      f"TPOT {tpot[beside][-1] * 1e3:.2f} ms", flush=True)
    finally:
        stop.set()
        busy.set()
        for t in floods:
            t.join()
    alone, beside = statistics.mean(tpot[0]), statistics.mean(tpot[1])
    print(f"alone {alone * 1e3:.2f} ms, beside {beside * 1e3:.2f} ms: "
          f"{beside / alone:.2f}x")


def scrape(port):
    totals = {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
    for line in text.decode().splitlines():
        if line.startswith("#"):
            continue
        for name in BUSY_METRICS:
            if line.startswith(name):
                totals[name] = totals.get(name, 0) + float(line.split()[-1])
    return totals


def busy(args):
    ports = {"stage 0": 9110, "stage 1": 9111, "decode": 9120}
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(1.0)
        arrivals.append((t, random_prompt(rng, rng.randint(256, 400)),
                         rng.randint(16, 64)))
    results = [None] * len(arrivals)

    def run(i):
        at, prompt, tokens = arrivals[i]
        time.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        times = stream(args.port, prompt, tokens)
        results[i] = (times[0] - sent,
                      (times[-1] - times[0]) / max(1, len(times) - 1),
                      [b - a for a, b in zip(times, times[1:])])

    before = {n: scrape(p) for n, p in ports.items()}
    start = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,))
               for i in range(len(arrivals))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    duration = time.monotonic() - start
    after = {n: scrape(p) for n, p in ports.items()}

    def pct(values, p):
        values = sorted(values)
        return values[min(len(values) - 1, int(p * len(values)))] * 1e3
    ttft = [r[0] for r in results]
    tpot = [r[1] for r in results]
    itl = [x for r in results for x in r[2]]
    print(f"{duration:.1f} s; TTFT p50 {pct(ttft, .5):.0f} p99 "
          f"{pct(ttft, .99):.0f} ms; TPOT p50 {pct(tpot, .5):.1f} p99 "
          f"{pct(tpot, .99):.1f} ms; ITL p50 {pct(itl, .5):.1f} p99 "
          f"{pct(itl, .99):.1f} ms")
    for name in ports:
        delta = {k: after[name].get(k, 0) - before[name].get(k, 0)
                 for k in BUSY_METRICS}
        seconds = (delta["pdserve_prefill_stage_busy_seconds_total"] +
                   delta["pdserve_decode_step_seconds_sum"])
        steps = delta["pdserve_decode_step_seconds_count"]
        extra = f", {steps:.0f} steps" if steps else ""
        print(f"{name}: busy {seconds:.2f} s, {100 * seconds / duration:.0f}%"
              f"{extra}")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=["gang", "busy"])
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--flood", type=int, default=4,
                   help="gang: clients sending prompts back to back")
    p.add_argument("--requests", type=int, default=60, help="busy: requests")
    args = p.parse_args()
    gang(args) if args.mode == "gang" else busy(args)


if __name__ == "__main__":
    main()
