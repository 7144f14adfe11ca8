"""tools/op_timeline.py - where the time of small back-to-back collectives goes, per rank,
from Chorus's flight recorder (docs/PERFORMANCE.md quotes it).

    python tools/op_timeline.py --nproc 4 --ops broadcast,all_reduce --bytes 8 -n 2000

Each rank launches -n calls of each op (async_op=True, after 50 warm-up calls and a
barrier), waits for them, and writes its flight record; then, per op and rank, over the
timed calls:
  launch   interval between two calls' queueing (the caller's Python and binding cost)
  start    interval between two calls' start on the engine (the rate actually reached)
  run      a call's start to its end (its own work plus waiting for the peers)
  gap      a call's end to the next one's start (completion and hand-off)
as p10 / median / p90 in microseconds, and 'us/op' = the rank's wall time per call.

Ops: broadcast (root 0), broadcast_r1 (root 1), all_reduce, all_gather (out-of-place),
all_gather_ip (in place: the input is the rank's slot of the output). --bytes is each
rank's contribution. Ranks start in one session (torch.multiprocessing); --sessions gives
each its own, as torchrun and `chorus.bench --nproc` do."""
import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

OPS = ("broadcast", "broadcast_r1", "all_reduce", "all_gather", "all_gather_ip")


def _call(dist, op, t, big, rank):
    if op == "broadcast":
        return dist.broadcast(t, 0, async_op=True)
    if op == "broadcast_r1":
        return dist.broadcast(t, 1, async_op=True)
    if op == "all_reduce":
        return dist.all_reduce(t, async_op=True)
    if op == "all_gather":
        return dist.all_gather_into_tensor(big, t, async_op=True)
    return dist.all_gather_into_tensor(big, big.narrow(0, rank * t.numel(), t.numel()),
                                       async_op=True)


def _rank(rank, world, args, port, outdir):
    if args.sessions:
        os.setsid()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    import chorus

    dist.init_process_group("chorus", rank=rank, world_size=world)
    t = torch.zeros(max(1, args.bytes // 4))
    big = torch.zeros(world * t.numel())
    for op in args.ops:
        for _ in range(50):
            _call(dist, op, t, big, rank).wait()
        dist.barrier()
        t0 = time.perf_counter()
        works = [_call(dist, op, t, big, rank) for _ in range(args.n)]
        for w in works:
            w.wait()
        per = (time.perf_counter() - t0) / args.n * 1e6
        d = os.path.join(outdir, op)
        os.makedirs(d, exist_ok=True)
        chorus.dump_trace(dist.group.WORLD, d)
        with open(os.path.join(d, f"wall.{rank}"), "w") as f:
            f.write(f"{per:.3f}\n")
        dist.barrier()
    dist.destroy_process_group()


def _stats(xs):
    ys = sorted(xs)
    k = len(ys)
    p10, med, p90 = ys[k // 10], statistics.median(ys), ys[9 * k // 10]
    return f"{p10 / 1e3:7.2f} {med / 1e3:7.2f} {p90 / 1e3:7.2f}"


def report(outdir, ops, n):
    print("op             rank   us/op | launch p10/med/p90      | start p10/med/p90       |"
          " run p10/med/p90         | gap p10/med/p90")
    for op in ops:
        d = os.path.join(outdir, op)
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            with open(path) as f:
                rec = json.load(f)
            es = [e for e in rec["entries"] if e.get("op") != "barrier"][-n:]
            rank = rec.get("rank", "?")
            q = [e["queued_ns"] for e in es]
            s = [e["started_ns"] for e in es]
            en = [e["ended_ns"] for e in es]
            m = len(es)
            with open(os.path.join(d, f"wall.{rank}")) as f:
                wall = float(f.read())
            print(f"{op:14s} {rank!s:>4s} {wall:7.2f} | "
                  f"{_stats([q[i + 1] - q[i] for i in range(m - 1)])} | "
                  f"{_stats([s[i + 1] - s[i] for i in range(m - 1)])} | "
                  f"{_stats([en[i] - s[i] for i in range(m)])} | "
                  f"{_stats([s[i + 1] - en[i] for i in range(m - 1)])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--ops", default="broadcast,all_reduce")
    ap.add_argument("--bytes", type=int, default=8)
    ap.add_argument("-n", type=int, default=2000)
    ap.add_argument("--sessions", action="store_true",
                    help="each rank in a session of its own (as torchrun)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep the flight records here")
    args = ap.parse_args(argv)
    args.ops = args.ops.split(",")
    bad = [o for o in args.ops if o not in OPS]
    if bad or args.nproc < 2 or args.n < 10:
        ap.error(f"ops from {','.join(OPS)}; --nproc >= 2; -n >= 10")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["CHORUS_TRACE_BUFFER_SIZE"] = str(args.n + 500)
    outdir = args.keep or tempfile.mkdtemp(prefix="op_timeline.")
    import torch.multiprocessing as mp
    from chorus.bench import free_port

    mp.spawn(_rank, args=(args.nproc, args, free_port(), outdir), nprocs=args.nproc)
    report(outdir, args.ops, args.n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
