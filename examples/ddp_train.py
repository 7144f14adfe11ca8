"""DistributedDataParallel over the "chorus" backend: plain, and with each gradient
compression hook of torch.distributed.algorithms.ddp_comm_hooks (fp16_compress_hook,
bf16_compress_hook, PowerSGD), all variants in one process group, one after the other.

  torchrun --nproc-per-node 2 examples/ddp_train.py --out losses.json
  python examples/ddp_train.py --nproc 2 --compare gloo     # standalone, checked against Gloo

The change from a Gloo or NCCL script is one line: `import chorus` (which registers the
backend) and init_process_group("chorus"). Everything else is ordinary DDP.

Tolerance (stated per variant in TOLERANCE, checked by tests/test_examples.py): the per-step
loss, averaged over ranks, matches a Gloo run of this script within a relative 1e-5 for fp32
gradients and PowerSGD (the reductions differ only in summation order), 1e-3 with the fp16 /
bf16 hooks (Gloo rounds every partial sum of a half to the half, Chorus accumulates in fp32
and rounds once: gradients differ by about one ulp of the half). A CUDA run compared with a
CPU reference may also differ by the devices' fp32 arithmetic: TOLERANCE_CROSS_DEVICE.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (launching, device choice, loss records: nothing DDP-specific)

VARIANTS = ("plain", "fp16_hook", "bf16_hook", "powersgd")
TOLERANCE = {"plain": {"rtol": 1e-5}, "fp16_hook": {"rtol": 1e-3},
             "bf16_hook": {"rtol": 1e-3}, "powersgd": {"rtol": 1e-5}}
TOLERANCE_CROSS_DEVICE = {v: {"rtol": 1e-3} for v in VARIANTS}
SEED, BATCH, IN, HIDDEN, OUT = 7, 16, 32, 64, 8


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step, rank):
    """Rank `rank`'s batch: drawn on the CPU, so every device and backend sees the same."""
    g = torch.Generator().manual_seed(SEED * 1000 + step * 64 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 1.5)


def bf16_compress_hook_any_build(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """bf16_compress_hook itself. DDP refuses that hook, by its name, in a torch built without
    CUDA ("required CUDA 11+ and NCCL 2.10+"), whatever the backend; under another name it
    runs as it is, and any backend that reduces bfloat16 (Chorus, Gloo) serves it."""
    return default_hooks.bf16_compress_hook(state, bucket)


def register_hook(model, variant):
    if variant == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant == "bf16_hook":
        hook = default_hooks.bf16_compress_hook
        if torch.version.cuda is None and torch.version.hip is None:
            hook = bf16_compress_hook_any_build
        model.register_comm_hook(None, hook)
    elif variant == "powersgd":
        # Rank-1 approximation from the third step on (the first two all-reduce in full), with
        # error feedback: the usual setup, scaled down to a model this small.
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=2)
        model.register_comm_hook(state, powersgd.powerSGD_hook)


def train(variant, args, rank, dev):
    model = DDP(make_model().to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    register_hook(model, variant)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = (t.to(dev) for t in batch(step, rank))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces the gradient buckets here, through the hook if any
        opt.step()
        losses.append(harness.mean_over_ranks(loss, dev))
    return losses


def worker(args):
    rank, world, args.dev = harness.init(args.backend, args.device)
    losses = {v: train(v, args, rank, args.dev) for v in args.variants}
    harness.write(args, "ddp_train", losses, TOLERANCE,
                  {"tolerance_cross_device": TOLERANCE_CROSS_DEVICE})
    dist.destroy_process_group()


if __name__ == "__main__":
    harness.main(__doc__, VARIANTS, 8, worker, os.path.abspath(__file__))
