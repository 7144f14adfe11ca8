"""What every rank worker shares: process-group setup, deterministic per-rank data, the
independent reference for each reduction, poisoning, comparison and the result recorder.

The reference never uses a collective: every rank regenerates every other rank's input from
(seed, case, rank) and reduces locally, in a wider type than the data.
"""
import faulthandler
import functools
import json
import os
import re
import time
import traceback
import warnings
import zlib
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

BACKEND = os.environ.get("CHORUS_TEST_BACKEND", "chorus")
SEED = int(os.environ.get("CHORUS_TEST_SEED", "20240611"))

# Deprecation chatter from torch.distributed (all_reduce_coalesced, functional collectives)
# would drown the output a failing test shows.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

# A rank that dies of a signal shows where (its output is in the job log).
faulthandler.enable()


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if mult > 1 else text) * mult


BUFFSIZE = parse_size(os.environ.get("CHORUS_BUFFSIZE", "4M"))


def allreduce_behind_sleep(rank, world, dev):
    """A plain (synchronous) all_reduce of 4099 floats issued behind ~100 ms of GPU work on
    the current stream, its result then used on that stream. Returns (host_s, gpu_s, ok):
    seconds until the call returned to Python, seconds until the GPU was done, and whether
    the result is right (NCCL's semantics: the call returns long before the GPU is done)."""
    t = torch.zeros(4099, device=dev)
    # torch's own kernels used below, loaded now: CUDA loads a kernel at its first launch,
    # and that load waits for the running sleep (it would be torch holding the host)
    t.fill_(1.0)
    t.add_(1)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    torch.cuda._sleep(int(2e8))
    t.fill_(rank + 1.0)
    dist.all_reduce(t)
    t.add_(1)
    host_s = time.monotonic() - t0
    torch.cuda.synchronize()
    gpu_s = time.monotonic() - t0
    return host_s, gpu_s, bool((t == world * (world + 1) / 2 + 1).all())


def test_device():
    """The device a worker's tensors live on: CHORUS_TEST_DEVICE (cpu, or cuda: the rank's GPU
    is cuda:LOCAL_RANK % device_count, made current before the group exists, as torchrun
    users do)."""
    if os.environ.get("CHORUS_TEST_DEVICE", "cpu") != "cuda":
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def init_dist(device_id=None):
    """init_process_group over env:// with the backend under test; returns (rank, world).
    device_id: the CUDA device the group is bound to (torch's device_id)."""
    if "chorus" in BACKEND:
        import chorus  # noqa: F401  (importing registers the "chorus" backend)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=float(os.environ.get("CHORUS_TEST_PG_TIMEOUT", "30")))
    dist.init_process_group(backend=BACKEND, init_method="env://", timeout=timeout,
                            **({"device_id": device_id} if device_id is not None else {}))
    return dist.get_rank(), dist.get_world_size()


# ------------------------------------------------------------------ dtypes and ops
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
HALVES = (torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
BITWISE = ("BAND", "BOR", "BXOR")


def ops_for(dt):
    """Every reduce op PyTorch defines for dt.
    Skipped on purpose: AVG on integers (backends disagree: NCCL truncates, Gloo rejects,
    others round), PREMUL_SUM on integers (ProcessGroupNCCL accepts only half/float/bfloat16/
    double), AVG and PREMUL_SUM on bool (meaningless)."""
    if dt in FLOATS:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM_SCALAR", "PREMUL_SUM_TENSOR"]
    return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


# Factors exactly representable in every float dtype, so x*f rounds the same way whether a
# backend multiplies in the dtype, float32 or float64. Different per rank, as PREMUL_SUM allows.
SCALAR_FACTORS = (0.375, 1.25, -0.5, 2.0)
TENSOR_FACTORS = (0.75, -1.5, 0.25, 1.125)


def premul_factor(op, rank):
    table = SCALAR_FACTORS if op == "PREMUL_SUM_SCALAR" else TENSOR_FACTORS
    return table[rank % len(table)]


def torch_op(op, dt, rank):
    if op == "PREMUL_SUM_SCALAR":
        return dist._make_nccl_premul_sum(premul_factor(op, rank))
    if op == "PREMUL_SUM_TENSOR":
        return dist._make_nccl_premul_sum(torch.tensor(premul_factor(op, rank), dtype=dt))
    return getattr(dist.ReduceOp, op)


def sizes_for(dt):
    """0, 1, 7, 4099 elements and 3 x CHORUS_BUFFSIZE bytes (several staging-ring laps)."""
    itemsize = torch.empty((), dtype=dt).element_size()
    return [0, 1, 7, 4099, 3 * BUFFSIZE // itemsize]


# ------------------------------------------------------------------ deterministic data
def _generator(key, rank):
    return torch.Generator().manual_seed(zlib.crc32(repr((SEED, key, rank)).encode()))


# Ranges where SUM over 4 ranks (and PREMUL_SUM) cannot overflow, so a wrong element is a bug,
# not wrap-around. Wrap-around has its own cases (WRAP_RANGES).
SMALL_RANGES = {
    torch.int8: (-15, 15),
    torch.uint8: (0, 50),
    torch.int16: (-1000, 1000),
    torch.int32: (-10**6, 10**6),
    torch.int64: (-10**12, 10**12),
}
WRAP_RANGES = {
    torch.int8: (90, 127),
    torch.uint8: (2, 255),
    torch.int32: (2**30, 2**31 - 1),
    torch.int64: (2**62, 2**63 - 2),
}


def kind_for(dt, op):
    if dt is torch.bool:
        return "bool"
    if dt in FLOATS:
        return "near1" if op == "PRODUCT" else "normal"
    if op is None or op in BITWISE:
        return "bits"
    if op == "PRODUCT":
        return "prod"
    return "small"


def make_data(key, rank, n, dt, kind=None):
    """Rank `rank`'s input for case `key`: n elements of dt, identical on every process.
    A fresh copy each time: callers may hand it to a collective that writes into it."""
    return _make_data_cached(key, rank, n, dt, kind or kind_for(dt, None)).clone()


@functools.lru_cache(maxsize=256)
def _make_data_cached(key, rank, n, dt, kind):
    # Consecutive cases (the ops of one dtype and size) share inputs: generate them once.
    # 256 entries: a coalesced family's check needs up to 3 tensors x 2 x world inputs per
    # variant, and its variants alternate inside the op loop, so 24 entries missed every time.
    # (At most 3 x CHORUS_BUFFSIZE bytes each: under 50 MB with the tests' 64 KiB rings.)
    g = _generator(key, rank)
    if dt is torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dt in FLOATS:
        x = torch.randn(n, generator=g, dtype=torch.float64 if dt is torch.float64 else torch.float32)
        if kind == "near1":
            # PRODUCT over 4 ranks stays near 1 instead of under/overflowing.
            x = 1.0 + 0.05 * x
        return x.to(dt)
    if kind == "bits":
        if dt is torch.int64:
            hi = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64)
            lo = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
            return hi * (2**32) + lo
        info = torch.iinfo(dt)
        lo, hi = info.min, info.max
    elif kind == "prod":
        # No zeros (PRODUCT would be 0 almost everywhere) and no overflow over 4 ranks.
        choices = torch.tensor([1, 2, 3] if dt is torch.uint8 else [-2, -1, 1, 2])
        idx = torch.randint(0, len(choices), (n,), generator=g)
        return choices[idx].to(dt)
    elif kind == "wrap":
        lo, hi = WRAP_RANGES[dt]
    else:
        lo, hi = SMALL_RANGES[dt]
    return torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dt)


# ------------------------------------------------------------------ reference reductions
_NP_SIGNED = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}
_NP_UNSIGNED = {torch.int8: np.uint8, torch.uint8: np.uint8, torch.int16: np.uint16,
                torch.int32: np.uint32, torch.int64: np.uint64}


def _modular_int_reduce(terms, dt, op):
    """SUM / PRODUCT with two's-complement wrap-around, computed in numpy uint64 (whose
    overflow is defined modular arithmetic) and truncated to dt's width."""
    arrays = [t.to(torch.int64).numpy().view(np.uint64) for t in terms]
    acc = arrays[0].copy()
    with np.errstate(over="ignore"):
        for a in arrays[1:]:
            acc = acc + a if op == "SUM" else acc * a
    narrow = acc.astype(_NP_UNSIGNED[dt])
    if dt is not torch.uint8:
        narrow = narrow.view(_NP_SIGNED[dt])
    return torch.from_numpy(narrow.copy())


def reference_reduce(terms, dt, op, factors=None):
    """Returns (expected, tolerance) for reducing `terms` (one tensor per rank, rank order).

    tolerance is None (exact), ("ulp", 2) for float16/bfloat16 (expected is the float32
    accumulation rounded once to dt), or ("abs", tensor) for float32/float64 where expected is
    the float64 value and the bound is rtol * sum(|term|): an elementwise bound relative to the
    result alone would fail a correctly rounded float64 sum wherever the terms cancel.
    """
    n = len(terms)
    if op.startswith("PREMUL_SUM"):
        # The premultiplied input is a tensor of dt, so each product is rounded to dt.
        terms = [(t.to(torch.float64) * f).to(dt) for t, f in zip(terms, factors)]
        op = "SUM"
    if dt is torch.bool:
        fn = {"SUM": torch.logical_or, "MAX": torch.logical_or, "BOR": torch.logical_or,
              "PRODUCT": torch.logical_and, "MIN": torch.logical_and, "BAND": torch.logical_and,
              "BXOR": torch.logical_xor}[op]
        return functools.reduce(fn, terms), None
    if dt in INTS:
        if op in ("SUM", "PRODUCT"):
            return _modular_int_reduce(terms, dt, op), None
        fn = {"MIN": torch.minimum, "MAX": torch.maximum, "BAND": torch.bitwise_and,
              "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        return functools.reduce(fn, terms), None
    acc_dt = torch.float32 if dt in HALVES else torch.float64
    wide = [t.to(acc_dt) for t in terms]
    if op in ("MIN", "MAX"):
        fn = torch.minimum if op == "MIN" else torch.maximum
        return functools.reduce(fn, terms), None
    if op in ("SUM", "AVG"):
        value = functools.reduce(torch.add, wide)
        scale = functools.reduce(torch.add, [w.abs() for w in wide])
        if op == "AVG":
            value, scale = value / n, scale / n
    elif op == "PRODUCT":
        value = functools.reduce(torch.mul, wide)
        scale = value.abs()
    else:
        raise ValueError(op)
    if dt in HALVES:
        return value.to(dt), ("ulp", 2)
    return value, ("abs", RTOL[dt] * scale)


# ------------------------------------------------------------------ poison and compare
def poison_like(expected, dt=None):
    """A tensor of expected's shape and dtype dt (default: expected's) that differs from
    expected in every element, so an element the collective does not write can never pass."""
    dt = dt or expected.dtype
    expected = expected.to(dt)
    if dt in FLOATS:
        return torch.full_like(expected, float("nan"))
    if dt is torch.bool:
        return ~expected
    if dt is torch.uint8:
        return expected ^ 0xA5
    return expected ^ -91  # flips bits in every element, whatever its width


def _ordered_half_bits(t):
    # Map a 16-bit float's sign-magnitude bit pattern onto an ordered integer line, so the
    # difference of two values is their distance in ulps.
    b = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def compare(got, expected, tol=None, label=""):
    """None if got matches, else a message naming the first wrong index."""
    got = got.detach().reshape(-1)
    expected = expected.reshape(-1)
    if got.numel() != expected.numel():
        return f"{label}has {got.numel()} elements, expected {expected.numel()}"
    if got.numel() == 0:
        return None
    if tol is None:
        if got.dtype in FLOATS:
            bad = ~(got == expected.to(got.dtype))  # NaN poison never compares equal
        else:
            bad = got != expected
    elif tol[0] == "ulp":
        bad = torch.isnan(got) | (
            (_ordered_half_bits(got) - _ordered_half_bits(expected)).abs() > tol[1])
    else:
        bad = ~((got.to(torch.float64) - expected).abs() <= tol[1].reshape(-1))
    nbad = int(bad.sum())
    if nbad == 0:
        return None
    i = int(bad.nonzero()[0])
    g, e = got[i].item(), expected[i].item()
    extra = f" (allowed error {tol[1].reshape(-1)[i].item():.3g})" if tol and tol[0] == "abs" else ""
    return (f"{label}first wrong index {i}: got {g!r}, expected {e!r}{extra}; "
            f"{nbad} of {got.numel()} elements wrong")


def compare_list(gots, expecteds, tol=None, label="output"):
    """Checks output[j] against expected[j]; tol may be a list (one per output) or shared."""
    for j, (g, e) in enumerate(zip(gots, expecteds)):
        t = tol[j] if isinstance(tol, list) else tol
        msg = compare(g, e, t, label=f"{label}[{j}]: ")
        if msg:
            return msg
    return None


# ------------------------------------------------------------------ recording results
UNSUPPORTED_RE = re.compile(
    r"not support|unsupported|does not support|not implement|NotImplemented|"
    r"Cannot use ReduceOp|Invalid scalar type|no kernel|not available", re.I)


# Errors after which a communicator cannot be trusted any more.
BROKEN_RE = re.compile(r"timed? ?out|timeout|connection|closed|abort|peer|broken pipe|reset", re.I)


class Ctx:
    """One rank's view of a check run: rank, world, the group under test, and check().

    After every check the ranks compare notes over a separate control group (so every
    rank must make the same sequence of check() calls): if some ranks raised and others did
    not, the others were left inside (or past) a collective the raisers never joined, and every
    later check would pair up wrong calls. Then, and after a timeout or lost connection, the
    group under test is replaced by a fresh one and the remaining cases of that collective
    variant and size are recorded as errors without running (each would cost another timeout),
    so one broken call cannot garble the whole report.
    Records go to <out>/rank<r>.jsonl; the check being run to <out>/rank<r>.current.
    """

    def __init__(self, out_dir, rank, world):
        self.rank, self.world = rank, world
        self.out_dir = out_dir
        self.family = None
        self.group = dist.group.WORLD
        pg_timeout = float(os.environ.get("CHORUS_TEST_PG_TIMEOUT", "30"))
        # Long enough to outwait a rank stuck until the group under test times out.
        # The control group is a communicator of its own (own connections, own sequence
        # numbers), of the backend under test unless CHORUS_TEST_CTRL_BACKEND names another:
        # a Gloo vote cost 1.5-3 ms per check on 2 cores, most of a 4-rank run's time. A
        # wrong vote cannot hide a failure: every rank records its own result, and the vote
        # only decides when the group under test is replaced.
        ctrl_backend = os.environ.get("CHORUS_TEST_CTRL_BACKEND", BACKEND)
        self.ctrl = dist.new_group(backend=ctrl_backend,
                                   timeout=timedelta(seconds=3 * pg_timeout + 30))
        self.pg_timeout = timedelta(seconds=pg_timeout)
        self.out_of_step = {}  # variant signature -> case that left the ranks out of step
        self._f = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w")
        self._cur_path = os.path.join(out_dir, f"rank{rank}.current")
        # Rewritten in place for every check (an open with O_TRUNC per check cost ~0.7 ms
        # here); a shorter text is padded with spaces (readers strip them).
        self._cur_fd = os.open(self._cur_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._cur_len = 0
        self.sabotage = os.environ.get("CHORUS_TEST_SABOTAGE") == "1"

    def _set_current(self, text):
        data = text.encode()
        os.pwrite(self._cur_fd, data + b" " * (self._cur_len - len(data)), 0)
        self._cur_len = max(self._cur_len, len(data))

    def _write(self, rec):
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    @staticmethod
    def _signature(case):
        return tuple(sorted((k, v) for k, v in case.items() if k not in ("dtype", "op", "root")))

    def check(self, case, fn, *args):
        """Runs fn(*args) -> None (match) or a mismatch message; records pass / fail, or
        unsupported / error if it raised. Returns True on every rank iff it passed on all."""
        case = dict(family=self.family, **case)
        sig = self._signature(case)
        if sig in self.out_of_step:
            self._write(dict(case, rank=self.rank, status="error", detail=(
                "not run: an earlier case of this collective left the ranks out of step: "
                + json.dumps(self.out_of_step[sig]))))
            return False
        self._set_current(json.dumps(case))
        t0 = time.monotonic()
        try:
            problem = fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure becomes a record
            text = f"{type(e).__name__}: {e}".strip()
            status = "unsupported" if UNSUPPORTED_RE.search(text) else "error"
            detail = text[:600]
            if status == "error":
                detail += "\n" + "".join(traceback.format_exc(limit=4))[-1200:]
        else:
            status = "fail" if problem else "pass"
            detail = problem or ""
        ms = round(1000 * (time.monotonic() - t0), 2)
        raised = status in ("unsupported", "error")
        broken = status == "error" and bool(BROKEN_RE.search(detail))
        votes = torch.tensor([int(raised), int(broken), int(status != "pass")], dtype=torch.int64)
        dist.all_reduce(votes, group=self.ctrl)
        n_raised, n_broken, n_not_passed = (int(v) for v in votes)
        if 0 < n_raised < self.world or n_broken:
            why = (f"only {n_raised} of {self.world} ranks raised here" if n_broken == 0 else
                   "a rank timed out or lost a connection here")
            detail += (f" [{why}: the group under test was replaced, and the remaining cases of "
                       "this collective variant and size are not run]")
            self.out_of_step[sig] = {k: v for k, v in case.items() if k != "family"}
        self._write(dict(case, rank=self.rank, status=status, detail=detail, ms=ms))
        if n_broken or 0 < n_raised < self.world:
            # Ranks out of step, or a timeout / dead connection: the communicator is suspect,
            # continue on a fresh one (and free the old one's threads and sockets).
            old, self.group = self.group, dist.new_group(ranks=list(range(self.world)),
                                                         timeout=self.pg_timeout)
            if old is not dist.group.WORLD:
                dist.destroy_process_group(old)
        return n_not_passed == 0

    def note(self, case, status, detail=""):
        self._write(dict(family=self.family, **case, rank=self.rank, status=status, detail=detail))

    def family_done(self, family, error=None):
        self._write(dict(family=family, rank=self.rank, status="family_done", detail=error or ""))

    def close(self):
        self._set_current("finished")
        os.close(self._cur_fd)
        self._f.close()
