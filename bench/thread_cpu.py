#!/usr/bin/env python3
"""Per-process CPU of a running pdserve cluster, sampled from /proc.

Beside a load run (planner_bench, load_bench) this tells which processes use
the cores and whether they are all busy: every --interval seconds it reads
each thread's user + system ticks (10 ms resolution, /proc/PID/task/TID/stat)
of the processes named prefill_worker, decode_worker and router. It is one
process reading files, so it leaves the cluster's cores alone (a shell loop
forking ps/cat per thread slowed the measured cluster 2x).

    bench/thread_cpu.py --seconds 330 > /tmp/threads.log &
    build/bench/planner_bench ...
    bench/thread_cpu.py --summarize /tmp/threads.log

Summarizing splits the samples into runs by router process and prints, per
run, the cores each kind of process used on average and their sum.
"""
import argparse
import collections
import os
import sys
import time

NAMES = ('prefill_worker', 'decode_worker', 'router')


def sample(seconds, interval, out):
    end = time.time() + seconds
    while time.time() < end:
        out.write('=== %.3f\n' % time.time())
        for pid in filter(str.isdigit, os.listdir('/proc')):
            try:
                with open(f'/proc/{pid}/comm') as f:
                    name = f.read().strip()
                if name not in NAMES:
                    continue
                tids = os.listdir(f'/proc/{pid}/task')
            except OSError:  # the process exited meanwhile
                continue
            for tid in tids:
                try:
                    with open(f'/proc/{pid}/task/{tid}/stat') as f:
                        stat = f.read()
                except OSError:
                    continue
                # Fields after the parenthesised name: utime and stime are
                # the 12th and 13th.
                fields = stat[stat.rindex(')') + 2:].split()
                out.write(f'{pid} {tid} {name} '
                          f'{int(fields[11]) + int(fields[12])}\n')
        out.flush()
        time.sleep(interval)


class Run:
    """One load run's samples: the seconds covered, CPU seconds by process
    name, and the prefill processes seen."""

    def __init__(self):
        self.seconds = 0.0
        self.cpu = collections.Counter()
        self.prefill_pids = set()


def read_snapshots(path):
    """[(time, {(pid, tid): (name, ticks)})] from a sample log; exits with
    the file and line of anything else."""
    snapshots = []
    with open(path) as log:
        for number, line in enumerate(log, 1):
            fields = line.split()
            try:
                if fields and fields[0] == '===':
                    snapshots.append((float(fields[1]), {}))
                    continue
                pid, tid, name, ticks = fields
                snapshots[-1][1][(pid, tid)] = (name, int(ticks))
            except (IndexError, ValueError):
                sys.exit(f'{path}:{number}: not a thread_cpu.py sample line: '
                         f'{line.strip()!r}')
    return snapshots


def summarize(path):
    snapshots = read_snapshots(path)
    ticks_per_second = os.sysconf('SC_CLK_TCK')
    runs = collections.OrderedDict()  # by router pid
    for (t0, before), (t1, after) in zip(snapshots, snapshots[1:]):
        routers = {pid for (pid, _), (name, _) in after.items()
                   if name == 'router'}
        if len(routers) != 1:
            continue
        run = runs.setdefault(routers.pop(), Run())
        run.seconds += t1 - t0
        for key, (name, ticks) in after.items():
            if name == 'prefill_worker':
                run.prefill_pids.add(key[0])
            if key in before:
                run.cpu[name] += (ticks - before[key][1]) / ticks_per_second
    for router, run in runs.items():
        parts = ', '.join(f'{name} {used / run.seconds:.2f}'
                          for name, used in sorted(run.cpu.items()))
        print(f'router {router} ({len(run.prefill_pids)} prefill processes, '
              f'{run.seconds:.0f} s): {parts}; sum '
              f'{sum(run.cpu.values()) / run.seconds:.2f} cores')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--seconds', type=float, default=300)
    parser.add_argument('--interval', type=float, default=1.0)
    parser.add_argument('--summarize', metavar='LOG')
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
    else:
        sample(args.seconds, args.interval, sys.stdout)


if __name__ == '__main__':
    main()
