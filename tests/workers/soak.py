"""Rank worker for tests/test_soak.py: N randomly chosen collectives (all_reduce, all_gather,
reduce_scatter, broadcast, all_to_all, reduce, barrier; sizes 1..64K elements; float32,
float64, bfloat16, int32, int64; ops SUM/MAX/MIN/PRODUCT; on the world group or on one of two
subgroups; blocking or async in bursts), every result checked exactly. Every rank draws the
same sequence from one seed, so all make the same calls. Prints RSS_KB <after warm-up>
<at the end> and SOAK_OK <count> (and RSS_AT <k> <kB> every SOAK_RSS_EVERY collectives)."""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist  # noqa: E402

N = int(sys.argv[1])
WARMUP = int(sys.argv[2])
rank, world = init_dist()
rng = random.Random(1234)
groups = {"world": (None, list(range(world))),
          "even": (None, [r for r in range(world) if r % 2 == 0]),
          "low": (None, list(range(max(2, world - 1))))}
for name, (_, members) in list(groups.items()):
    if name != "world":
        groups[name] = (dist.new_group(members), members)

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64]
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce",
         "barrier"]


def rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def value(r, i, k, dt):
    """Small integers: exact in every dtype and under every op."""
    v = ((r * 7 + i * 3 + k) % 5) + 1
    return torch.full((i,), float(v), dtype=torch.float64).to(dt) if i else torch.zeros(0, dtype=dt)


def reduce_ref(vals, op):
    out = vals[0].to(torch.float64).clone()
    for v in vals[1:]:
        v = v.to(torch.float64)
        out = {"SUM": out + v, "MAX": torch.maximum(out, v), "MIN": torch.minimum(out, v),
               "PRODUCT": out * v}[op]
    return out


pending = []
rss_warm = None
for k in range(N):
    if k == WARMUP:
        rss_warm = rss_kb()
    if os.environ.get("SOAK_RSS_EVERY") and k % int(os.environ["SOAK_RSS_EVERY"]) == 0:
        print(f"RSS_AT {k} {rss_kb()}", flush=True)
    gname = rng.choice(["world", "world", "even", "low"])
    g, members = groups[gname]
    kind = rng.choice(KINDS)
    dt = rng.choice(DTYPES)
    n = rng.choice([1, 3, 17, 256, 1000, 4099, 65536])
    opname = rng.choice(["SUM", "MAX", "MIN"] + (["PRODUCT"] if n < 300 else []))
    if dt is torch.bfloat16 and opname in ("SUM", "PRODUCT"):
        opname = "MAX"  # bfloat16 sums of these values round; MAX/MIN are exact
    root_i = rng.randrange(len(members))
    use_async = rng.random() < 0.3
    if rank not in members:
        continue
    me = members.index(rank)
    m = len(members)
    op = getattr(dist.ReduceOp, opname)
    checks = []
    if kind == "all_reduce":
        t = value(rank, n, k, dt)
        w = dist.all_reduce(t, op=op, group=g, async_op=use_async)
        want = reduce_ref([value(r, n, k, dt) for r in members], opname)
        checks.append((t, want))
    elif kind == "reduce":
        t = value(rank, n, k, dt)
        w = dist.reduce(t, dst=members[root_i], op=op, group=g, async_op=use_async)
        if me == root_i:
            checks.append((t, reduce_ref([value(r, n, k, dt) for r in members], opname)))
    elif kind == "all_gather":
        out = torch.empty(n * m, dtype=dt)
        w = dist.all_gather_into_tensor(out, value(rank, n, k, dt), group=g, async_op=use_async)
        checks.append((out, torch.cat([value(r, n, k, dt) for r in members]).to(torch.float64)))
    elif kind == "reduce_scatter":
        parts = [value(rank, n, k + j, dt) for j in range(m)]
        out = torch.empty(n, dtype=dt)
        w = dist.reduce_scatter_tensor(out, torch.cat(parts), op=op, group=g, async_op=use_async)
        want = reduce_ref([value(r, n, k + me, dt) for r in members], opname)
        checks.append((out, want))
    elif kind == "broadcast":
        src = members[root_i]
        t = value(rank, n, k, dt) if rank == src else torch.zeros(n, dtype=dt)
        w = dist.broadcast(t, src=src, group=g, async_op=use_async)
        checks.append((t, value(src, n, k, dt).to(torch.float64)))
    elif kind == "all_to_all":
        blk = max(1, n // m)
        inp = torch.cat([value(rank, blk, k + j, dt) for j in range(m)])
        out = torch.empty(blk * m, dtype=dt)
        w = dist.all_to_all_single(out, inp, group=g, async_op=use_async)
        checks.append((out, torch.cat([value(r, blk, k + me, dt) for r in members])
                       .to(torch.float64)))
    else:
        w = dist.barrier(group=g, async_op=use_async)
    pending.append((k, kind, w if use_async else None, checks))
    if not use_async or len(pending) > 8 or k == N - 1:
        for kk, kd, ww, cs in pending:
            if ww is not None:
                ww.wait()
            for got, want in cs:
                assert torch.equal(got.to(torch.float64), want), \
                    f"collective {kk} {kd}: {got[:4]} != {want[:4]}"
        pending = []
for kk, kd, ww, cs in pending:
    if ww is not None:
        ww.wait()
    for got, want in cs:
        assert torch.equal(got.to(torch.float64), want), f"collective {kk} {kd}"
dist.barrier()
print(f"RSS_KB {rss_warm} {rss_kb()}", flush=True)
print(f"SOAK_OK {N}", flush=True)
dist.destroy_process_group()
