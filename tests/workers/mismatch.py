"""Rank worker for tests/test_mismatch.py: four mismatched calls, each on a fresh group of
every rank: rank 0's all_reduce has 100 elements and the others' 200; rank 0 float32, others
float64; rank 0 SUM, others MAX; rank 0 all_reduce, others broadcast. Prints per case
    CASE <name> <seconds> <exception type> <message>   (or CASE <name> <seconds> NO_ERROR)
then, per case, whether the mismatched group is cleanly unusable (a later call raises at
once), and finally that the world group still computes right. CHORUS_TEST_DEVICE=cuda: the
tensors are on cuda:LOCAL_RANK % device_count."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist, test_device  # noqa: E402

dev = test_device()
rank, world = init_dist()
first = rank == 0


def allreduce(n, dtype, op, g):
    dist.all_reduce(torch.ones(n, dtype=dtype, device=dev), op=op, group=g)


CASES = {
    "count": lambda g: allreduce(100 if first else 200, torch.float32, dist.ReduceOp.SUM, g),
    "dtype": lambda g: allreduce(100, torch.float32 if first else torch.float64,
                                 dist.ReduceOp.SUM, g),
    "op": lambda g: allreduce(100, torch.float32,
                              dist.ReduceOp.SUM if first else dist.ReduceOp.MAX, g),
    "kind": lambda g: (allreduce(100, torch.float32, dist.ReduceOp.SUM, g) if first
                       else dist.broadcast(torch.ones(100, device=dev), src=0, group=g)),
}
groups = {}
for name, fn in CASES.items():
    g = dist.new_group(list(range(world)))
    groups[name] = g
    dist.all_reduce(torch.ones(4, device=dev), group=g)  # the group works before the mismatch
    t0 = time.monotonic()
    try:
        fn(g)
    except Exception as e:  # noqa: BLE001  (the test reads type and text)
        msg = " ".join(str(e).split())[:600]
        print(f"CASE {name} {time.monotonic() - t0:.2f} {type(e).__name__} {msg}", flush=True)
    else:
        print(f"CASE {name} {time.monotonic() - t0:.2f} NO_ERROR", flush=True)
    dist.barrier()  # world group: everyone is past this case

for name, g in groups.items():
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4, device=dev), group=g)
        print(f"AFTER {name} {time.monotonic() - t0:.2f} WORKED", flush=True)
    except Exception as e:  # noqa: BLE001
        msg = " ".join(str(e).split())[:300]
        print(f"AFTER {name} {time.monotonic() - t0:.2f} {type(e).__name__} {msg}", flush=True)

t = torch.full((8,), float(rank), device=dev)
dist.all_reduce(t)
assert torch.all(t == sum(range(world))), t
print("WORLD_STILL_WORKS", flush=True)
dist.destroy_process_group()
