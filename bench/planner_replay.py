#!/usr/bin/env python3
"""Re-predicts a past planner_bench run's measured rows with today's model.

Measuring the planner's layouts takes planner_bench 25-75 minutes of a quiet
machine; predicting them takes `pdserve plan` seconds. Given a run's printed
log and the profiles it saved (--save-perf-model; with --reprofile one per
prompt range, FILE.16-64 and FILE.256-400), this predicts every measured row
again with the current build and prints each error beside the one the run
printed, then how many are within the issue's 20% and the mean
|log(predicted / measured)| of each kind of figure. A model change that only
helps the run it was tuned on shows here on the others.

  bench/planner_replay.py bench/planner_runs/run21.log \\
      --profiles bench/planner_runs/run21.perf.json.16-64 \\
                 bench/planner_runs/run21.perf.json.256-400

bench/planner_runs/ keeps the measured runs (README there).

The workloads (prompt ranges, SLOs, rates, request counts) come from the log;
--seed and --replications must be what the run used (planner_bench's
defaults unless given).
"""
import argparse
import math
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKLOAD = re.compile(
    r"^(short|long), tight (TTFT|TPOT) \(SLO TTFT ≤ (\d+) ms, TPOT ≤ (\d+) ms\)")
# A row of the "predicted vs measured" tables; with --repeats > 1 each
# measured figure (the median of the rounds) carries its range in brackets.
ROW = re.compile(
    r"^\| (\S+) \| (.+?) \| ([\d.]+) / ([\d.]+) ms(?: \[[^]]*\])? \| \S+ \| "
    r"([\d.]+) / ([\d.]+) ms(?: \[[^]]*\])? \| \S+ \| ([\d.]+) / ([\d.]+) /s")
# Runs before --reprofile (run 15 and older) had one measured section for
# both prompt ranges.
MEASURED = re.compile(
    r"^== measured(?:, prompts (\d+)\.\.(\d+))? \(load_bench's open loop, "
    r"(\d+) requests at ([\d.]+)/s")
RANGES = [(16, 64), (256, 400)]  # planner_bench's short and long prompts
RANKED = re.compile(
    r"^\d+\s+(.+?)\s{2,}([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms\s+([\d.]+)ms\s+"
    r"([\d.]+)ms\s+([\d.]+)/s")
SAME = re.compile(r"^\s+predicted the same: (.+)$")


def parse_log(text):
    """Workloads with their measured rows, and each prompt range's load."""
    loads = {}
    for line in text.splitlines():
        m = MEASURED.match(line)
        if m:
            load = (int(m.group(3)), float(m.group(4)))
            if m.group(1):
                loads[(int(m.group(1)), int(m.group(2)))] = load
            else:
                loads.update({r: load for r in RANGES})
    start = text.find("== predicted vs measured")
    if start < 0:
        sys.exit("no '== predicted vs measured' table in the log: did the "
                 "run finish?")
    workloads = []
    for line in text[start:].splitlines():
        m = WORKLOAD.match(line)
        if m:
            workloads.append({"kind": m.group(1), "slo": m.group(2),
                              "ttft_ms": int(m.group(3)),
                              "tpot_ms": int(m.group(4)), "rows": []})
            continue
        m = ROW.match(line)
        if m and workloads:
            workloads[-1]["rows"].append({
                "layout": m.group(2),
                "logged": [float(m.group(3)), float(m.group(5)),
                           float(m.group(7))],
                "measured": [float(m.group(4)), float(m.group(6)),
                             float(m.group(8))]})
    return workloads, loads


def predict(args, profile, prompts, requests, rate, slo_ttft, slo_tpot):
    """{layout name: [TTFT p99 ms, TPOT p99 ms, goodput]} from pdserve plan."""
    out = subprocess.run(
        [args.pdserve, "plan", "--model", args.model, "--format", "dummy",
         "--profile", "0", "--perf-model", profile, "--prompt",
         f"{prompts[0]}:{prompts[1]}", "--rate", str(rate), "--requests",
         str(requests), "--seed", str(args.seed), "--replications",
         str(args.replications), "--slo-ttft-ms", str(slo_ttft),
         "--slo-tpot-ms", str(slo_tpot), "--oversubscribe", "1", "--show",
         "100000", "--ttft-scatter", str(args.ttft_scatter)],
        capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"pdserve plan failed: {out.stderr or out.stdout}")
    table, last = {}, None
    for line in out.stdout.splitlines():
        m = RANKED.match(line)
        if m:
            last = [float(m.group(3)), float(m.group(5)), float(m.group(7))]
            table[m.group(1)] = last
            continue
        m = SAME.match(line)
        if m and last:
            for name in m.group(1).split("; "):
                table[name] = last
    return table


def error(predicted, measured):
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / measured


def mean_abs_log(errors):
    # A prediction of 0 (error -100%) has no log; such figures are counted
    # in the within-20% line only.
    kept = [abs(math.log1p(e)) for e in errors if e > -1 and math.isfinite(e)]
    return sum(kept) / len(kept) if kept else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("log", help="planner_bench's printed output")
    p.add_argument("--profiles", nargs="+", required=True,
                   help="the run's saved profile, or one per prompt range in "
                        "the log's order (short, long)")
    p.add_argument("--model", default=os.path.join(
        ROOT, "..", "shared", "models", "bench-configs", "llama-110m.json"))
    p.add_argument("--pdserve", default=os.path.join(ROOT, "build", "pdserve"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--replications", type=int, default=15)
    p.add_argument("--ttft-scatter", type=int, choices=(0, 1), default=0,
                   help="1: draw the TTFT offsets' measured scatter")
    args = p.parse_args()

    with open(args.log, encoding="utf-8") as f:
        workloads, loads = parse_log(f.read())
    ranges = sorted(loads)
    if len(args.profiles) not in (1, len(ranges)):
        sys.exit(f"{len(ranges)} prompt ranges in the log; give 1 profile or "
                 f"{len(ranges)}")
    profile_of = {r: args.profiles[min(i, len(args.profiles) - 1)]
                  for i, r in enumerate(ranges)}
    names = ["TTFT p99", "TPOT p99", "goodput"]
    now_errors, logged_errors = [[], [], []], [[], [], []]
    for w in workloads:
        prompts = RANGES[0] if w["kind"] == "short" else RANGES[1]
        if prompts not in loads:
            sys.exit(f"no measured section for prompts {prompts} in the log")
        requests, rate = loads[prompts]
        table = predict(args, profile_of[prompts], prompts, requests, rate,
                        w["ttft_ms"], w["tpot_ms"])
        print(f"\n{w['kind']}, tight {w['slo']} (SLO TTFT ≤ {w['ttft_ms']} ms, "
              f"TPOT ≤ {w['tpot_ms']} ms; {requests} requests at {rate}/s)")
        print(f"{'layout':44s} " + "  ".join(f"{n:>19s}" for n in names))
        for row in w["rows"]:
            now = table.get(row["layout"])
            if now is None:
                print(f"{row['layout']:44s} not enumerated by today's model")
                continue
            cells = []
            for k in range(3):
                e_now = error(now[k], row["measured"][k])
                e_then = error(row["logged"][k], row["measured"][k])
                now_errors[k].append(e_now)
                logged_errors[k].append(e_then)
                cells.append(f"{e_now * 100:+5.0f}% (was {e_then * 100:+5.0f}%)")
            print(f"{row['layout']:44s} " + "  ".join(f"{c:>19s}" for c in cells))
    flat_now = [e for es in now_errors for e in es]
    flat_then = [e for es in logged_errors for e in es]
    if not flat_now:
        sys.exit("no measured rows found")
    within = lambda es: sum(abs(e) <= 0.2 for e in es)
    print(f"\nwithin 20%: {within(flat_now)}/{len(flat_now)} now, "
          f"{within(flat_then)}/{len(flat_then)} as logged; worst "
          f"{max(abs(e) for e in flat_now) * 100:.0f}% now, "
          f"{max(abs(e) for e in flat_then) * 100:.0f}% as logged")
    for k, n in enumerate(names):
        print(f"mean |log(predicted / measured)|, {n}: "
              f"{mean_abs_log(now_errors[k]):.3f} now, "
              f"{mean_abs_log(logged_errors[k]):.3f} as logged")


if __name__ == "__main__":
    main()
