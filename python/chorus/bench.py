"""Collective benchmark in the style of nccl-tests, for any torch.distributed backend.

Runs under torchrun (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or
standalone with --nproc N, which starts N local ranks itself (rendezvous on 127.0.0.1, a free
port) and exits nonzero if any of them fails.

  python -m chorus.bench --nproc 4 -o all_reduce -b 8 -e 16M -f 4 --compare gloo
  torchrun --nproc-per-node 4 -m chorus.bench -o all_gather -d bfloat16

Rank 0 prints a header first: world size, backend(s), device, dtype, the host's CPU count,
and "memcpy (1 core)": torch copy_ between two preallocated 64 MiB CPU tensors on one thread
(torch.set_num_threads(1)), best of 5, in GB/s counting the bytes once, measured in the same
run as a yardstick for the bandwidths below. Then one table per op.

Sizes (as nccl-tests): the size column is the total bytes of the largest buffer of the
collective; count is the count argument NCCL would be given.
  all_reduce, broadcast, reduce, sendrecv: size = count x elemsize.
  all_gather:     size = output bytes = nranks x count x elemsize (count = per-rank input).
  reduce_scatter: size = input bytes  = nranks x count x elemsize (count = per-rank output).
  alltoall:       size = input bytes  = nranks x count x elemsize (count = per-peer chunk).
Sizes are rounded down to that granularity (at least one granule); the header says so.
algbw = size / time (GB = 1e9 bytes); busbw = algbw x factor: all_reduce 2(n-1)/n,
all_gather, reduce_scatter, alltoall (n-1)/n; broadcast, reduce, sendrecv 1.

Timing (as nccl-tests): per size, warmup ops, a barrier (on a separate gloo control group)
and one untimed one-element all_reduce on the measured backend (which lines the ranks up),
then -n ops launched back-to-back (async_op=True), all waited (and torch.cuda.synchronize()),
time = elapsed / n. With -z 1 (nccl-tests' --blocking) each op is waited (and the device
synchronized) before the next is launched: the latency a blocking caller sees. The row
shows the maximum over ranks (-a changes that: 0 rank 0, 1 mean, 2 min, 3 max; nccl-tests'
default is the mean).

Out-of-place / in-place: all_gather, reduce_scatter, alltoall and sendrecv have true
out-of-place forms. torch.distributed has only in-place all_reduce, broadcast and reduce:
their out-of-place half times copy_ of the input into an output buffer followed by the
in-place call (what an out-of-place caller pays). The output buffers rotate: one per call
of the loop within 4 MiB, at least two, so that a copy never overwrites a buffer still in
flight and small calls queue back to back as in the in-place half (as a DDP caller's
gradient buckets, distinct buffers, do). Broadcast's root sends from its input and copies
the input into its output while the call is in flight, since the root has nothing to
receive. The same code runs for every backend of a --compare. In-place
all_gather takes its input from its slot of the output, in-place reduce_scatter writes into
its slot of the input (the FSDP/DeepSpeed layouts). In-place alltoall and sendrecv show
n/a: torch.distributed leaves an aliased send and receive buffer undefined.

Check (-c 1): every input is a deterministic per-rank pattern of small integers (products:
powers of two), so results are exact for every dtype except avg's final division; each size
and half runs one extra op on freshly filled buffers (outputs poisoned first), outside the
timed loop, and every rank counts the elements that differ from the reference it computes
itself (floats within a dtype tolerance; reduce: the root only). #wrong is the sum over
ranks. Exit codes: 0 ok, 3 a wrong element (any backend), 1 an error or a failed rank,
2 bad usage.

--compare BACKEND runs the same sweep on a second process group of that backend, in the
same job, interleaved per size (size s on the main backend, then on the peer, then size
s+1...). Rows then start with a backend column and the main backend's rows get a speed-up
column per half (peer time / main time); a summary gives the minimum and geometric mean.
An op or half the peer rejects is shown n/a (noted) instead of failing the run.

--json FILE writes one JSON list with a record per row: per backend, size and half actually
measured, each with exactly the fields op, backend, bytes, count, dtype, redop, inplace,
time_us, algbw_gbps, busbw_gbps, wrong (wrong is null with -c 0; redop is null for ops
without one). The memcpy figure is not a row: it is in the header only.

Progress: rank 0 writes "bench: OP i/N sizes, T s" to stderr, redrawn in place (\\r) when
stderr is a terminal and the run has gone on for 2 s, else as a plain line then and every
10 s after.
"""
import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

PROG = "python -m chorus.bench"
# Set in the ranks that --nproc starts (holds a marker of the launcher); a rank ignores --nproc.
CHILD_ENV = "_CHORUS_BENCH_CHILD"
# Test-only hooks, for tests/test_bench.py and nothing else: not options, not documented in
# --help. CORRUPT=1 changes one element of the main backend's checked output after the
# collective (so #wrong must be > 0); FAIL_RANK=r makes rank r exit(7) right after init.
TEST_CORRUPT_ENV = "_CHORUS_BENCH_TEST_CORRUPT"
TEST_FAIL_RANK_ENV = "_CHORUS_BENCH_TEST_FAIL_RANK"

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall",
       "sendrecv")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")
# Ops torch.distributed only offers in place: out-of-place = copy_ + the in-place call.
EMULATED_OOP = ("all_reduce", "broadcast", "reduce")
NO_INPLACE = ("alltoall", "sendrecv")

DTYPES = {  # nccl-tests names first, then aliases
    "float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
    "double": torch.float64, "int32": torch.int32, "int64": torch.int64, "int8": torch.int8,
    "uint8": torch.uint8, "f8e4m3": torch.float8_e4m3fn, "f8e5m2": torch.float8_e5m2,
}
DTYPE_ALIASES = {"float32": "float", "float16": "half", "fp16": "half", "bf16": "bfloat16",
                 "float64": "double", "int": "int32", "float8_e4m3fn": "f8e4m3",
                 "fp8_e4m3": "f8e4m3", "float8_e5m2": "f8e5m2", "fp8_e5m2": "f8e5m2"}
REDOPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
          "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
# Relative tolerance of the check per float dtype (data are exact; only avg divides).
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 2e-3,
             torch.bfloat16: 1.6e-2,
             # float8: one ulp (sums of the pattern exceed what the format holds exactly;
             # a peer that rounds at every step of a ring stays within it on a few ranks)
             torch.float8_e4m3fn: 0.125, torch.float8_e5m2: 0.25}
AVERAGE_NAMES = {0: "rank 0", 1: "mean over ranks", 2: "min over ranks", 3: "max over ranks"}
MEMCPY_BYTES = 64 << 20
EXIT_USAGE, EXIT_ERROR, EXIT_WRONG = 2, 1, 3
# Newer torch renames the tensor forms (the old names warn); same arguments.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class UsageError(Exception):
    pass


class BenchError(Exception):
    pass


# ------------------------------------------------------------------ command line
def parse_size(text):
    """Bytes from '8', '64K', '16M', '1G' (K = 1024, as nccl-tests)."""
    t = str(text).strip().upper()
    if t.endswith("B"):
        t = t[:-1]
    mult = 1
    if t and t[-1] in "KMGT":
        mult = 1024 ** ("KMGT".index(t[-1]) + 1)
        t = t[:-1]
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 16M, 1G)")
    if v < 0 or v != v:
        raise argparse.ArgumentTypeError(f"size must be >= 0: {text!r}")
    return int(v * mult)


def parse_ops(text):
    names = [s.strip() for s in str(text).split(",") if s.strip()]
    if names == ["all"]:
        return list(OPS)
    for n in names:
        if n not in OPS:
            raise argparse.ArgumentTypeError(
                f"unknown op {n!r}; choose from {', '.join(OPS)} (comma list) or all")
    if not names:
        raise argparse.ArgumentTypeError("no op given")
    return names


def parse_dtype(text):
    t = str(text).strip().lower()
    t = DTYPE_ALIASES.get(t, t)
    if t not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown datatype {text!r}; choose from {', '.join(DTYPES)}")
    return t


def build_parser():
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-o", "--op", type=parse_ops, default=["all_reduce"], metavar="OP",
                    help="collective: " + ", ".join(OPS) + "; a comma list, or all "
                    "(default all_reduce)")
    ap.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), metavar="SIZE",
                    help="smallest size, K/M/G suffixes (default 8)")
    ap.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"),
                    metavar="SIZE", help="largest size (default 32M)")
    ap.add_argument("-f", "--stepfactor", type=float, default=None, metavar="F",
                    help="multiply the size by F between steps (default 2 unless -i is given)")
    ap.add_argument("-i", "--stepbytes", type=parse_size, default=None, metavar="SIZE",
                    help="add SIZE between steps instead of multiplying")
    ap.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    ap.add_argument("-w", "--warmup_iters", type=int, default=5,
                    help="untimed warm-up iterations per size (default 5)")
    ap.add_argument("-z", "--blocking", type=int, default=0, choices=(0, 1),
                    help="1: wait for each op before launching the next, as a blocking "
                    "caller does (default 0: back-to-back)")
    ap.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                    help="1: check results and report #wrong (default 1)")
    ap.add_argument("-d", "--datatype", type=parse_dtype, default="float", metavar="TYPE",
                    help="element type: " + ", ".join(DTYPES) + " (default float)")
    ap.add_argument("--redop", choices=tuple(REDOPS), default="sum",
                    help="reduction of all_reduce, reduce_scatter, reduce (default sum); "
                    "nccl-tests calls this -o, which here is the collective")
    ap.add_argument("-r", "--root", type=int, default=0,
                    help="root rank of broadcast and reduce (default 0)")
    ap.add_argument("-a", "--average", type=int, default=3, choices=(0, 1, 2, 3),
                    help="time reported: 0 rank 0, 1 mean, 2 min, 3 max over ranks "
                    "(default 3; nccl-tests defaults to 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="tensor device; cuda uses cuda:(LOCAL_RANK %% device count) "
                    "(default cpu)")
    ap.add_argument("--backend", default="chorus",
                    help="torch.distributed backend to measure (default chorus)")
    ap.add_argument("--compare", default=None, metavar="BACKEND",
                    help="also run the sweep on BACKEND (gloo; nccl for cuda) in the same job "
                    "and add speed-up columns (peer time / main time)")
    ap.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="start N local ranks (127.0.0.1, free port) instead of reading "
                    "torchrun's environment; sets OMP_NUM_THREADS=1 where unset, as torchrun")
    ap.add_argument("--same-session", action="store_true",
                    help="with --nproc: start the ranks in this launcher's session (each in a "
                    "process group of its own) instead of one session each as torchrun does; "
                    "where the kernel schedules by session (sched_autogroup_enabled), this "
                    "changes how ranks that outnumber the cores share them (a diagnostic: "
                    "the bars use the default)")
    ap.add_argument("--kill-after", type=float, default=10.0, metavar="S",
                    help="with --nproc: seconds the other ranks get to exit by themselves "
                    "after one fails, before they are killed (default 10)")
    ap.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="process-group timeout in seconds (default 300)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the results as one JSON list of records (see above)")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="draw busbw and time against size, log-log, per backend "
                    "(needs matplotlib)")
    return ap


def _backend_problem(name, device):
    """Why torch.distributed cannot run backend `name` on `device` here, or None."""
    if name is None:
        return None
    if name == "nccl":
        if not dist.is_nccl_available():
            return "this torch build has no NCCL (a CPU-only build?)"
        if device != "cuda":
            return "NCCL moves CUDA tensors only: add --device cuda"
    if name == "gloo" and not dist.is_gloo_available():
        return "this torch build has no Gloo"
    if name == "mpi" and not dist.is_mpi_available():
        return "this torch build has no MPI"
    return None


def validate(args):
    """Checks that need no process group; the same on every rank. Raises UsageError."""
    if args.minbytes > args.maxbytes:
        raise UsageError(f"-b/--minbytes ({args.minbytes}) is larger than -e/--maxbytes "
                         f"({args.maxbytes})")
    if args.maxbytes <= 0:
        raise UsageError("-e/--maxbytes must be > 0")
    if args.stepfactor is not None and args.stepbytes is not None:
        raise UsageError("give -f/--stepfactor or -i/--stepbytes, not both")
    if args.stepbytes is not None and args.stepbytes <= 0:
        raise UsageError("-i/--stepbytes must be > 0")
    if args.stepfactor is None and args.stepbytes is None:
        args.stepfactor = 2.0
    if args.stepfactor is not None and args.stepfactor <= 1 and args.minbytes != args.maxbytes:
        raise UsageError(f"-f/--stepfactor must be > 1 (got {args.stepfactor:g})")
    if args.iters < 1:
        raise UsageError("-n/--iters must be >= 1")
    if args.warmup_iters < 0:
        raise UsageError("-w/--warmup_iters must be >= 0")
    if args.nproc is not None and args.nproc < 1:
        raise UsageError("--nproc must be >= 1")
    if args.same_session and not args.nproc:
        raise UsageError("--same-session applies only to ranks started with --nproc")
    world = args.nproc or int(os.environ.get("WORLD_SIZE", "0") or 0)
    if world and not 0 <= args.root < world:
        raise UsageError(f"-r/--root {args.root} is not a rank of {world}")
    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    dt = DTYPES[args.datatype]
    if args.redop == "avg" and not dt.is_floating_point and any(o in REDUCING for o in args.op):
        raise UsageError(f"--redop avg is only defined here for floating types, not "
                         f"{args.datatype} (backends disagree on integer averages)")
    if args.compare is not None and args.compare == args.backend:
        raise UsageError(f"--compare {args.compare} is the backend under test already")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device")
    for flag, name in (("--backend", args.backend), ("--compare", args.compare)):
        problem = _backend_problem(name, args.device)
        if problem:
            raise UsageError(f"{flag} {name}: {problem}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise UsageError(f"--plot needs matplotlib, which cannot be imported here ({e}); "
                             "install it (pip install matplotlib) or drop --plot")
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot writes a PNG: give a FILE.png, not {args.plot!r}")


def size_steps(args):
    sizes, s = [], args.minbytes
    while s <= args.maxbytes:
        sizes.append(s)
        if args.stepbytes is not None:
            s += args.stepbytes
        else:
            nxt = int(s * args.stepfactor)
            if s == 0:
                nxt = 1
            if nxt <= s:
                break  # -b == -e with -f 1, or a factor too small to make progress
            s = nxt
    return sizes


# ------------------------------------------------------------------ per-op facts
def bus_factor(op, n):
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def granule(op, n):
    """Elements the total size must be a multiple of."""
    return n if op in ("all_gather", "reduce_scatter", "alltoall") else 1


def plan_sizes(op, args, n, esize):
    """[(bytes, count)] after rounding, deduplicated, and a note if anything was rounded."""
    g = granule(op, n) * esize
    out, rounded = [], False
    for s in size_steps(args):
        r = max(g, (s // g) * g)
        rounded |= r != s
        if not out or out[-1][0] != r:
            out.append((r, r // esize // granule(op, n)))
    note = None
    if rounded:
        what = (f"{n} ranks x {esize} B" if granule(op, n) > 1 else f"{esize} B elements")
        note = (f"{op}: sizes rounded down to a multiple of {g} B ({what}), at least {g} B, "
                "as nccl-tests does")
    return out, note


def lengths(op, c, n):
    """(input elements, output elements) of one rank."""
    return {"all_reduce": (c, c), "broadcast": (c, c), "reduce": (c, c), "sendrecv": (c, c),
            "all_gather": (c, n * c), "reduce_scatter": (n * c, c),
            "alltoall": (n * c, n * c)}[op]


# ------------------------------------------------------------------ data and reference
_PROD_FLOAT = (1.0, -1.0, 2.0, 0.5, 1.0, -2.0, 1.0, 0.5)
_PROD_SIGNED = (1, -1, 2, 1, -2, 1, 1, -1)
_PROD_UNSIGNED = (1, 2, 1, 3, 1, 1, 2, 1)


def pattern(rank, start, length, dt, redop):
    """Rank's input elements [start, start+length): small integers (prod: +-powers of two,
    unsigned: small positive), exact in every dtype; float64/int64 for the reference."""
    idx = torch.arange(start, start + length, dtype=torch.int64)
    wide = torch.float64 if dt.is_floating_point else torch.int64
    if redop == "prod":
        table = _PROD_FLOAT if dt.is_floating_point else (
            _PROD_UNSIGNED if dt == torch.uint8 else _PROD_SIGNED)
        return torch.tensor(table, dtype=wide)[(idx + 3 * rank) % len(table)]
    v = (idx * 7 + rank * 13) % 17
    if dt != torch.uint8:
        v = v - 8
    return v.to(wide)


def reduce_wide(vals, redop, n):
    acc = vals[0].clone()
    for v in vals[1:]:
        if redop in ("sum", "avg"):
            acc += v
        elif redop == "prod":
            acc *= v
        elif redop == "min":
            acc = torch.minimum(acc, v)
        else:
            acc = torch.maximum(acc, v)
    if redop == "avg":
        acc = acc / n
    return acc


def poison_value(dt):
    return float("nan") if dt.is_floating_point else (201 if dt == torch.uint8 else -77)


def count_wrong(got, expected_wide, dt):
    """Elements of got (any device, dtype dt) that differ from the reference."""
    g = got.detach().to("cpu")
    exp = expected_wide.to(dt)  # the reference rounded (or wrapped) the way the dtype stores it
    if dt.is_floating_point:
        e = exp.double()
        ok = (g.double() - e).abs() <= TOLERANCE[dt] * e.abs().clamp(min=1.0)
        return int((~ok).sum())
    return int((g != exp).sum())


# ------------------------------------------------------------------ one op on one group
class Runner:
    """Launches one op (one half) on a group over preallocated buffers; start(k) launches
    iteration k without waiting, drain() waits for everything launched."""

    def __init__(self, op, inplace, group, bufs, ctx):
        self.op, self.inplace, self.group, self.b, self.ctx = op, inplace, group, bufs, ctx
        self.works = []
        self.pending = [None] * len(bufs.out)  # emulated out-of-place: work per output buffer
        self.align = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        # In-place views, made once: narrow() costs microseconds of Python per call, which
        # nccl-tests' in-place pointers do not (both backends get the same views).
        r, c = ctx.rank, bufs.count
        self.ag_src = bufs.out[0].narrow(0, r * c, c) if op == "all_gather" else None
        self.rs_out = (bufs.ipbuf.narrow(0, r * c, c)
                       if op == "reduce_scatter" and bufs.ipbuf is not None else None)

    def _collect(self, w):
        if w is None:
            return
        if isinstance(w, (list, tuple)):
            self.works.extend(x for x in w if x is not None)
        else:
            self.works.append(w)

    def _inplace_call(self, buf):
        op, g, ctx = self.op, self.group, self.ctx
        if op == "all_reduce":
            return dist.all_reduce(buf, op=ctx.redop, group=g, async_op=True)
        if op == "broadcast":
            return dist.broadcast(buf, src=ctx.root, group=g, async_op=True)
        return dist.reduce(buf, dst=ctx.root, op=ctx.redop, group=g, async_op=True)

    def start(self, k):
        op, g, b, ctx = self.op, self.group, self.b, self.ctx
        r, n, c = ctx.rank, ctx.world, b.count
        if op in EMULATED_OOP:
            if self.inplace:
                self._collect(self._inplace_call(b.out[0]))
                return
            j = k % len(b.out)
            if self.pending[j] is not None:
                self.pending[j].wait()
                self.pending[j] = None
            buf = b.out[j]
            if op == "broadcast" and r == ctx.root:
                # The root's data is its input: send from it and copy it into the
                # output while the broadcast is in flight (nccl-tests' out-of-place
                # broadcast also leaves the root's recvbuff a copy of its sendbuff).
                w = dist.broadcast(b.inp, src=ctx.root, group=g, async_op=True)
                buf.copy_(b.inp)
                self.pending[j] = w
                return
            if op != "broadcast":
                buf.copy_(b.inp)
            self.pending[j] = self._inplace_call(buf)
            return
        if op == "all_gather":
            out = b.out[0]
            src = self.ag_src if self.inplace else b.inp
            self._collect(_ALL_GATHER(out, src, group=g, async_op=True))
        elif op == "reduce_scatter":
            if self.inplace:
                self._collect(_REDUCE_SCATTER(self.rs_out, b.ipbuf,
                                              op=ctx.redop, group=g, async_op=True))
            else:
                self._collect(_REDUCE_SCATTER(b.out[0], b.inp, op=ctx.redop, group=g,
                                              async_op=True))
        elif op == "alltoall":
            self._collect(dist.all_to_all_single(b.out[0], b.inp, group=g, async_op=True))
        elif op == "sendrecv":
            ops = [dist.P2POp(dist.isend, b.inp, (r + 1) % n, g),
                   dist.P2POp(dist.irecv, b.out[0], (r - 1) % n, g)]
            self._collect(dist.batch_isend_irecv(ops))
        else:
            raise AssertionError(op)

    def drain(self):
        for w in self.works:
            w.wait()
        self.works = []
        for j, w in enumerate(self.pending):
            if w is not None:
                w.wait()
                self.pending[j] = None
        if self.ctx.cuda:
            torch.cuda.synchronize()

    # -- check
    def result_view(self):
        """The tensor this rank's result lands in for iteration 0, or None if unchecked."""
        op, b, ctx = self.op, self.b, self.ctx
        if op == "reduce" and ctx.rank != ctx.root:
            return None
        if op == "reduce_scatter" and self.inplace:
            return b.ipbuf.narrow(0, ctx.rank * b.count, b.count)
        return b.out[0]

    def fill_for_check(self):
        op, b, ctx = self.op, self.b, self.ctx
        r, n, c, dt = ctx.rank, ctx.world, b.count, ctx.dtype
        pat = lambda q, s, ln: pattern(q, s, ln, dt, ctx.redop_name).to(dt)  # noqa: E731
        for t in b.out:
            t.fill_(poison_value(dt))
        if b.ipbuf is not None:
            b.ipbuf.fill_(poison_value(dt))
        own = pat(r, 0, b.inp.numel())
        if op == "broadcast":
            own = pat(ctx.root, 0, c)
        b.inp.copy_(own)
        if self.inplace:
            if op in ("all_reduce", "reduce"):
                b.out[0].copy_(own)
            elif op == "broadcast" and r == ctx.root:
                b.out[0].copy_(own)
            elif op == "all_gather":
                b.out[0].narrow(0, r * c, c).copy_(own)
            elif op == "reduce_scatter":
                b.ipbuf.copy_(own)

    def check_once(self, expected, corrupt):
        """Fills, runs iteration 0, returns this rank's wrong-element count."""
        self.fill_for_check()
        self.start(0)
        self.drain()
        view = self.result_view()
        if view is None:
            return 0
        if corrupt:
            view.view(-1)[0] = poison_value(self.ctx.dtype)
        return count_wrong(view, expected, self.ctx.dtype)


OOP_BUDGET = 4 << 20  # bytes of rotating output buffers of an emulated out-of-place half


def oop_depth(op, nbytes, ctx):
    """Output buffers of an emulated out-of-place half: as many as there are calls in a
    loop, within OOP_BUDGET bytes, and at least 2. Each call copies into a buffer no call
    in flight uses, so a caller waits only on a call that many back."""
    if op not in EMULATED_OOP:
        return 1
    calls = max(ctx.iters, ctx.warmup * 2, 2)
    return max(2, min(calls, OOP_BUDGET // max(nbytes, 1)))


class Buffers:
    def __init__(self, op, nbytes, count, ctx):
        self.nbytes, self.count = nbytes, count
        n_in, n_out = lengths(op, count, ctx.world)
        mk = lambda ln: torch.empty(ln, dtype=ctx.dtype, device=ctx.device)  # noqa: E731
        self.inp = mk(n_in)
        self.out = [mk(n_out) for _ in range(oop_depth(op, nbytes, ctx))]
        self.ipbuf = mk(n_in) if op == "reduce_scatter" else None
        for t in [self.inp, *self.out] + ([self.ipbuf] if self.ipbuf is not None else []):
            t.zero_()  # touch the pages before timing


def expected_for(op, count, ctx):
    """This rank's reference result (float64/int64), or None where nothing is checked."""
    r, n, c, rop = ctx.rank, ctx.world, count, ctx.redop_name
    dt = ctx.dtype
    if op in ("all_reduce", "reduce"):
        if op == "reduce" and r != ctx.root:
            return None
        return reduce_wide([pattern(q, 0, c, dt, rop) for q in range(n)], rop, n)
    if op == "broadcast":
        return pattern(ctx.root, 0, c, dt, rop)
    if op == "all_gather":
        return torch.cat([pattern(q, 0, c, dt, rop) for q in range(n)])
    if op == "reduce_scatter":
        return reduce_wide([pattern(q, r * c, c, dt, rop) for q in range(n)], rop, n)
    if op == "alltoall":
        return torch.cat([pattern(q, r * c, c, dt, rop) for q in range(n)])
    if op == "sendrecv":
        return pattern((r - 1) % n, 0, c, dt, rop)
    raise AssertionError(op)


# ------------------------------------------------------------------ output
def fmt_time(us):
    if us >= 10000.0:
        return f"{us:.0f}"
    if us >= 100.0:
        return f"{us:.1f}"
    return f"{us:.2f}"


class Table:
    """nccl-tests layout; with a peer backend, a leading backend column and a speed-up
    column after each half."""

    def __init__(self, compare):
        self.compare = compare
        self.lead = [("backend", "", 8)] if compare else []
        self.fixed = [("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 8),
                      ("redop", "", 6), ("root", "", 6)]
        self.half = [("time", "(us)", 8), ("algbw", "(GB/s)", 7), ("busbw", "(GB/s)", 7),
                     ("#wrong", "", 6)] + ([("speedup", "(x)", 7)] if compare else [])

    def _line(self, cells, widths):
        return "".join(" " + str(v).rjust(w) for v, w in zip(cells, widths))

    def header(self):
        left = self.lead + self.fixed
        lw = sum(w + 1 for _, _, w in left)
        hw = sum(w + 1 for _, _, w in self.half)
        cols = left + self.half + self.half
        widths = [w for _, _, w in cols]
        l1 = " " * lw + "out-of-place".center(hw) + "in-place".center(hw)
        l2 = self._line([c for c, _, _ in cols], widths)
        l3 = self._line([u for _, u, _ in cols], widths)
        return ["#" + s[1:] for s in (l1.rstrip(), l2, l3)]

    def row(self, backend, nbytes, count, tname, redop, root, halves):
        cells = ([backend] if self.compare else []) + [nbytes, count, tname, redop, root]
        for h in halves:
            if h is None:
                cells += ["n/a"] * 4 + (["-"] if self.compare else [])
                continue
            wrong = "N/A" if h["wrong"] is None else h["wrong"]
            cells += [fmt_time(h["time_us"]), f"{h['algbw_gbps']:.2f}",
                      f"{h['busbw_gbps']:.2f}", wrong]
            if self.compare:
                cells.append(f"{h['speedup']:.2f}" if h.get("speedup") is not None else "-")
        widths = [w for _, _, w in self.lead + self.fixed + self.half + self.half]
        return self._line(cells, widths)


class Progress:
    """The run's progress on rank 0's stderr once it has run for FIRST seconds: redrawn in
    place on a terminal, else (a log, a pipe) a plain line then and every EVERY seconds."""

    FIRST, EVERY = 2.0, 10.0

    def __init__(self, enabled):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0
        self.drawn = 0

    def update(self, op, i, total):
        if not self.enabled:
            return
        now = time.monotonic()
        el = now - self.t0
        if el < self.FIRST:
            return
        text = f"bench: {op} {i}/{total} sizes, {el:.0f} s"
        if self.tty:
            if now - self.last >= 0.25:
                sys.stderr.write("\r" + text.ljust(self.drawn))
                sys.stderr.flush()
                self.drawn, self.last = len(text), now
        elif not self.last or now - self.last >= self.EVERY:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self.last = now

    def done(self):
        if self.tty and self.drawn:
            sys.stderr.write("\r" + " " * self.drawn + "\r")
            sys.stderr.flush()
            self.drawn = 0


def memcpy_gbps(repeats=5):
    """Single-thread torch copy_ between two preallocated 64 MiB CPU tensors, best of
    `repeats`, bytes counted once."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(MEMCPY_BYTES, dtype=torch.uint8)
        dst = torch.zeros(MEMCPY_BYTES, dtype=torch.uint8)
        dst.copy_(src)  # fault the pages in
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return MEMCPY_BYTES / best / 1e9


def write_plot(path, records, title):
    """One row per op: busbw and time against size, log-log; a colour per backend, solid
    out-of-place, dashed in-place."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    series = {}
    for rec in records:
        series.setdefault((rec["op"], rec["backend"], rec["inplace"]), []).append(rec)
    ops = list(dict.fromkeys(k[0] for k in series))
    backends = list(dict.fromkeys(k[1] for k in series))
    fig, axes = plt.subplots(max(1, len(ops)), 2, figsize=(12, 3.8 * max(1, len(ops))),
                             squeeze=False)
    for row, op in enumerate(ops):
        ax_bw, ax_t = axes[row]
        for (sop, backend, inplace), recs in series.items():
            if sop != op:
                continue
            recs = sorted(recs, key=lambda r: r["bytes"])
            xs = [r["bytes"] for r in recs]
            kw = dict(color=f"C{backends.index(backend)}", linestyle="--" if inplace else "-",
                      marker="o", markersize=3,
                      label=f"{backend} {'in-place' if inplace else 'out-of-place'}")
            ax_bw.plot(xs, [max(r["busbw_gbps"], 1e-9) for r in recs], **kw)
            ax_t.plot(xs, [r["time_us"] for r in recs], **kw)
        for ax, yl in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (bytes)")
            ax.set_ylabel(yl)
            ax.set_title(op, fontsize=10)
            ax.minorticks_off()  # (minor log ticks cost seconds per figure)
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.75 / fig.get_figheight(),
                        bottom=0.6 / fig.get_figheight(), hspace=0.45, wspace=0.2)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------ one rank
class Ctx:
    pass


def _agree_failure(ctx, exc):
    """Every rank learns whether any rank raised (and the first message)."""
    msgs = [None] * ctx.world
    dist.all_gather_object(msgs, None if exc is None else f"{type(exc).__name__}: {exc}",
                           group=ctx.ctrl)
    for q, m in enumerate(msgs):
        if m is not None:
            return q, m.strip().splitlines()[0][:300]
    return None


def _gather_stats(ctx, values):
    """values: list of floats per rank -> tensor [world, len] on every rank."""
    t = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(ctx.world)]
    dist.all_gather(out, t, group=ctx.ctrl)
    return torch.stack(out)


def _combine_time(ctx, col):
    if ctx.average == 0:
        return float(col[0])
    if ctx.average == 1:
        return float(col.mean())
    if ctx.average == 2:
        return float(col.min())
    return float(col.max())


def measure(ctx, op, inplace, group, bufs, expected, corrupt, first=False):
    """(time_us, wrong-on-this-rank or None) for one half. first: the sweep's first size,
    which also gets the sweep-wide warm-up that nccl-tests runs before its first size
    (threads, caches and lazily made state are cold before it)."""
    runner = Runner(op, inplace, group, bufs, ctx)
    wrong = runner.check_once(expected, corrupt) if ctx.check else None
    for k in range(ctx.warmup * (2 if first else 1)):
        runner.start(k)
        if ctx.blocking:
            runner.drain()
    runner.drain()
    if ctx.cuda:
        torch.cuda.synchronize()
    dist.barrier(group=ctx.ctrl)
    # The control barrier lets ranks go tens of microseconds apart, as much as a whole timed
    # loop of a small size takes: one untimed one-element all_reduce on the measured
    # backend lines them up to within that backend's own latency before the clock starts.
    dist.all_reduce(runner.align, group=group)
    if ctx.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(ctx.iters):
        runner.start(k)
        if ctx.blocking:
            runner.drain()
    runner.drain()
    dt = time.perf_counter() - t0
    return dt / ctx.iters * 1e6, wrong


def sweep(ctx, op, args, out, records, table, progress):
    esize = torch.empty((), dtype=ctx.dtype).element_size()
    sizes, note = plan_sizes(op, args, ctx.world, esize)
    n = ctx.world
    factor = bus_factor(op, n)
    redop = ctx.redop_name if op in REDUCING else "none"
    root = ctx.root if op in ROOTED else -1
    backends = [(ctx.backend, ctx.main_group, True)]
    if ctx.peer_group is not None:
        backends.append((ctx.compare, ctx.peer_group, False))
    # (backend, inplace) -> reason it is skipped
    skipped = {}
    for be, _, _ in backends:
        if op in NO_INPLACE:
            skipped[(be, True)] = ("torch.distributed leaves an aliased send/receive buffer "
                                   "undefined")
        if op == "sendrecv" and n == 1:
            skipped[(be, False)] = "one rank has no peer to send to"
    if ctx.rank == 0:
        out(f"#\n# {op}" + (f" ({redop})" if op in REDUCING else "")
            + (f", root {root}" if op in ROOTED else "")
            + f", busbw factor {factor:.4g}")
        if note:
            out(f"# note: {note}")
        if op in EMULATED_OOP:
            out(f"# note: torch.distributed has only an in-place {op}: out-of-place = copy_ "
                "into the output + the in-place call (rotating output buffers: one per call "
                "within 4 MiB, at least two)"
                + ("; the root sends from its input and copies it meanwhile"
                   if op == "broadcast" else ""))
        if op in NO_INPLACE:
            out(f"# note: in-place {op}: n/a ({skipped[(ctx.backend, True)]})")
        if (ctx.backend, False) in skipped:
            out(f"# note: out-of-place {op}: n/a ({skipped[(ctx.backend, False)]})")
        for line in table.header():
            out(line)
    corrupt_env = os.environ.get(TEST_CORRUPT_ENV) == "1"
    bw_main, speedups = [], []
    wrong_total = {be: 0 for be, _, _ in backends}
    for i, (nbytes, count) in enumerate(sizes):
        progress.update(op, i, len(sizes))
        bufs = Buffers(op, nbytes, count, ctx)
        expected = expected_for(op, count, ctx) if ctx.check else None
        rows = {}
        for be, group, is_main in backends:
            vals = []
            for inplace in (False, True):
                if (be, inplace) in skipped:
                    vals += [0.0, 0.0, 0.0]
                    continue
                corrupt = corrupt_env and is_main and inplace is False and i == 0
                if i == 0:
                    # First size: an op the backend rejects is detected on every rank.
                    exc, res = None, None
                    try:
                        res = measure(ctx, op, inplace, group, bufs, expected, corrupt,
                                      first=True)
                    except Exception as e:  # noqa: BLE001 (reported below)
                        exc = e
                    failed = _agree_failure(ctx, exc)
                    if failed is not None:
                        q, msg = failed
                        where = (f"{be} {'in-place' if inplace else 'out-of-place'} {op} "
                                 f"({ctx.dtype_name}, {redop}) failed on rank {q}: {msg}")
                        if is_main:
                            raise BenchError(where)
                        skipped[(be, inplace)] = msg
                        if ctx.rank == 0:
                            out(f"# note: {where}; shown as n/a")
                        vals += [0.0, 0.0, 0.0]
                        continue
                else:
                    res = measure(ctx, op, inplace, group, bufs, expected, corrupt)
                t_us, wrong = res
                vals += [1.0, t_us, float(wrong or 0)]
            stats = _gather_stats(ctx, vals)
            halves = []
            for h in range(2):
                ok, tcol, wcol = stats[:, 3 * h], stats[:, 3 * h + 1], stats[:, 3 * h + 2]
                if float(ok.min()) < 1.0:
                    halves.append(None)
                    continue
                t_us = _combine_time(ctx, tcol)
                algbw = nbytes / (t_us * 1e-6) / 1e9
                wrong = int(wcol.sum()) if ctx.check else None
                wrong_total[be] += wrong or 0
                halves.append(dict(time_us=t_us, algbw_gbps=algbw, busbw_gbps=algbw * factor,
                                   wrong=wrong))
            rows[be] = halves
        main_be = ctx.backend
        if ctx.peer_group is not None:
            for h in range(2):
                a, p = rows[main_be][h], rows[ctx.compare][h]
                if a is not None and p is not None:
                    a["speedup"] = p["time_us"] / a["time_us"]
                    speedups.append((a["speedup"], nbytes, "in-place" if h else "out-of-place"))
        for h in rows[main_be]:
            if h is not None:
                bw_main.append(h["busbw_gbps"])
        if ctx.rank == 0:
            for be, _, _ in backends:
                out(table.row(be, nbytes, count, ctx.dtype_name, redop, root, rows[be]))
                for inplace, h in zip((False, True), rows[be]):
                    if h is None:
                        continue
                    records.append(dict(
                        op=op, backend=be, bytes=nbytes, count=count, dtype=ctx.dtype_name,
                        redop=redop if op in REDUCING else None, inplace=inplace,
                        time_us=h["time_us"], algbw_gbps=h["algbw_gbps"],
                        busbw_gbps=h["busbw_gbps"], wrong=h["wrong"]))
        del bufs, expected
    progress.done()
    peer_bw = []
    if ctx.peer_group is not None:
        peer_bw = [r["busbw_gbps"] for r in records
                   if r["op"] == op and r["backend"] == ctx.compare]
    if ctx.rank == 0:
        for be, _, is_main in backends:
            w = wrong_total[be]
            tag = "" if not table.compare else f" ({be})"
            state = f"{w} OK" if w == 0 else f"{w} FAILED"
            out(f"# Out of bounds values{tag} : {state if ctx.check else 'N/A (-c 0)'}")
        avg = f"{sum(bw_main) / len(bw_main):g}" if bw_main else "N/A"
        out(f"# Avg bus bandwidth    : {avg}")
        if ctx.peer_group is not None:
            pavg = f"{sum(peer_bw) / len(peer_bw):g}" if peer_bw else "N/A"
            out(f"# Avg bus bandwidth ({ctx.compare}) : {pavg}")
            if speedups:
                lo = min(speedups)
                gm = math.exp(sum(math.log(s) for s, _, _ in speedups) / len(speedups))
                out(f"# Speed-up {ctx.backend} vs {ctx.compare} ({ctx.compare} time / "
                    f"{ctx.backend} time): min {lo[0]:.2f}x ({lo[1]} B {lo[2]}), "
                    f"geomean {gm:.2f}x over {len(speedups)} measurements")
            else:
                out(f"# Speed-up {ctx.backend} vs {ctx.compare}: nothing measured on both")
    return sum(wrong_total.values())


def run_rank(args):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise UsageError(f"{key} is not set: run under torchrun, or give --nproc N to "
                             "start N local ranks")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not 0 <= args.root < world:
        raise UsageError(f"-r/--root {args.root} is not a rank of {world}")
    if "chorus" in (args.backend, args.compare):
        import chorus  # noqa: F401  (registers the backend)

    ctx = Ctx()
    ctx.rank, ctx.world = rank, world
    ctx.dtype_name, ctx.dtype = args.datatype, DTYPES[args.datatype]
    ctx.redop_name, ctx.redop = args.redop, REDOPS[args.redop]
    ctx.root, ctx.check, ctx.iters, ctx.warmup = args.root, args.check, args.iters, \
        args.warmup_iters
    ctx.average, ctx.blocking = args.average, args.blocking
    ctx.backend, ctx.compare = args.backend, args.compare
    ctx.cuda = args.device == "cuda"
    if ctx.cuda:
        ctx.device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(ctx.device)
    else:
        ctx.device = torch.device("cpu")

    from datetime import timedelta

    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(backend=args.backend, timeout=timeout)
    try:
        ctx.main_group = dist.group.WORLD
        ctx.ctrl = dist.new_group(backend="gloo", timeout=timeout)  # bookkeeping only
        ctx.peer_group = (dist.new_group(backend=args.compare, timeout=timeout)
                          if args.compare else None)
        fail_rank = os.environ.get(TEST_FAIL_RANK_ENV)
        if fail_rank is not None and int(fail_rank) == rank:
            sys.stderr.write(f"bench: rank {rank}: test hook {TEST_FAIL_RANK_ENV} exits now\n")
            sys.stderr.flush()
            os._exit(7)
        return bench(ctx, args)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a failing backend may refuse; exiting anyway)
            pass


def session_note():
    """How rank 0 shares the CPU: in a session of its own (torchrun, --nproc) or not, and
    whether the kernel schedules sessions as groups (autogroup), which changes how ranks
    that outnumber the cores take turns (docs/PERFORMANCE.md, 2-core machine)."""
    try:
        own = os.getsid(0) == os.getpid()
    except OSError:
        return "session: unknown"
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            auto = "on" if f.read().strip() == "1" else "off"
    except OSError:
        auto = "unknown"
    where = "leads a session of its own" if own else "shares its launcher's session"
    return f"session: rank 0 {where}; kernel autogroup scheduling {auto}"


def bench(ctx, args):
    def out(line):
        print(line, flush=True)

    records = []
    if ctx.rank == 0:
        gbps = memcpy_gbps()
        try:
            usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            usable = os.cpu_count()
        try:
            import chorus

            cver = chorus.__version__
        except Exception:  # noqa: BLE001
            cver = "not imported"
        local = os.environ.get("LOCAL_WORLD_SIZE")
        backends = ctx.backend + (f", compared with {ctx.compare}" if ctx.compare else "")
        out(f"# {PROG}: {', '.join(args.op)}")
        out(f"# world size {ctx.world}" + (f" ({local} on this host)" if local else "")
            + f", backend {backends}, device {args.device}"
            + (f" (cuda:{ctx.device.index} on rank 0)" if ctx.cuda else ""))
        out(f"# dtype {ctx.dtype_name}, redop {ctx.redop_name}, root {ctx.root}, "
            f"iters {ctx.iters}, warmup {ctx.warmup}, check {ctx.check}; time: "
            f"{AVERAGE_NAMES[ctx.average]} of the mean of {ctx.iters} "
            + ("blocking ops (each waited before the next)" if ctx.blocking
               else "back-to-back ops"))
        out(f"# host: {os.cpu_count()} CPUs ({usable} usable by rank 0); memcpy (1 core): "
            f"{gbps:.2f} GB/s (torch copy_ of 64 MiB on one thread, best of 5, bytes counted "
            "once)")
        out(f"# torch {torch.__version__}, chorus {cver}")
        out(f"# {session_note()}")
    dist.barrier(group=ctx.ctrl)  # the others wait here while rank 0 measures memcpy
    table = Table(ctx.compare)
    progress = Progress(ctx.rank == 0)  # over the whole run, every op's sweep
    wrong = 0
    for op in args.op:
        wrong += sweep(ctx, op, args, out, records, table, progress)
    if ctx.rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
                f.write("\n")
            out(f"# wrote {len(records)} records to {args.json}")
        if args.plot:
            title = (f"{', '.join(args.op)}: {ctx.world} ranks, {args.device}, "
                     f"{ctx.dtype_name}")
            write_plot(args.plot, records, title)
            out(f"# wrote {args.plot}")
    return EXIT_WRONG if wrong else 0


# ------------------------------------------------------------------ --nproc launcher
def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent_fn():
    """preexec_fn: the rank gets SIGKILL if the launcher dies (Linux), so none is orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:  # noqa: BLE001
        return None
    parent = os.getpid()

    def fn():
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    return fn


def _kill(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _describe_exit(code):
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(args, argv):
    n = args.nproc
    port = free_port()
    marker = f"{os.getpid()}.{time.time_ns()}"
    if __spec__ is not None and __spec__.name == "chorus.bench":
        cmd = [sys.executable, "-m", "chorus.bench", *argv]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), *argv]
    preexec = _die_with_parent_fn() if sys.platform.startswith("linux") else None
    if args.same_session:
        # a process group of its own still lets stop_all signal the rank and its children
        pdeath = preexec

        def own_group():
            os.setpgid(0, 0)
            if pdeath is not None:
                pdeath()
        preexec = own_group
    procs = []

    def stop_all():
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            _kill(p, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.05)
        for p in procs:
            _kill(p, signal.SIGKILL)  # the rank's session: whatever it started too
        for p in procs:
            p.wait()

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    old_term = signal.signal(signal.SIGTERM, on_term)
    stopped_by_us = set()
    first = None
    try:
        for r in range(n):
            env = dict(os.environ)
            env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                       LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), **{CHILD_ENV: marker})
            env.setdefault("OMP_NUM_THREADS", "1")
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                          start_new_session=not args.same_session,
                                          preexec_fn=preexec))
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first is None:
                # (a rank that found wrong results exits 3 once the sweep is over: not a failure)
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0, EXIT_WRONG)]
                if bad:
                    first = (bad[0][0], now)
                    sys.stderr.write(f"bench: rank {bad[0][0]} failed ({_describe_exit(bad[0][1])})"
                                     f"; the other ranks get {args.kill_after:g} s to exit\n")
                    sys.stderr.flush()
            elif now > first[1] + args.kill_after:
                stopped_by_us = {r for r, c in enumerate(codes) if c is None}
                stop_all()
                break
            time.sleep(0.05)
    except (KeyboardInterrupt, SystemExit) as e:
        stopped_by_us = {r for r, p in enumerate(procs) if p.poll() is None}
        stop_all()
        sys.stderr.write("bench: interrupted; ranks stopped\n")
        return e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 130
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for p in procs:
            _kill(p, signal.SIGKILL)
            p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed and all(code == EXIT_WRONG for _, code in failed) and len(failed) == n:
        sys.stderr.write("bench: wrong results (#wrong > 0 above)\n")
        return EXIT_WRONG
    for r, code in failed:
        why = (f"stopped by the launcher after rank {first[0]} failed" if r in stopped_by_us
               else _describe_exit(code))
        sys.stderr.write(f"bench: rank {r}: {why}\n")
    if failed:
        sys.stderr.write(f"bench: {len(failed)} of {n} ranks failed\n")
        return EXIT_ERROR
    return 0


# ------------------------------------------------------------------ entry point
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        validate(args)
        if args.nproc and not os.environ.get(CHILD_ENV):
            return launch(args, argv)
        return run_rank(args)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return EXIT_USAGE
    except BenchError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
