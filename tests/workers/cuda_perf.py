"""Rank worker: timings of all_reduce on CUDA tensors, all ranks on one GPU.

  cuda_perf.py hostfree
      a synchronous all_reduce behind ~100 ms of GPU work (first and later device op): the
      time until it returned to Python against the GPU's; the result checked.

  cuda_perf.py latency [--iters 1000] [--loop 10000]
      float32 all_reduce of 8 B to 64 KiB: per size, ITERS back-to-back ops between two CUDA
      events on the caller's stream (after warm-up), time per op; then one loop of LOOP
      all_reduces of 8 B whose wall time is reported (a stall shows up as a huge figure, or
      as the job's timeout).
  cuda_perf.py bandwidth [--iters 20] [--warmup 5] [--max 1G]
      the device-to-device copy bandwidth (rank 0 alone, tensor.copy_ of 1 GiB, bytes read +
      written, CUDA events), then float32 all_reduce of 64 MiB .. MAX: per size, after WARMUP
      ops, the slowest rank's time per op as nccl-tests takes it (barrier, a host timer around
      ITERS ops issued back to back with async_op=True, all waited for, the GPU synchronised:
      "ms"), and the same for ITERS synchronous calls in a loop ("sync_ms"); and the HBM
      traffic the path moves (docs/PERFORMANCE.md), N ranks of S bytes each:
        shared GPU (the default with every rank on one GPU): one kernel reads every rank's
          input once and writes every rank's output once: 2 N S bytes, the least any
          all_reduce of N separate buffers can move.
        scratch (CHORUS_CUDA_SAME_GPU=0), two-shot over CUDA IPC: every rank copies S into
          its scratch (S read + S written), reduces its slice of all N scratches (S read, S/N
          written) and copies the N reduced slices out (S read + S written): (5 N + 1) S.

Every result is checked (exact, integers in float32). Rank 0 prints one line
"RESULT {json}" per measurement.
"""
import argparse
import faulthandler
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import allreduce_behind_sleep, init_dist  # noqa: E402


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def report(rank, **kw):
    if rank == 0:
        print("RESULT " + json.dumps(kw), flush=True)


def slowest(value):
    """The largest value over all ranks (through the CPU path of the same group)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn, iters, together=True):
    """Mean ms per call of iters calls of fn, timed with CUDA events on the current stream,
    from an idle GPU; with together, every rank starts at once (barrier)."""
    torch.cuda.synchronize()
    if together:
        dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def host_timed(issue, iters):
    """nccl-tests' timing: every rank starts together (barrier), a host timer around the ops
    issue() queues, every one waited for and the GPU synchronised; ms per op."""
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.monotonic()
    for w in issue():
        if w is not None:
            w.wait()
    torch.cuda.synchronize()
    return (time.monotonic() - t0) * 1e3 / iters


def latency(rank, world, dev, args):
    for size in (8, 64, 512, 4 << 10, 32 << 10, 64 << 10):
        n = size // 4
        t = torch.full((n,), float(rank + 1), device=dev)
        for _ in range(50):
            dist.all_reduce(t)
        t.fill_(float(rank + 1))
        ms = timed(lambda: dist.all_reduce(t), args.iters)
        # After ITERS sums of sums, the value grows as world^iters: check one op instead.
        t.fill_(float(rank + 1))
        dist.all_reduce(t)
        torch.cuda.synchronize()
        ok = bool((t == world * (world + 1) / 2).all())
        us = slowest(ms * 1e3)
        report(rank, test="latency", bytes=size, ranks=world, ops=args.iters, us_per_op=us,
               correct=ok)
        if not ok:
            raise SystemExit(f"wrong all_reduce result at {size} bytes")
    # the long loop: LOOP ops of 8 B on one tensor, each adding 1 per rank to zeros
    t = torch.zeros(2, device=dev)
    one = torch.ones(2, device=dev)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.monotonic()
    for _ in range(args.loop):
        t.copy_(one)
        dist.all_reduce(t)
    torch.cuda.synchronize()
    wall = slowest(time.monotonic() - t0)
    ok = bool((t == world).all())
    report(rank, test="loop", ops=args.loop, ranks=world, wall_s=wall,
           us_per_op=wall / args.loop * 1e6, correct=ok)
    if not ok:
        raise SystemExit("wrong result after the long loop")


def bandwidth(rank, world, dev, args):
    copy_gbs = 0.0
    if rank == 0:
        n = (1 << 30) // 4
        a, b = torch.empty(n, device=dev), torch.ones(n, device=dev)
        best = min(timed(lambda: a.copy_(b), 3, together=False) for _ in range(5))
        copy_gbs = 2 * (1 << 30) / (best * 1e-3) / 1e9
        del a, b
        torch.cuda.empty_cache()
    dist.barrier()
    copy_gbs = slowest(copy_gbs)
    report(rank, test="copy", bytes=1 << 30, gbps=copy_gbs)
    size = 64 << 20
    while size <= args.max:
        n = size // 4
        t = torch.full((n,), float(rank + 1), device=dev)
        for _ in range(args.warmup):
            dist.all_reduce(t)
        # nccl-tests' timing: barrier, a host timer around ITERS back-to-back ops, synchronize;
        # and a loop of synchronous calls, each waited for before the next is issued. Each is
        # run REPEATS times and the best run (the slowest rank's time) is kept: four processes
        # time-slice the one GPU, and one run can lose a scheduling slice to the others (an
        # H100 run measured 0.48 of copy at 64 MiB where the runs before gave 0.82).
        runs = [slowest(host_timed(
            lambda: [dist.all_reduce(t, async_op=True) for _ in range(args.iters)], args.iters))
            for _ in range(args.repeats)]
        sync_runs = [slowest(host_timed(lambda: [dist.all_reduce(t) for _ in range(args.iters)],
                                        args.iters)) for _ in range(args.repeats)]
        ms, sync_ms = min(runs), min(sync_runs)
        t.fill_(float(rank + 1))
        dist.all_reduce(t)
        torch.cuda.synchronize()
        ok = bool((t == world * (world + 1) / 2).all())
        shared = os.environ.get("CHORUS_CUDA_SAME_GPU", "1") != "0"
        traffic = (2 * world if shared else 5 * world + 1) * size
        hbm = traffic / (ms * 1e-3) / 1e9
        report(rank, test="allreduce_bw", bytes=size, ranks=world, ms=ms,
               algbw_gbps=size / (ms * 1e-3) / 1e9,
               busbw_gbps=size / (ms * 1e-3) / 1e9 * 2 * (world - 1) / world,
               path="shared GPU" if shared else "scratch two-shot",
               traffic_bytes=traffic, hbm_gbps=hbm, of_copy=hbm / copy_gbs,
               runs_ms=runs, sync_ms=sync_ms, sync_runs_ms=sync_runs, sync_of_copy=traffic / (sync_ms * 1e-3) / 1e9 / copy_gbs,
               correct=ok)
        if not ok:
            raise SystemExit(f"wrong all_reduce result at {size} bytes")
        del t
        torch.cuda.empty_cache()
        size *= 2


def hostfree(rank, world, dev, args):
    """A plain (synchronous) all_reduce issued behind ~100 ms of GPU work: the time until it
    returns to Python, and whether the result is right once the GPU gets there. First as the
    group's very first device collective (it also sets up the CUDA state), then again."""
    for which in ("first", "later"):
        dist.barrier()
        host_s, gpu_s, ok = allreduce_behind_sleep(rank, world, dev)
        report(rank, test="hostfree", which=which, ranks=world, host_ms=slowest(host_s * 1e3),
               gpu_ms=slowest(gpu_s * 1e3), correct=ok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("latency", "bandwidth", "hostfree"))
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loop", type=int, default=10000)
    ap.add_argument("--max", type=parse_size, default=1 << 30)
    args = ap.parse_args()
    if args.iters is None:
        args.iters = 1000 if args.mode == "latency" else 20
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # gpu_check.sh hang: stacks
    # torchrun's recipe: the device first, the group bound to it (chorus then loads its
    # kernels at group creation, before any GPU work: docs/design.md, CUDA path)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    rank, world = init_dist(device_id=dev)
    {"latency": latency, "bandwidth": bandwidth, "hostfree": hostfree}[args.mode](
        rank, world, dev, args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
