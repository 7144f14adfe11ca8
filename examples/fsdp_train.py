"""FSDP over the "chorus" backend: FSDP1 (FullyShardedDataParallel) and FSDP2 (fully_shard),
each with the usual mixed precision, bf16 parameters for compute and fp32 gradient reduction
(FSDP1 MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), FSDP2
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), and each in plain fp32; all
variants in one process group, one after the other.

  torchrun --nproc-per-node 2 examples/fsdp_train.py --out losses.json
  python examples/fsdp_train.py --nproc 2 --compare gloo     # standalone, checked against Gloo

The change from a Gloo or NCCL script is one line: `import chorus` and
init_process_group("chorus"). FSDP2's mesh is init_device_mesh(device_type, (world,)), which
takes the default group, so it runs over Chorus too. What the backend sees: all_gather_into_tensor
of the flat (FSDP1) or per-parameter (FSDP2) shards, reduce_scatter_tensor with SUM and
explicit pre/post division (FSDP1) or with AVG (FSDP2).

CPU: both run on CPU in torch 2.13 (FSDP1 with device_id=torch.device("cpu"); bf16 matmuls
run on the CPU too, slowly on old CPUs).

Tolerance (TOLERANCE, checked by tests/test_examples.py): the per-step loss, averaged over
ranks, matches a Gloo run within a relative 1e-5 in fp32 (only the summation order of the
fp32 reduction may differ) and 2e-3 with bf16 parameters (a last-bit difference of an fp32
master weight can round its bf16 copy one bf16 ulp, 2^-8, apart).
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (launching, device choice, loss records: nothing FSDP-specific)

VARIANTS = ("fsdp1_bf16", "fsdp2_bf16", "fsdp1_fp32", "fsdp2_fp32")
TOLERANCE = {"fsdp1_bf16": {"rtol": 2e-3}, "fsdp2_bf16": {"rtol": 2e-3},
             "fsdp1_fp32": {"rtol": 1e-5}, "fsdp2_fp32": {"rtol": 1e-5}}
TOLERANCE_CROSS_DEVICE = {"fsdp1_bf16": {"rtol": 2e-2}, "fsdp2_bf16": {"rtol": 2e-2},
                          "fsdp1_fp32": {"rtol": 1e-3}, "fsdp2_fp32": {"rtol": 1e-3}}
SEED, BATCH, IN, HIDDEN, OUT = 11, 16, 32, 64, 8


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step, rank):
    g = torch.Generator().manual_seed(SEED * 1000 + step * 64 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 1.5)


def wrap_fsdp1(model, dev, bf16):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    # One FSDP unit per Linear and one for the root, so that several all_gathers and
    # reduce_scatters of different sizes run per step.
    return FSDP(model, device_id=dev, mixed_precision=mp,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def wrap_fsdp2(model, dev, bf16):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    kw = {"mesh": mesh}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def train(variant, args, rank, dev):
    kind, precision = variant.split("_")
    model = make_model().to(dev)
    model = (wrap_fsdp1 if kind == "fsdp1" else wrap_fsdp2)(model, dev, precision == "bf16")
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = (t.to(dev) for t in batch(step, rank))
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(harness.mean_over_ranks(loss, dev))
    return losses


def worker(args):
    rank, world, args.dev = harness.init(args.backend, args.device)
    losses = {v: train(v, args, rank, args.dev) for v in args.variants}
    harness.write(args, "fsdp_train", losses, TOLERANCE,
                  {"tolerance_cross_device": TOLERANCE_CROSS_DEVICE})
    dist.destroy_process_group()


if __name__ == "__main__":
    harness.main(__doc__, VARIANTS, 8, worker, os.path.abspath(__file__))
