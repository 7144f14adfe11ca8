"""float8 (torch.float8_e4m3fn, torch.float8_e5m2) through the collectives, on CPU
(families_coll's "float8" family) and on CUDA (cuda_checks.py): all_reduce with every float
reduce op, reduce, reduce_scatter_tensor, all_gather_into_tensor, broadcast and
all_to_all_single, sizes 0, 1, 7, 4099 and 3 x CHORUS_BUFFSIZE bytes.

The data are chosen so that every reference is exact whatever order a backend adds in:
- "sums" (SUM, AVG, PREMUL_SUM): values of the format from N(0, 2), those under 2^-6 in
  magnitude set to 0. Exponents then span at most -6..4, so any float32 sum of four or eight
  such values is exact and the result rounds once to the format (AVG: the sum, then the
  division, as a float32 reference computes it). PREMUL_SUM factors are +-1 and +-2.
- "prod": +-1 and +-2 (PRODUCT over four ranks is a power of two up to 16).
- "bytes": every bit pattern, NaN, infinities and -0 included (MIN, MAX, data movement).
Results are compared by value: equal, or both NaN (-0 and +0 compare equal, since which of
two equal inputs MIN/MAX keeps is not fixed by torch).
"""
import zlib

import torch
import torch.distributed as dist

from common import BUFFSIZE, SEED

FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
FACTORS = (1.0, 2.0, -1.0, -2.0)
SIZES = [0, 1, 7, 4099, 3 * BUFFSIZE]


def data(key, rank, n, dt, op=None):
    g = torch.Generator().manual_seed(zlib.crc32(repr((SEED, "fp8", key, rank)).encode()))
    if op in ("SUM", "AVG", "PREMUL_SUM"):
        x = (torch.randn(n, generator=g) * 2).to(dt).float()
        return torch.where(x.abs() < 2.0 ** -6, torch.zeros_like(x), x).to(dt)
    if op == "PRODUCT":
        choices = torch.tensor([-2.0, -1.0, 1.0, 2.0])
        return choices[torch.randint(0, 4, (n,), generator=g)].to(dt)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dt)


def reference(inputs, dt, op):
    wide = [t.float() for t in inputs]
    if op == "PREMUL_SUM":
        wide = [(w * FACTORS[q % len(FACTORS)]).to(dt).float() for q, w in enumerate(wide)]
        op = "SUM"
    if op in ("MIN", "MAX"):
        fn = torch.minimum if op == "MIN" else torch.maximum
        acc = wide[0]
        for w in wide[1:]:
            acc = fn(acc, w)
        return acc.to(dt)
    acc = wide[0].clone()
    for w in wide[1:]:
        acc = acc * w if op == "PRODUCT" else acc + w
    if op == "AVG":
        acc = acc.to(dt).float() / len(inputs)  # the rounded sum, then the division
    return acc.to(dt)


def torch_op(op, rank):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(FACTORS[rank % len(FACTORS)])
    return getattr(dist.ReduceOp, op)


def compare(got, expected):
    got = got.detach().cpu().reshape(-1).float()
    expected = expected.reshape(-1).float()
    if got.numel() != expected.numel():
        return f"has {got.numel()} elements, expected {expected.numel()}"
    bad = ~((got == expected) | (torch.isnan(got) & torch.isnan(expected)))
    nbad = int(bad.sum())
    if not nbad:
        return None
    i = int(bad.nonzero()[0])
    return (f"first wrong index {i}: got {got[i].item()!r}, expected {expected[i].item()!r}; "
            f"{nbad} of {got.numel()} elements wrong")


def poison(expected):
    """Differs from expected in value at every element (NaN included: the xor moves a NaN's
    exponent bits, and no two patterns that differ in 0xA5 are equal values or both NaN)."""
    return (expected.contiguous().view(torch.uint8) ^ 0xA5).view(expected.dtype)


# PREMUL_SUM factors of the conversion check: inexact products, ties, overflow (e4m3fn
# saturates, e5m2 goes to inf), subnormal results.
CONVERSION_FACTORS = (1 / 3, 0.1, 1.0625, 1.5, 7.3, 1000.0, 1e-3, 3e-5, 65536.0)


def cases(rank, world, group=None, device="cpu", sizes=SIZES):
    """Yields (case, fn): case names the check (coll, dtype, op, size, ...), fn() returns None
    or a mismatch message. Every rank must run every fn, in order. group: the process group,
    or a function returning the one to use now (the harness may replace it between checks)."""
    on = lambda t: t.to(device, copy=True)  # noqa: E731 - never the reference's own input
    pg = group if callable(group) else (lambda: group)
    for dname, dt in FP8.items():
        for n in sizes:
            def all_reduce(dt=dt, n=n, op=None, key=None):
                inputs = [data(key, q, n, dt, op) for q in range(world)]
                t = on(inputs[rank])
                dist.all_reduce(t, op=torch_op(op, rank), group=pg())
                return compare(t, reference(inputs, dt, op))

            for op in OPS:
                yield (dict(coll="all_reduce", dtype=dname, op=op, size=n, inplace=True),
                       lambda f=all_reduce, op=op: f(op=op, key=("ar", dname, n, op)))

            def reduce(dt=dt, n=n, op=None, root=0, key=None):
                inputs = [data(key, q, n, dt, op) for q in range(world)]
                t = on(inputs[rank])
                dist.reduce(t, dst=root, op=torch_op(op, rank), group=pg())
                want = reference(inputs, dt, op) if rank == root else inputs[rank]
                return compare(t, want)

            def reduce_scatter(dt=dt, n=n, op=None, key=None):
                m = n // world + 1 if n else 0
                inputs = [data(key, q, m * world, dt, op) for q in range(world)]
                want = reference(inputs, dt, op)[rank * m:(rank + 1) * m]
                out = on(poison(want))
                dist.reduce_scatter_tensor(out, on(inputs[rank]), op=torch_op(op, rank),
                                           group=pg())
                return compare(out, want)

            for op in ("SUM", "MAX"):
                root = n % world
                yield (dict(coll="reduce", dtype=dname, op=op, size=n, root=root),
                       lambda f=reduce, op=op, root=root: f(op=op, root=root,
                                                            key=("rd", dname, n, op)))
                yield (dict(coll="reduce_scatter_tensor", dtype=dname, op=op, size=n),
                       lambda f=reduce_scatter, op=op: f(op=op, key=("rs", dname, n, op)))

            def all_gather(dt=dt, n=n):
                inputs = [data(("ag", dname, n), q, n, dt) for q in range(world)]
                want = torch.cat(inputs)
                out = on(poison(want))
                dist.all_gather_into_tensor(out, on(inputs[rank]), group=pg())
                return compare(out, want)

            def broadcast(dt=dt, n=n, root=0):
                want = data(("bc", dname, n), root, n, dt)
                t = on(want) if rank == root else on(poison(want))
                dist.broadcast(t, src=root, group=pg())
                return compare(t, want)

            def all_to_all(dt=dt, n=n):
                m = n // world + 1 if n else 0
                inputs = [data(("a2a", dname, n), q, m * world, dt) for q in range(world)]
                want = torch.cat([inputs[q][rank * m:(rank + 1) * m] for q in range(world)])
                out = on(poison(want))
                dist.all_to_all_single(out, on(inputs[rank]), group=pg())
                return compare(out, want)

            yield dict(coll="all_gather_into_tensor", dtype=dname, size=n), all_gather
            root = (n + 1) % world
            yield (dict(coll="broadcast", dtype=dname, size=n, root=root),
                   lambda f=broadcast, root=root: f(root=root))
            yield dict(coll="all_to_all_single", dtype=dname, size=n), all_to_all

        def conversions(dt=dt, factor=1.0):
            # Rank 0 premultiplies every bit pattern (and random ones) by factor, the others
            # contribute zeros: the result is chorus's rounding of x * factor to the format,
            # which must equal this torch's conversion on CPU and, on a GPU, on the device
            # (the float32 product converted, as chorus rounds the double product to float32
            # first).
            x = torch.cat([torch.arange(256, dtype=torch.uint8).view(dt),
                           data(("conv", str(dt)), 0, 4096, dt)])
            t = on(x if rank == 0 else torch.zeros(x.numel()).to(dt))
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor if rank == 0 else 0.0),
                            group=pg())
            wide = (x.double() * factor).float()
            refs = {"cpu": wide.to(dt)}
            if torch.device(device).type == "cuda":
                refs["cuda"] = on(wide).to(dt).cpu()
            for where, ref in refs.items():
                if dt is torch.float8_e4m3fn:
                    # chorus saturates as torch 2.13 does; older torch (2.11) gives NaN for
                    # magnitudes that round past 448: that rule is the one difference allowed
                    over = (wide.abs() > 464) & ~torch.isnan(wide)
                    ref = torch.where(over, torch.copysign(torch.tensor(448.0), wide),
                                      ref.float()).to(dt)
                msg = compare(t, ref)
                if msg:
                    return f"differs from torch's conversion on {where}: {msg}"
            return None

        for factor in CONVERSION_FACTORS:
            yield (dict(coll="all_reduce", dtype=dname, op="PREMUL_SUM", size=4352,
                        data=f"conversion x{factor:g}"),
                   lambda f=conversions, factor=factor: f(factor=factor))
