"""A pipeline over the "chorus" backend: the layers of one model split into as many stages as
there are ranks (2 to 4), micro-batches passed between neighbouring stages with
dist.batch_isend_irecv: activations forward, their gradients backward (a GPipe schedule:
every micro-batch forward, then every micro-batch backward, then one optimizer step).

  torchrun --nproc-per-node 4 examples/pipeline_p2p.py --out losses.json
  python examples/pipeline_p2p.py --nproc 4 --compare gloo   # standalone, checked against Gloo

Each batch_isend_irecv call holds a send and a receive at once (this stage's output of
micro-batch i goes on while micro-batch i+1's input comes in), so the backend must progress
both together; Chorus runs such a batch as one coalesced group of point-to-point operations.

Reference and tolerance (TOLERANCE): the pipeline computes exactly the operations of the whole
model on one process, in the same order, and p2p moves bytes unchanged, so its per-step loss
matches (relative 1e-6) both a Gloo run and the "single" curve, which rank 0 computes
alone, without communication, on the whole model.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (launching, device choice, loss records: nothing pipeline-specific)

VARIANTS = ("gpipe", "single")
TOLERANCE = {"gpipe": {"rtol": 1e-6}, "single": {"rtol": 1e-6}}
TOLERANCE_CROSS_DEVICE = {"gpipe": {"rtol": 1e-4}, "single": {"rtol": 1e-4}}
SEED, BATCH, MICRO, WIDTH, BLOCKS = 5, 32, 4, 48, 4


def make_blocks():
    """The whole model as a list of blocks; stage s of S owns blocks [s*B/S, (s+1)*B/S)."""
    torch.manual_seed(SEED)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS - 1)]
    return blocks + [nn.Linear(WIDTH, WIDTH)]


def stage_of(blocks, stage, stages):
    per = len(blocks) // stages
    extra = len(blocks) % stages  # the first `extra` stages take one block more
    start = stage * per + min(stage, extra)
    return nn.Sequential(*blocks[start:start + per + (1 if stage < extra else 0)])


def batch(step):
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.cos(x * 2.0)


def train_pipeline(args, rank, world, dev):
    if world > BLOCKS:
        raise SystemExit(f"pipeline_p2p: at most {BLOCKS} stages (ranks), got {world}")
    stage = stage_of(make_blocks(), rank, world).to(dev)
    first, last = rank == 0, rank == world - 1
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = (t.to(dev) for t in batch(step))
        xs, ys = x.chunk(MICRO), y.chunk(MICRO)
        opt.zero_grad()
        # Forward: receive micro-batch 0's input, then for each micro-batch compute, and
        # send its output together with receiving the next micro-batch's input.
        inputs, outputs, loss_sum = [], [], 0.0
        nxt = None if first else torch.empty_like(xs[0])
        if not first:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, nxt, rank - 1)]):
                w.wait()
        for i in range(MICRO):
            inp = xs[i] if first else nxt.requires_grad_()
            out = stage(inp)
            inputs.append(inp)
            outputs.append(out)
            ops = []
            if not last:
                ops.append(dist.P2POp(dist.isend, out.detach(), rank + 1))
            if not first and i + 1 < MICRO:
                nxt = torch.empty_like(xs[0])
                ops.append(dist.P2POp(dist.irecv, nxt, rank - 1))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        # Backward, micro-batch by micro-batch in the same order: the last stage starts from
        # its loss; the others from the output gradient the next stage sends back.
        grad = None if last else torch.empty_like(outputs[0])
        if not last:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad, rank + 1)]):
                w.wait()
        for i in range(MICRO):
            if last:
                loss = nn.functional.mse_loss(outputs[i], ys[i]) / MICRO
                loss.backward()
                loss_sum += loss.item()
            else:
                outputs[i].backward(grad)
            ops = []
            if not first:
                ops.append(dist.P2POp(dist.isend, inputs[i].grad, rank - 1))
            if not last and i + 1 < MICRO:
                grad = torch.empty_like(outputs[0])
                ops.append(dist.P2POp(dist.irecv, grad, rank + 1))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        opt.step()
        losses.append(harness.sum_over_ranks(loss_sum if last else 0.0, dev))
    return losses


def train_single(args, dev):
    """The whole model on this process, the same micro-batches in the same order."""
    model = nn.Sequential(*make_blocks()).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(args.steps):
        x, y = (t.to(dev) for t in batch(step))
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
            loss = nn.functional.mse_loss(model(xm), ym) / MICRO
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def worker(args):
    rank, world, args.dev = harness.init(args.backend, args.device)
    losses = {}
    if "gpipe" in args.variants:
        losses["gpipe"] = train_pipeline(args, rank, world, args.dev)
    if "single" in args.variants and rank == 0:
        losses["single"] = train_single(args, args.dev)
    harness.write(args, "pipeline_p2p", losses, TOLERANCE,
                  {"tolerance_cross_device": TOLERANCE_CROSS_DEVICE})
    dist.destroy_process_group()


if __name__ == "__main__":
    harness.main(__doc__, VARIANTS, 6, worker, os.path.abspath(__file__))
