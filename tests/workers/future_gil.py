"""Rank worker of tests/test_async_future.py::test_get_future_while_the_work_finishes:
all_gather_into_tensor with a temporary input (C++ then holds its Python object's last
reference), Python busy for a moment holding the GIL while the collective completes, then
Work.get_future(). The core thread finishing the work drops that input, which takes the GIL;
get_future() used to wait for that thread while holding the GIL, and the job hung at the
second iteration. Prints "ok <iterations>" per rank."""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init_dist  # noqa: E402

ITERS = int(os.environ.get("FUTURE_GIL_ITERS", "300"))


def main():
    rank, world = init_dist()
    for i in range(ITERS):
        out = torch.empty(64 * world)
        work = dist.all_gather_into_tensor(out, torch.full((64,), float(rank + i)), async_op=True)
        until = time.perf_counter() + 200e-6
        while time.perf_counter() < until:  # Python holds the GIL while the work completes
            pass
        got = work.get_future().wait()[0]
        want = torch.cat([torch.full((64,), float(r + i)) for r in range(world)])
        if not torch.equal(got, want):
            raise SystemExit(f"rank {rank} iteration {i}: wrong all_gather result")
    print(f"ok {ITERS}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
