"""DDP training on CPU with 4 ranks through torchrun, once with the "chorus" backend and once
with "gloo" (same seed, same data), then a side-by-side comparison.

  python examples/ddp_demo.py                 driver (what `make demo` runs): both backends
  python examples/ddp_demo.py --backends gloo one backend only
  torchrun --nproc-per-node 4 examples/ddp_demo.py --worker --backend chorus --out r.pt
                                              one rank of one run (what the driver starts)

The model is an MLP of about 8.7 M fp32 parameters, so every step all-reduces ~35 MB of
gradients (in 25 MB DDP buckets); the batch is small so that communication is a visible part
of the step on a 2-core machine.
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

SEED = 2024
IN, HIDDEN, OUT = 1024, 2048, 256


def make_model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 1024), nn.ReLU(), nn.Linear(1024, OUT))


def batch(step, rank, size):
    g = torch.Generator().manual_seed(SEED * 1000 + step * 16 + rank)
    x = torch.randn(size, IN, generator=g)
    return x, torch.tanh(x[:, :OUT] * 2.0)  # a learnable target


def worker(args):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.backend == "chorus":
        import chorus  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    losses, times = [], []
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        x, y = batch(step, rank, args.batch)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0:
        params = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({"losses": losses, "times": times, "params": params,
                    "nparams": sum(p.numel() for p in params.values())}, args.out)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_backend(backend, args, tmp):
    out = os.path.join(tmp, f"{backend}.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.abspath(__file__), "--worker", "--backend", backend, "--out", out,
           "--steps", str(args.steps), "--batch", str(args.batch)]
    print(f"== {backend}: {' '.join(cmd[3:7])} ...", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rc = subprocess.call(cmd, env=env)
    if rc != 0 or not os.path.exists(out):
        print(f"== {backend}: FAILED (exit code {rc})", flush=True)
        return None
    return torch.load(out)


def driver(args):
    with tempfile.TemporaryDirectory(prefix="chorus-demo-") as tmp:
        results = {b: run_backend(b, args, tmp) for b in args.backends}
    ok = {b: r for b, r in results.items() if r is not None}
    if ok:
        names = list(ok)
        first = next(iter(ok.values()))
        print(f"\nDDP, {args.nproc} ranks on CPU, {first['nparams'] / 1e6:.1f} M parameters "
              f"({first['nparams'] * 4 / 1e6:.0f} MB of fp32 gradients per step), "
              f"batch {args.batch} per rank")
        print("step " + "".join(f"{'loss ' + b:>16s}" for b in names)
              + "".join(f"{'s/step ' + b:>16s}" for b in names))
        for step in range(args.steps):
            print(f"{step:4d} " + "".join(f"{ok[b]['losses'][step]:16.6f}" for b in names)
                  + "".join(f"{ok[b]['times'][step]:16.3f}" for b in names))
        for b in names:
            t = ok[b]["times"][1:]  # step 0 includes DDP's first-bucket setup
            print(f"{b}: {sum(t) / len(t):.3f} s per step (mean of steps 1-{args.steps - 1})")
        if len(ok) == 2:
            a, b = (ok[n]["params"] for n in names)
            diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
            scale = max(float(b[k].abs().max()) for k in b)
            print(f"largest parameter difference {names[0]} vs {names[1]}: {diff:.3g} "
                  f"(largest parameter magnitude {scale:.3g})")
    failed = [b for b, r in results.items() if r is None]
    if failed:
        print(f"failed: {', '.join(failed)}")
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="run as one torchrun rank")
    ap.add_argument("--backend", default="chorus")
    ap.add_argument("--backends", default="chorus,gloo", help="driver: comma list, run in order")
    ap.add_argument("--out", help="worker: where rank 0 saves losses, times and parameters")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        args.backends = args.backends.split(",")
        driver(args)


if __name__ == "__main__":
    main()
