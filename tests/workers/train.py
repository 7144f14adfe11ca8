"""Small deterministic training runs for the DDP / FSDP2 checks.

  train.py ddp  OUT     (under tests/launch.py, one process per rank) DistributedDataParallel
  train.py fsdp OUT     (same) FSDP2 fully_shard on every Linear and on the root
  train.py both PREFIX  (same) ddp then fsdp in one process group: PREFIX-ddp.pt, PREFIX-fsdp.pt
  train.py single OUT WORLD   one process, no torch.distributed: the same model trained on all
                              ranks' batches with the mean of the per-rank losses, which is what
                              DDP and FSDP compute in exact arithmetic

CHORUS_TRAIN_DEVICE=cuda trains the distributed runs on CUDA (rank r on cuda:LOCAL_RANK % the
device count, so several ranks may share one GPU); inputs are still drawn on the CPU, so every
device sees the same numbers.

Each writes OUT (rank 0; per-rank losses gathered through files) as a torch.save'd dict:
{"losses": [step][rank] floats, "params": {name: tensor}}.
"""
import os
import sys

import torch
import torch.nn as nn

STEPS = 20
BATCH = 8
SEED = 1234


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def batch(step, rank):
    g = torch.Generator().manual_seed(SEED * 7919 + step * 131 + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loss_fn(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def run_single(out, world):
    torch.set_num_threads(1)
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = [loss_fn(model, *batch(step, r)) for r in range(world)]
        losses.append([x.item() for x in per_rank])
        (sum(per_rank) / world).backward()
        opt.step()
    torch.save({"losses": losses, "params": {k: v.detach().clone() for k, v in
                                             model.state_dict().items()}}, out)


def run_distributed(modes, prefix):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import init_dist  # noqa: E402  (imports chorus when it is the backend)
    import torch.distributed as dist

    init_dist()
    for mode in modes:
        train_distributed(mode, prefix if len(modes) == 1 else f"{prefix}-{mode}.pt")
    dist.barrier()
    dist.destroy_process_group()


def train_distributed(mode, out):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cpu")
    if os.environ.get("CHORUS_TRAIN_DEVICE", "cpu") == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) %
                           torch.cuda.device_count())
        torch.cuda.set_device(dev)
    model = make_model().to(dev)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        # Small buckets: several all_reduces per step, finishing in a different order.
        model = DDP(model, bucket_cap_mb=0.01)
    else:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # older torch
            from torch.distributed._composable.fsdp import fully_shard
        kw = {}
        if dev.type == "cuda":
            from torch.distributed.device_mesh import init_device_mesh
            kw["mesh"] = init_device_mesh("cuda", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, **kw)
        fully_shard(model, **kw)
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, *(x.to(dev) for x in batch(step, rank)))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if hasattr(v, "full_tensor") else v  # FSDP2 holds DTensor shards
        params[k.replace("module.", "", 1)] = v.detach().cpu().clone()
    gathered = [None] * world
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        torch.save({"losses": [list(x) for x in zip(*gathered)], "params": params}, out)


if __name__ == "__main__":
    if sys.argv[1] == "single":
        run_single(sys.argv[2], int(sys.argv[3]))
    else:
        run_distributed(["ddp", "fsdp"] if sys.argv[1] == "both" else [sys.argv[1]], sys.argv[2])
