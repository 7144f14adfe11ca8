"""DeepSpeed ZeRO over the "chorus" backend: stages 1, 2 and 3, each with overlap_comm and
contiguous_gradients, one after the other in one process group.

  torchrun --nproc-per-node 2 examples/deepspeed_zero.py --out losses.json
  python examples/deepspeed_zero.py --nproc 2 --compare gloo   # standalone, checked against Gloo

The change from a DeepSpeed script: `import chorus` and dist.init_process_group("chorus")
before deepspeed.initialize. DeepSpeed then finds torch.distributed initialized and runs every
collective (all_gather_into_tensor, reduce_scatter_tensor, all_reduce, broadcast, ...) on that
group instead of opening its own (deepspeed.init_distributed(dist_backend="chorus") does the
same).

CPU: DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, set here when the device is the CPU)
needs neither intel_extension_for_pytorch nor oneCCL; it asks for "gloo" as its own backend,
which it never opens here since the group exists already. Its shared-memory all-reduce for
inference, which it would compile with g++ at start-up, is switched off (see worker()). The optimizer is torch.optim's Adam
("torch_adam": true) so that no DeepSpeed C++/CUDA op has to be compiled; the DeepSpeed
wheel needs no build of ops either (DS_BUILD_OPS unset). Training is fp32 (bf16 / fp16
engines work the same way over Chorus but add their own loss scaling or casts).

Tolerance (TOLERANCE, checked by tests/test_examples.py): each stage's per-step loss,
averaged over ranks, matches a Gloo run of this script within a relative 1e-5 (fp32; the
reductions may differ only in summation order). The three stages compute the same training
in exact arithmetic; tests/test_examples.py also holds them to 1e-4 of each other.
"""
import importlib
import logging
import os
import sys
import types

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (launching, device choice, loss records: nothing DeepSpeed-specific)

VARIANTS = ("zero1", "zero2", "zero3")
TOLERANCE = {v: {"rtol": 1e-5} for v in VARIANTS}
TOLERANCE_CROSS_DEVICE = {v: {"rtol": 1e-3} for v in VARIANTS}
SEED, BATCH, IN, HIDDEN, OUT = 13, 16, 32, 64, 8


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def batch(step, rank):
    g = torch.Generator().manual_seed(SEED * 1000 + step * 64 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 1.5)


def ds_config(stage):
    # Small buckets so that each step runs several reduce / gather buckets, overlapped.
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": 2048, "allgather_bucket_size": 2048}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2048,
                    stage3_max_live_parameters=4096)
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "torch_adam": True}},
            "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def train(variant, args, rank, dev):
    import deepspeed

    model = make_model().to(dev)
    # DeepSpeed puts each rank on cuda:LOCAL_RANK unless told (device_rank), and ZeRO-3's
    # parameter partitioning takes its device from LOCAL_RANK alone: both name the device
    # the harness chose, so that several ranks may share one GPU
    ds_args = None
    if dev.type == "cuda":
        ds_args = types.SimpleNamespace(device_rank=dev.index)
        os.environ["LOCAL_RANK"] = str(dev.index)
    engine, _, _, _ = deepspeed.initialize(args=ds_args, model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(int(variant[-1])))
    losses = []
    for step in range(args.steps):
        x, y = (t.to(dev) for t in batch(step, rank))
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(harness.mean_over_ranks(loss, dev))
    engine.destroy()
    return losses


def worker(args):
    rank, world, args.dev = harness.init(args.backend, args.device)
    # DeepSpeed picks its accelerator on first import: the CPU one when we train on the CPU.
    os.environ.setdefault("DS_ACCELERATOR", args.dev.type)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    if args.dev.type == "cpu":
        # On the CPU, DeepSpeed's communication wrapper compiles (g++, once per machine) and
        # starts a shared-memory all-reduce of its own at start-up, which only its inference
        # path (inference_all_reduce) uses: training collectives go to torch.distributed, here
        # Chorus. The compile took minutes on a 2-core machine, so it is skipped here. The
        # module is taken from sys.modules: `import deepspeed.comm.torch as m` would bind m to
        # torch itself, which deepspeed.comm re-exports under that name.
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
        ds_comm_torch.build_shm_op = lambda: None
    losses = {v: train(v, args, rank, args.dev) for v in args.variants}
    harness.write(args, "deepspeed_zero", losses, TOLERANCE,
                  {"tolerance_cross_device": TOLERANCE_CROSS_DEVICE})
    dist.destroy_process_group()


if __name__ == "__main__":
    harness.main(__doc__, VARIANTS, 6, worker, os.path.abspath(__file__))
