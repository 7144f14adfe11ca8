"""Rank worker for tests/test_destroy_inflight.py: ranks 0..2 start an async all_reduce that
cannot finish (rank 3 does not call it), then destroy the process group (MODE=destroy) or
abort it (MODE=abort: the backend's abort()) while it is in flight. Prints
    ENDED <seconds the call took> and WAIT <exception type or NO_ERROR> <seconds>
Rank 3 waits until the others are done (a file per rank), then destroys its group too."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist  # noqa: E402

rank, world = init_dist()
mode, flag_dir = sys.argv[1], sys.argv[2]
dist.all_reduce(torch.ones(4))  # the group works
if rank != world - 1:
    w = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    time.sleep(0.5)  # in flight: waiting for the last rank
    t0 = time.monotonic()
    if mode == "abort":
        dist.group.WORLD._get_backend(torch.device("cpu")).abort()
    else:
        dist.destroy_process_group()
    print(f"ENDED {time.monotonic() - t0:.2f}", flush=True)
    t1 = time.monotonic()
    try:
        w.wait()
        print(f"WAIT NO_ERROR {time.monotonic() - t1:.2f}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"WAIT {type(e).__name__} {time.monotonic() - t1:.2f} {' '.join(str(e).split())[:200]}",
              flush=True)
    open(os.path.join(flag_dir, f"done{rank}"), "w").close()
else:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(flag_dir, f"done{r}")) for r in range(world - 1)):
        time.sleep(0.05)
    t0 = time.monotonic()
    dist.destroy_process_group()
    print(f"ENDED {time.monotonic() - t0:.2f}", flush=True)
print("EXIT", flush=True)
