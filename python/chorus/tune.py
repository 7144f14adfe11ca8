# chorus.tune - which algorithm Chorus would run for each collective and size on a given
# topology, with the predicted time and the runner-up (`python -m chorus.tune --nranks 64
# --ranks-per-host 8`). The decision is the C core's chorus_tune_plan, the same code path a
# communicator takes, so CHORUS_ALGO and CHORUS_TUNE_MODEL apply here too.
import argparse
import json
import re
import sys

from ._C import tune_plan as _tune_plan

COLLECTIVES = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
               "all_to_all", "gather", "scatter", "barrier"]
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text):
    """'8', '64K', '1M', '1G' (powers of 1024, optional B/iB) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 1M, 1G)")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def _canonical(name):
    key = name.replace("_", "").replace("-", "").lower()
    for c in COLLECTIVES + ["all"]:
        if c.replace("_", "") == key:
            return c
    aliases = {"bcast": "broadcast", "alltoall": "all_to_all"}
    if key in aliases:
        return aliases[key]
    raise argparse.ArgumentTypeError(
        f"unknown collective {name!r} (valid: {', '.join(COLLECTIVES)}, all)")


def sizes(begin, end, factor):
    out, b = [], begin
    while b <= end:
        out.append(b)
        nb = int(b * factor)
        b = nb if nb > b else b + 1
    return out


def plan(collective, nbytes, nranks, ranks_per_host, shm=True, algo=None, unimplemented=False,
         spin=None):
    """One decision: dict(algo, predicted_us, forced, fell_back, nhosts, spin, candidates).
    spin: True if every rank's engine spins, False if not every one, None as ranks_per_host
    ranks on this machine would (CHORUS_SPIN_COUNT, else two cores per rank)."""
    return _tune_plan(collective, nbytes, nranks, ranks_per_host, shm, algo, unimplemented,
                      -1 if spin is None else int(bool(spin)))


def _fmt_us(us):
    return "-" if us is None else f"{us:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m chorus.tune",
        description="Print the algorithm Chorus chooses per collective and size for a topology "
                    "(hosts filled in rank order), with its predicted time and the runner-up.")
    ap.add_argument("--nranks", "-n", type=int, required=True, help="ranks in the group (>= 1)")
    ap.add_argument("--ranks-per-host", "-k", type=int, default=None,
                    help="ranks per host (default: all on one host); the last host holds the "
                         "remainder when it does not divide --nranks")
    ap.add_argument("--collective", "-c", type=_canonical, default="all_reduce",
                    help="collective name or 'all' (default all_reduce)")
    ap.add_argument("--shm", type=int, choices=[0, 1], default=1,
                    help="1: ranks of a host use shared memory (default); 0: TCP sockets")
    ap.add_argument("--spin", choices=["auto", "0", "1"], default="auto",
                    help="1: every rank's engine spins (a host with two cores per rank, or "
                         "CHORUS_SPIN_COUNT > 0), which makes socket steps cheaper; 0: not "
                         "every one; auto (default): as that many ranks on this machine would")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size (8)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=1 << 30, help="largest size (1G)")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size factor (2)")
    ap.add_argument("--algo", default=None,
                    help="a CHORUS_ALGO value to apply instead of the environment's ('' for none)")
    ap.add_argument("--unimplemented", action="store_true",
                    help="also consider algorithms this build does not implement (model only)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)

    n = args.nranks
    k = n if args.ranks_per_host is None else args.ranks_per_host
    if n < 1:
        ap.error(f"--nranks must be >= 1, got {n}")
    if k < 1 or k > n:
        ap.error(f"--ranks-per-host must be between 1 and --nranks ({n}), got {k}")
    if args.minbytes > args.maxbytes:
        ap.error(f"-b ({args.minbytes}) is larger than -e ({args.maxbytes})")
    if not args.stepfactor > 1:
        ap.error(f"-f must be > 1, got {args.stepfactor}")
    colls = COLLECTIVES if args.collective == "all" else [args.collective]

    rows, spin = [], False
    try:
        for c in colls:
            for b in ([0] if c == "barrier" else sizes(args.minbytes, args.maxbytes, args.stepfactor)):
                p = plan(c, b, n, k, bool(args.shm), args.algo, args.unimplemented,
                         None if args.spin == "auto" else args.spin == "1")
                spin = p["spin"]
                others = [x for x in p["candidates"] if x["algo"] != p["algo"]]
                rows.append(dict(collective=c, bytes=b, algo=p["algo"],
                                 predicted_us=p["predicted_us"], forced=p["forced"],
                                 fell_back=p["fell_back"],
                                 runner_up=others[0]["algo"] if others else None,
                                 runner_up_us=others[0]["predicted_us"] if others else None,
                                 candidates=p["candidates"], nhosts=p["nhosts"]))
    except ValueError as e:
        print(f"chorus.tune: {e}", file=sys.stderr)
        return 2

    nhosts = -(-n // k)
    last = n - (nhosts - 1) * k
    if args.json:
        print(json.dumps(dict(nranks=n, ranks_per_host=k, nhosts=nhosts, last_host=last,
                              shm=bool(args.shm), spin=spin, unimplemented=args.unimplemented,
                              results=rows), indent=1))
        return 0
    layout = f"{nhosts} host{'s' if nhosts > 1 else ''} of {k}"
    if last != k:
        layout += f" (the last holds {last})"
    spins = "every engine spins" if spin else "not every engine spins"
    if args.spin == "auto":
        spins += " (auto: as on this machine)"
    print(f"# {n} ranks on {layout}, intra-host {'shm' if args.shm else 'socket'}, {spins}"
          f"{'; with unimplemented algorithms (model only)' if args.unimplemented else ''}")
    print(f"# {'collective':<15} {'bytes':>13}  {'algorithm':<9} {'predicted_us':>13}  "
          f"{'runner-up':<9} {'predicted_us':>13}")
    for r in rows:
        mark = " [CHORUS_ALGO]" if r["forced"] else (" [CHORUS_ALGO cannot run: tuner]"
                                                       if r["fell_back"] else "")
        print(f"  {r['collective']:<15} {r['bytes']:>13}  {r['algo']:<9} "
              f"{_fmt_us(r['predicted_us']):>13}  {r['runner_up'] or '-':<9} "
              f"{_fmt_us(r['runner_up_us']):>13}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
