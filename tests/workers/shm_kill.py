"""Rank worker for the SIGKILL test: all_reduce over shared memory in a loop, announcing
(through a file per rank) once it has completed a few rounds, until it is killed. Bounded so
that it stops by itself if nobody kills it."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist  # noqa: E402

ready_dir = sys.argv[1]
rank, world = init_dist()
t = torch.ones(1 << 20)  # 4 MiB: many laps of the staging ring
deadline = time.monotonic() + 120
i = 0
while time.monotonic() < deadline:
    dist.all_reduce(t)
    t.fill_(1.0)
    i += 1
    if i == 3:
        open(os.path.join(ready_dir, f"ready{rank}"), "w").close()
sys.exit(3)  # nobody killed us: the test will say so
