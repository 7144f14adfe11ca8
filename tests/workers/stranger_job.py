"""Rank worker for tests/test_stranger.py: after init_process_group, the last rank waits
STRANGER_DELAY_S seconds before creating a second group with every rank (so the others sit in
that group's creation, listening, while the test's raw TCP client connects and sends junk;
init_process_group itself cannot be held like that, its store waits for every rank first),
then every rank runs verified all_reduce calls on both groups and a barrier."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist  # noqa: E402

rank, world = init_dist()
print("WORLD_READY", flush=True)
if rank == world - 1:
    time.sleep(float(os.environ.get("STRANGER_DELAY_S", "3")))
group = dist.new_group(list(range(world)))
for i in range(50):
    t = torch.full((1000 + i,), float(rank + i))
    dist.all_reduce(t, group=group if i % 2 else None)
    want = sum(r + i for r in range(world))
    assert torch.all(t == want), f"iteration {i}: {t[:4]} != {want}"
dist.barrier()
dist.destroy_process_group()
print("STRANGER_JOB_OK", flush=True)
