"""A rank whose open-file limit is too small for its TCP connections: it lowers its own soft
RLIMIT_NOFILE to a few descriptors above what it has open, then creates a group over sockets
with many connections per peer (the test sets CHORUS_SHM_DISABLE=1 and
CHORUS_NSOCKS_PERTHREAD). Chorus must raise the soft limit (the hard one allows it) and the
collectives must work. Prints one RESULT line."""
import json
import os
import resource
from datetime import timedelta

import torch
import torch.distributed as dist

import chorus  # noqa: F401  (registers the backend)

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
open_now = len(os.listdir("/proc/self/fd"))
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
low = open_now + 24
resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
dist.init_process_group("chorus", timeout=timedelta(seconds=60))
t = torch.full((1 << 16,), float(rank + 1))
want = float(world * (world + 1) // 2)
ok = True
for _ in range(3):
    dist.all_reduce(t)
    ok = ok and bool((t == want).all())
    t.fill_(float(rank + 1))
after = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
fds = len(os.listdir("/proc/self/fd"))
print("RESULT " + json.dumps({"rank": rank, "lowered_to": low, "soft_after": after,
                               "open_fds": fds, "correct": ok}), flush=True)
dist.destroy_process_group()
