"""A rank confined to the CPUs its test names (CHORUS_TEST_CPUS_<rank>: comma-separated CPU
numbers) before it creates a group; it runs a checked all_reduce and prints one RESULT line. The
test reads the INFO line in which Chorus reports the cores its ranks on this host share (the
union of their affinity masks), which sizes its spinning and thread defaults."""
import json
import os
from datetime import timedelta

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
cpus = {int(c) for c in os.environ[f"CHORUS_TEST_CPUS_{rank}"].split(",")}
os.sched_setaffinity(0, cpus)  # before any thread exists: they all inherit it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import chorus  # noqa: E402,F401  (registers the backend)

dist.init_process_group("chorus", timeout=timedelta(seconds=60))
base = torch.arange(1 << 12, dtype=torch.float32)
t = base * (rank + 1)
dist.all_reduce(t)
ok = torch.equal(t, base * (world * (world + 1) // 2))
print("RESULT " + json.dumps({"rank": rank, "cpus": sorted(os.sched_getaffinity(0)),
                               "correct": ok}), flush=True)
dist.destroy_process_group()
