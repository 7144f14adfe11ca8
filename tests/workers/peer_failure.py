"""Rank worker for tests/test_peer_failure.py: all_reduce in a loop (results checked) until
one fails. Prints READY <rank> after the first few calls, then, on the failure,
    FAILED <seconds since the victim was due> <exception type> <message>
MODE=kill: the test SIGKILLs the victim; MODE=silent: the victim stops calling (sleeps).
CHORUS_TEST_DEVICE=cuda: the tensor is on cuda:LOCAL_RANK % device_count."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist, test_device  # noqa: E402

dev = test_device()
rank, world = init_dist()
victim = int(os.environ["VICTIM"])
mode = os.environ["MODE"]
ready_dir = sys.argv[1]
i = 0
t = torch.ones(1024, device=dev)
while True:
    if i == 20:
        open(os.path.join(ready_dir, f"ready{rank}"), "w").close()
        print(f"READY {rank}", flush=True)
    if mode == "silent" and rank == victim and i == 50:
        print("SILENT", flush=True)
        time.sleep(600)
    try:
        t.fill_(1.0)
        dist.all_reduce(t)
        assert torch.all(t == world), t[:4]
    except Exception as e:  # noqa: BLE001  (the test reads type and text)
        msg = " ".join(str(e).split())[:800]
        print(f"FAILED {time.time():.3f} {type(e).__name__} {msg}", flush=True)
        sys.exit(5)
    i += 1
    if i > 20:
        time.sleep(0.01)
