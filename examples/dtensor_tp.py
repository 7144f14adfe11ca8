"""Tensor parallelism over the "chorus" backend: an MLP block split across ranks with DTensor
(parallelize_module: the first Linear ColwiseParallel, the second RowwiseParallel) on a
DeviceMesh of every rank, eager and under torch.compile; and the same block written by hand
with functional collectives (torch.distributed._functional_collectives.all_reduce).

  torchrun --nproc-per-node 2 examples/dtensor_tp.py --out losses.json
  python examples/dtensor_tp.py --nproc 2 --compare gloo     # standalone, checked against Gloo

The change from a Gloo or NCCL script is one line: `import chorus` and
init_process_group("chorus"); init_device_mesh(device_type, (world,)) then builds its mesh on
the default group, so DTensor's collectives (and the compiled graph's) run over Chorus.

Every rank sees the same batch (tensor parallelism splits the weights, not the data), so the
loss is the same on every rank. Reference and tolerance (TOLERANCE): each curve matches a Gloo
run and the "single" curve, the unsplit model trained by rank 0 alone, within a relative 1e-5
(the row-parallel sum adds the ranks' partial products in another order than one matmul
does). "tp_compiled" is compared with the eager curves (a Gloo reference need not compile):
Inductor may fuse and reorder fp32 arithmetic, so 1e-4 relative. On CPU, compiling needs a
C++ compiler. With an empty Inductor cache the 2-rank run of tp_compiled alone took 93 s of
wall time on a 2-core machine that other jobs loaded (about 12 runnable processes):
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python examples/dtensor_tp.py --nproc 2 --variants tp_compiled
later runs hit the cache. CHORUS_EXAMPLE_COMPILE_BACKEND=aot_eager skips the code generation.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (launching, device choice, loss records: nothing TP-specific)

VARIANTS = ("tp", "tp_compiled", "funcol", "single")
TOLERANCE = {"tp": {"rtol": 1e-5}, "funcol": {"rtol": 1e-5}, "single": {"rtol": 1e-5},
             "tp_compiled": {"rtol": 1e-4, "ref": "tp"}}
TOLERANCE_CROSS_DEVICE = {v: {"rtol": 1e-3, **({"ref": "tp"} if v == "tp_compiled" else {})}
                          for v in VARIANTS}
SEED, BATCH, IN, HIDDEN = 3, 16, 32, 64
# torch.compile's backend for "tp_compiled": inductor (the default, generated C++ on the
# CPU), or aot_eager (the same traced forward and backward graphs with their functional
# collectives, run without code generation: what CI uses, to save Inductor's compile).
COMPILE_BACKEND = os.environ.get("CHORUS_EXAMPLE_COMPILE_BACKEND", "inductor")


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, IN))


def batch(step):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x * 1.5)


def tp_model(dev, compiled):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    model = parallelize_module(make_model().to(dev), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return (torch.compile(model, backend=COMPILE_BACKEND) if compiled else model,
            model.parameters())


class SumPartials(torch.autograd.Function):
    """Forward: the sum over ranks of each rank's partial product (a functional all_reduce).
    Backward: the gradient as it is. Every rank computes the same loss from the sum, so each
    partial's gradient is the sum's gradient (Megatron's "reduce from the tensor-parallel
    region"); differentiating the all_reduce itself would add the ranks' identical gradients
    and scale them by the world size."""

    @staticmethod
    def forward(ctx, partial):
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(partial, "sum", dist.group.WORLD))

    @staticmethod
    def backward(ctx, grad):
        return grad


class FuncolMLP(nn.Module):
    """The same block split by hand: rank r keeps rows [r*h, (r+1)*h) of the first weight and
    columns of the second; the second matmul's partial products are summed by SumPartials."""

    def __init__(self, full, rank, world):
        super().__init__()
        h = HIDDEN // world
        rows = slice(rank * h, (rank + 1) * h)
        self.w1 = nn.Parameter(full[0].weight.detach()[rows].clone())
        self.b1 = nn.Parameter(full[0].bias.detach()[rows].clone())
        self.w2 = nn.Parameter(full[2].weight.detach()[:, rows].clone())
        self.b2 = nn.Parameter(full[2].bias.detach().clone())

    def forward(self, x):
        partial = torch.tanh(x @ self.w1.t() + self.b1) @ self.w2.t()
        return SumPartials.apply(partial) + self.b2


def train(variant, args, rank, world, dev):
    if variant in ("tp", "tp_compiled"):
        model, params = tp_model(dev, variant == "tp_compiled")
    elif variant == "funcol":
        model = FuncolMLP(make_model(), rank, world).to(dev)
        params = model.parameters()
    else:
        model = make_model().to(dev)
        params = model.parameters()
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = (t.to(dev) for t in batch(step))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def worker(args):
    rank, world, args.dev = harness.init(args.backend, args.device)
    if HIDDEN % world:
        raise SystemExit(f"dtensor_tp: {HIDDEN} hidden units do not split over {world} ranks")
    losses = {}
    for v in args.variants:
        if v == "single":
            if rank == 0:  # no communication: the reference computation
                losses[v] = train(v, args, rank, world, args.dev)
        else:
            losses[v] = train(v, args, rank, world, args.dev)
            # Every rank computed the same loss; check that it did.
            mine = torch.tensor(losses[v], dtype=torch.float64, device=args.dev)
            lo, hi = mine.clone(), mine.clone()
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            if not torch.equal(lo, hi):
                raise SystemExit(f"dtensor_tp {v}: ranks disagree on the loss: {lo} vs {hi}")
    harness.write(args, "dtensor_tp", losses, TOLERANCE,
                  {"tolerance_cross_device": TOLERANCE_CROSS_DEVICE})
    dist.destroy_process_group()


if __name__ == "__main__":
    harness.main(__doc__, VARIANTS, 6, worker, os.path.abspath(__file__))
