"""Rank worker for tests/test_profiler.py: 3 DDP steps on a small MLP under torch.profiler
(CPU activities, record_shapes), each rank exporting its Chrome trace to <dir>/trace<rank>.json.
DDP's gradient buckets are reduced by all_reduce; the worker prints the gradient elements
of the model (PARAMS n: one bucket holds all of them) for the test to find in the trace.
CHORUS_TEST_DEVICE=cuda: the model on the rank's GPU, CUDA activities recorded too."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from common import init_dist, test_device  # noqa: E402

dev = test_device()
rank, world = init_dist()
out = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
print(f"PARAMS {sum(p.numel() for p in model.parameters())}", flush=True)
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
with profile(activities=activities, record_shapes=True) as prof:
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 4, generator=g).to(dev)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
prof.export_chrome_trace(os.path.join(out, f"trace{rank}.json"))
print("DONE", flush=True)
