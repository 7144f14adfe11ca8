#!/usr/bin/env python3
"""tools/ab_env.py - alternate `python -m chorus.bench` jobs that differ only in environment
variables, and summarise each variant over the rounds (docs/PERFORMANCE.md quotes it).

    python3 tools/ab_env.py [--rounds R] [--out DIR] -v NAME[:VAR=VAL[,VAR=VAL...]] ... \\
        -- BENCH ARGS

e.g. python3 tools/ab_env.py --rounds 5 -v direct -v ring:CHORUS_ALGO=broadcast:ring \\
        -- --nproc 4 -o broadcast -b 16K -e 128K -f 2 -n 200 -w 20 --compare gloo

Every round runs each variant once, in the order given, as its own job (`python -m
chorus.bench BENCH ARGS --json DIR/NAME-rK.json`, with the variant's variables added to the
environment), so that drift of the machine over the session falls on all variants alike. A
variant without variables is the environment as it is. The summary has one line per
(collective, size, half): for each variant the median of Chorus's time over the rounds in
microseconds and its range, and, where the bench ran with --compare, the median speed-up
over the other backend measured in the same jobs.

One job's halves can disagree by up to 3x on a loaded or noisy host (one stall decides a
row): the median over rounds, with its range beside it, is what a variant is judged by."""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from perf_table import human  # tools/: the same size labels as the tables


def parse_variant(text):
    name, _, spec = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"variant {text!r}: empty name")
    # Commas separate variables; a piece that does not start with VAR= belongs to the value
    # before it (CHORUS_ALGO=allreduce:rhd,alltoall:pairwise is one variable).
    items = []
    for piece in filter(None, spec.split(",")):
        if re.match(r"[A-Za-z_][A-Za-z0-9_]*=", piece) or not items:
            items.append(piece)
        else:
            items[-1] += "," + piece
    env = {}
    for item in items:
        var, eq, val = item.partition("=")
        if not eq or not var:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not VAR=VAL")
        env[var] = val
    return name, env


def load(path):
    """The records of one job: the bench's --json writes one JSON list."""
    with open(path) as f:
        return json.load(f)


def summarise(results, names):
    """results: {variant: [records of one job, ...]} -> printed lines"""
    # (op, bytes, inplace) -> variant -> {"t": [chorus times], "x": [speed-ups]}
    rows = {}
    for name in names:
        for job in results.get(name, []):
            by_key = {}
            for r in job:
                key = (r["op"], r["bytes"], bool(r["inplace"]))
                by_key.setdefault(key, {})[r["backend"]] = r["time_us"]
            for key, t in by_key.items():
                if "chorus" not in t:
                    continue
                cell = rows.setdefault(key, {}).setdefault(name, {"t": [], "x": []})
                cell["t"].append(t["chorus"])
                others = [v for b, v in t.items() if b != "chorus"]
                if others and t["chorus"] > 0:
                    cell["x"].append(others[0] / t["chorus"])
    lines = ["# op size half | " + " | ".join(
        f"{n}: median us (min..max) [x other]" for n in names)]
    for (op, nbytes, inplace) in sorted(rows):
        cells = []
        for n in names:
            c = rows[(op, nbytes, inplace)].get(n)
            if not c or not c["t"]:
                cells.append("-")
                continue
            s = f"{statistics.median(c['t']):.1f} ({min(c['t']):.1f}..{max(c['t']):.1f})"
            if c["x"]:
                s += f" [{statistics.median(c['x']):.2f}x]"
            cells.append(s)
        half = "in place" if inplace else "out-of-place"
        lines.append(f"{op} {human(nbytes)} {half} | " + " | ".join(cells))
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("ab_env: give the bench's arguments after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    own, bench_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="ab_env.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--variant", type=parse_variant, action="append", required=True,
                   help="NAME[:VAR=VAL,...]; repeat for each variant")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="ab_env_out")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(own)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    names = [n for n, _ in args.variant]
    if len(set(names)) != len(names):
        p.error("variant names must differ")
    if any(a == "--json" or a.startswith("--json=") for a in bench_args):
        p.error("the bench's --json is set by this tool")
    os.makedirs(args.out, exist_ok=True)
    results = {}
    failed = 0
    for k in range(args.rounds):
        for name, env in args.variant:
            path = os.path.join(args.out, f"{name}-r{k}.json")
            cmd = [args.python, "-m", "chorus.bench", *bench_args, "--json", path]
            envs = " ".join(f"{a}={b}" for a, b in env.items())
            print(f"== round {k} {name}: {envs} {' '.join(cmd[1:])}", file=sys.stderr,
                  flush=True)
            with open(os.path.join(args.out, f"{name}-r{k}.txt"), "w") as log:
                rc = subprocess.call(cmd, env={**os.environ, **env}, stdout=log,
                                     stderr=subprocess.STDOUT)
            if rc != 0 or not os.path.exists(path):
                print(f"   job failed (exit {rc}); see {log.name}", file=sys.stderr)
                failed += 1
                continue
            results.setdefault(name, []).append(load(path))
    for line in summarise(results, names):
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
