"""What the examples share and a user need not copy: starting N local ranks, choosing the
device, recording the per-step losses as JSON, and comparing two such records.

  python examples/harness.py compare GOT.json REF.json
      checks GOT's loss curves against REF's within the tolerances GOT's example states;
      exit code 0 when every curve matches, 1 otherwise (what scripts/gpu_check.sh runs)

Every example accepts the same harness flags:
  --backend NAME     torch.distributed backend (default chorus; gloo gives the reference)
  --device D         auto (cuda when torch sees a GPU, else cpu), cpu or cuda; on CUDA rank r
                     uses cuda:(LOCAL_RANK % device_count), so several ranks may share a GPU
  --steps N          training steps per variant
  --variants a,b     which of the example's variants to run (default: all), one process
                     group for all of them
  --out FILE         rank 0 writes {"losses": {variant: [loss per step]}, "tolerance": ...}
  --nproc N          standalone: start N local ranks (torch.distributed.run) instead of
                     being one; with --compare BACKEND the same run follows with BACKEND
                     (on --ref-device, default cpu) and the curves are compared
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist


def parser(doc, variants, steps):
    ap = argparse.ArgumentParser(description=doc.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=doc)
    ap.add_argument("--backend", default="chorus")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--variants", default=",".join(variants),
                    help=f"comma list of: {', '.join(variants)}")
    ap.add_argument("--out", help="rank 0 writes the per-step losses here (JSON)")
    ap.add_argument("--nproc", type=int, default=0, help="start this many local ranks")
    ap.add_argument("--compare", help="with --nproc: also run this backend and compare")
    ap.add_argument("--ref-device", default="cpu", help="device of the --compare run")
    return ap


def parse(ap, variants):
    args = ap.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in variants]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; known: {list(variants)}")
    return args


# ------------------------------------------------------------------ one rank
def init(backend, device):
    """init_process_group(backend) over env:// (torchrun's variables); returns (rank, world,
    torch.device). Importing chorus is all it takes to make "chorus" a backend name."""
    if "chorus" in backend:
        import chorus  # noqa: F401  (registers the backend)
    torch.set_num_threads(1)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device("cpu")
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), dev


def mean_over_ranks(value, device):
    """The mean over ranks of a scalar tensor (or float), as a Python float."""
    return sum_over_ranks(value, device) / dist.get_world_size()


def sum_over_ranks(value, device):
    """The sum over ranks of a scalar tensor (or float), as a Python float."""
    t = torch.as_tensor(value, dtype=torch.float64, device=device).detach().reshape(1).clone()
    dist.all_reduce(t)
    return t.item()


def write(args, example, losses, tolerance, extra=None):
    """Rank 0 writes the record the tests and `harness.py compare` read."""
    if dist.get_rank() != 0:
        return
    rec = {"example": example, "backend": args.backend, "world": dist.get_world_size(),
           "device": args.dev.type,
           "steps": args.steps, "losses": losses, "tolerance": tolerance}
    rec.update(extra or {})
    for v, curve in losses.items():
        print(f"{example} {v}: " + " ".join(f"{x:.6f}" for x in curve), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)


# ------------------------------------------------------------------ comparing two records
def compare(got, ref):
    """Problems (strings) found checking every curve of `got` against `ref`. A variant's
    tolerance entry is {"rtol": r, "atol": a, "ref": name-in-ref (default: the same name)};
    "cross_device" holds the entries used when the two ran on different devices."""
    problems = []
    tol_table = got["tolerance"]
    if got.get("device") != ref.get("device"):
        tol_table = {**tol_table, **got.get("tolerance_cross_device", {})}
    for variant, curve in got["losses"].items():
        tol = tol_table[variant]
        ref_name = tol.get("ref", variant)
        if ref_name not in ref["losses"]:
            problems.append(f"{variant}: the reference has no curve {ref_name!r}")
            continue
        ref_curve = ref["losses"][ref_name]
        if len(curve) != len(ref_curve):
            problems.append(f"{variant}: {len(curve)} steps, reference {len(ref_curve)}")
            continue
        for step, (a, b) in enumerate(zip(curve, ref_curve)):
            bound = tol.get("rtol", 0.0) * abs(b) + tol.get("atol", 0.0)
            if not abs(a - b) <= bound:  # NaN fails
                problems.append(f"{variant}: step {step}: loss {a!r}, reference {ref_name} "
                                f"{b!r}: |diff| {abs(a - b):.3g} > {bound:.3g}")
                break
    return problems


def compare_files(got_path, ref_path):
    with open(got_path) as f:
        got = json.load(f)
    with open(ref_path) as f:
        ref = json.load(f)
    problems = compare(got, ref)
    name = f"{got['example']} {got['backend']}/{got['device']} vs {ref['backend']}/{ref['device']}"
    for p in problems:
        print(f"MISMATCH {name}: {p}")
    if not problems:
        print(f"{name}: {len(got['losses'])} curves match within the stated tolerance")
    return not problems


# ------------------------------------------------------------------ standalone launcher
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _strip(argv, flags):
    """argv without the given flags (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def launch(script, args):
    """--nproc N: runs N local ranks of `script` through torch.distributed.run, then, with
    --compare, the reference run, and compares. Returns the process exit code."""
    base = _strip(sys.argv[1:], {"--nproc", "--compare", "--ref-device", "--out",
                                 "--backend", "--device"})
    runs = [(args.backend, args.device)]
    if args.compare:
        runs.append((args.compare, args.ref_device))
    # the records of runs without --out live only as long as the comparison
    with tempfile.TemporaryDirectory(prefix="chorus-example-") as tmp:
        return _launch_runs(script, args, base, runs, tmp)


def _launch_runs(script, args, base, runs, tmp):
    outs = []
    for i, (backend, device) in enumerate(runs):
        out = args.out if (i == 0 and args.out) else os.path.join(tmp, f"{backend}-{i}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.nproc), "--nnodes", "1", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), script, *base, "--backend", backend,
               "--device", device, "--out", out]
        print(f"== {os.path.basename(script)}: {args.nproc} ranks, backend {backend}, "
              f"device {device}", flush=True)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if device == "cpu":
            # A CPU run sees no GPU: torch's PowerSGD hook, for one, synchronises CUDA (with
            # the CPU tensor's device, which fails) whenever CUDA is available.
            env["CUDA_VISIBLE_DEVICES"] = ""
        rc = subprocess.call(cmd, env=env)
        if rc != 0:
            print(f"== backend {backend}: FAILED (exit code {rc})", flush=True)
            return rc
        outs.append(out)
    if len(outs) == 2:
        return 0 if compare_files(*outs) else 1
    return 0


def main(doc, variants, steps, worker, script):
    """Entry point of an example: one rank (under torchrun) or the --nproc launcher."""
    args = parse(parser(doc, variants, steps), variants)
    if args.nproc:
        sys.exit(launch(script, args))
    worker(args)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(0 if compare_files(sys.argv[2], sys.argv[3]) else 1)
    print(__doc__)
    sys.exit(2)
