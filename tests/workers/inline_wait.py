"""A rank of tests/test_inline_wait.py. CHORUS_TEST_PART picks what it does; each part prints
one RESULT line (JSON) for the test to judge.

- cpu: N blocking one-element all_reduces, then the CPU time (ns, from schedstat) that this
  process's chorus-engine threads and the calling thread spent during them.
- unwaited: rank 0 posts an all_reduce it neither waits for nor polls and sleeps; the other
  ranks time their blocking all_reduce (the engine must start rank 0's within a nap).
- mixed: async collectives waited out of order, from two threads, with point-to-point
  messages in flight and is_completed() polling; every result checked."""
import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import chorus  # noqa: F401  (registers the backend)

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
part = os.environ["CHORUS_TEST_PART"]


def threads_named(name):
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == name:
                    tids.append(tid)
        except OSError:
            pass
    return tids


def cpu_ns(tid):
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


def part_cpu():
    n = int(os.environ.get("CHORUS_TEST_OPS", "2000"))
    t = torch.ones(1)
    for _ in range(50):
        dist.all_reduce(t)
    engines = threads_named("chorus-engine")
    me = str(threading.get_native_id())
    before = {tid: cpu_ns(tid) for tid in engines + [me]}
    t0 = time.perf_counter()
    for _ in range(n):
        t.fill_(rank + 1)
        dist.all_reduce(t)
    elapsed = time.perf_counter() - t0
    ok = t.item() == world * (world + 1) / 2
    return {"correct": ok, "engines": len(engines), "ops": n, "elapsed_s": elapsed,
            "engine_ns": sum(cpu_ns(tid) - before[tid] for tid in engines),
            "caller_ns": cpu_ns(me) - before[me]}


def part_unwaited():
    t = torch.full((4,), float(rank + 1))
    dist.barrier()
    if rank == 0:
        time.sleep(0.005)  # the engine naps by now (it does for 20 ms after a collective)
        w = dist.all_reduce(t, async_op=True)
        time.sleep(2.0)  # neither waited nor polled meanwhile
        w.wait()
        return {"correct": torch.all(t == world * (world + 1) / 2).item()}
    t0 = time.perf_counter()
    dist.all_reduce(t)
    return {"correct": torch.all(t == world * (world + 1) / 2).item(),
            "blocked_s": time.perf_counter() - t0}


def part_mixed():
    ok = True
    total = world * (world + 1) / 2
    for rnd in range(30):
        size = (1, 1000, 70000)[rnd % 3]
        ts = [torch.full((size,), float((rank + 1) * (k + 1))) for k in range(6)]
        works = [dist.all_reduce(x, async_op=True) for x in ts]
        # a point-to-point exchange around the ring, in flight while collectives run
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        sbuf = torch.full((257,), float(rank * 1000 + rnd))
        rbuf = torch.empty(257)
        p2p = dist.batch_isend_irecv([dist.P2POp(dist.isend, sbuf, nxt),
                                      dist.P2POp(dist.irecv, rbuf, prv)])
        # the last first (runs the earlier ones too), the rest from two threads, one polled
        works[5].wait()
        while not works[4].is_completed():
            time.sleep(0.0001)
        errors = []

        def wait_some(ks):
            try:
                for k in ks:
                    works[k].wait()
            except Exception as e:  # reported below
                errors.append(repr(e))

        th = [threading.Thread(target=wait_some, args=(ks,)) for ks in ((0, 2), (1, 3))]
        for x in th:
            x.start()
        for x in th:
            x.join()
        for w in p2p:
            w.wait()
        ok = ok and not errors
        ok = ok and all(torch.all(ts[k] == total * (k + 1)).item() for k in range(6))
        ok = ok and torch.all(rbuf == float(prv * 1000 + rnd)).item()
        # a blocking broadcast from a rotating root right after
        b = torch.full((33,), float(rank))
        dist.broadcast(b, src=rnd % world)
        ok = ok and torch.all(b == float(rnd % world)).item()
    return {"correct": bool(ok)}


dist.init_process_group("chorus", timeout=timedelta(seconds=60))
res = {"cpu": part_cpu, "unwaited": part_unwaited, "mixed": part_mixed}[part]()
res["rank"] = rank
print("RESULT " + json.dumps(res), flush=True)
dist.destroy_process_group()
