"""Rank worker for tests/test_tune.py: creates the process group (CHORUS_ALGO / CHORUS_DEBUG
come from the environment), runs all_reduce of the sizes given on the command line, an
all_gather, a broadcast of 32 KB and a barrier, and checks the results. If creation fails,
prints the error after INIT_FAILED: and exits 3. TUNE_SPIN_COUNTS="a,b,..." gives rank r the
CHORUS_SPIN_COUNT of the r-th entry (ranks differ, which the launcher's env cannot do)."""
import os
import sys

if os.environ.get("TUNE_SPIN_COUNTS"):
    os.environ["CHORUS_SPIN_COUNT"] = os.environ["TUNE_SPIN_COUNTS"].split(",")[int(os.environ["RANK"])]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist  # noqa: E402

try:
    rank, world = init_dist()
except Exception as e:  # noqa: BLE001  (the test reads the text)
    print(f"INIT_FAILED: {type(e).__name__}: {e}", flush=True)
    sys.exit(3)
for nbytes in [int(a) for a in sys.argv[1:]]:
    t = torch.full((max(nbytes // 4, 1),), float(rank + 1))
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    assert torch.all(t == want), f"all_reduce of {nbytes} bytes: {t[:4]} != {want}"
out = [torch.zeros(16) for _ in range(world)]
dist.all_gather(out, torch.full((16,), float(rank)))
assert all(torch.all(o == r) for r, o in enumerate(out))
b = torch.full((8192,), float(rank + 7))
dist.broadcast(b, src=1 % world)
assert torch.all(b == float(1 % world + 7)), f"broadcast: {b[:4]}"
dist.barrier()
dist.destroy_process_group()
print("TUNE_WORKER_OK", flush=True)
