"""tools/launch_cost.py - what launching one small async collective costs the caller, layer by
layer, in a one-rank group of BACKEND (docs/PERFORMANCE.md quotes it):

    python tools/launch_cost.py chorus      # or gloo

  dist.X      torch.distributed's Python function (argument checks, group lookups), then
  pg.X        the ProcessGroup's dispatch to the backend, then
  backend.X   the backend's own call (for Chorus: the binding and the core's post).
Each is the best of 3 rounds of 20000 launches (async_op=True, all waited afterwards),
in microseconds per launch; the differences are what each layer adds."""
import os
import sys
import time

import torch
import torch.distributed as dist


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    be = argv[0] if argv else "chorus"
    if be == "chorus":
        import chorus  # noqa: F401  (registers the backend)
    from chorus.bench import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(be, rank=0, world_size=1)
    t = torch.zeros(2)
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    bopts = dist.BroadcastOptions()
    bopts.rootRank, bopts.rootTensor, bopts.asyncOp = 0, 0, True
    aopts = dist.AllreduceOptions()
    aopts.asyncOp = True
    cases = {
        "dist.broadcast": lambda: dist.broadcast(t, 0, async_op=True),
        "pg.broadcast": lambda: pg.broadcast([t], bopts),
        "backend.broadcast": lambda: backend.broadcast([t], bopts),
        "dist.all_reduce": lambda: dist.all_reduce(t, async_op=True),
        "pg.allreduce": lambda: pg.allreduce([t], aopts),
        "backend.allreduce": lambda: backend.allreduce([t], aopts),
    }
    for name, f in cases.items():
        best = float("inf")
        for _ in range(3):
            works = []
            t0 = time.perf_counter()
            for _ in range(20000):
                works.append(f())
            t1 = time.perf_counter()
            for w in works:
                w.wait()
            best = min(best, (t1 - t0) / 20000 * 1e6)
        print(f"{be:7s} {name:20s} {best:6.2f} us per launch")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
