"""A rank of tests/test_socket_read_ahead.py: collectives of 4 MiB over sockets, one
all-reduce first (a reduction announces its payloads to the transport), then all-gathers,
all-to-alls and broadcasts, whose payloads are copied to their destination. Every result is
checked; the core's INFO line at destroy tells where the received bytes landed."""
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import chorus  # noqa: F401  (registers the backend)

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
N = 1 << 20  # float32 elements: 4 MiB


def run():
    ok = True
    x = torch.full((N,), float(rank + 1))
    dist.all_reduce(x)
    ok = ok and torch.all(x == world * (world + 1) / 2).item()
    for it in range(3):
        mine = torch.arange(N, dtype=torch.float32) + rank * N + it
        out = torch.empty(world * N)
        dist.all_gather_into_tensor(out, mine)
        ok = ok and torch.equal(out, torch.arange(world * N, dtype=torch.float32) + it)
        blk = N // world
        src = torch.arange(world * blk, dtype=torch.float32) + rank * 1000.0 + it
        got = torch.empty(world * blk)
        dist.all_to_all_single(got, src)
        want = torch.cat([torch.arange(blk, dtype=torch.float32) + rank * blk + p * 1000.0 + it
                          for p in range(world)])
        ok = ok and torch.equal(got, want)
        b = torch.arange(N, dtype=torch.float32) + it if rank == it % world else torch.zeros(N)
        dist.broadcast(b, src=it % world)
        ok = ok and torch.equal(b, torch.arange(N, dtype=torch.float32) + it)
    return {"correct": bool(ok)}


dist.init_process_group("chorus", timeout=timedelta(seconds=120))
res = run()
res["rank"] = rank
print("RESULT " + json.dumps(res), flush=True)
dist.destroy_process_group()
