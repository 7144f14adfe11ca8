"""Rank worker for the CUDA path: every collective and point-to-point op on CUDA tensors,
checked against the CPU reference of common.py (every rank regenerates every rank's input).
All ranks may share one GPU (cuda:LOCAL_RANK % device_count). Also checks the stream
semantics (the op runs after the caller's queued work, the host is not blocked, wait() orders
the caller's stream) and one process group carrying CPU and CUDA tensors in turn.

Prints "CHECKS <passed> passed <failed> failed" and one "FAIL ..." line per failure; exits 1
on any failure. usage: cuda_checks.py [--quick]
"""
import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import float8  # noqa: E402
from common import (DTYPES, allreduce_behind_sleep, compare, init_dist, kind_for,  # noqa: E402
                    make_data, ops_for, poison_like, premul_factor, reference_reduce,
                    torch_op)

passed = 0
failed = []


def check(name, fn, *args):
    global passed
    try:
        msg = fn(*args)
    except Exception:  # noqa: BLE001 - a raising case is a failing case, the rest still run
        msg = "raised:\n" + traceback.format_exc()
        # An exception inside torch's _coalescing_manager (batch_isend_irecv) leaves the group
        # marked as coalescing, and every later collective would only be queued: clear it so
        # that one failure does not hide behind a cascade of others.
        dist.distributed_c10d._world.pg_coalesce_state.clear()
    if msg:
        failed.append(f"{name}: {msg}")
        print(f"FAIL {name}: {msg}", flush=True)
    else:
        passed += 1


def reduced(key, dt, op, world, n):
    kind = kind_for(dt, op)
    inputs = [make_data(key, q, n, dt, kind) for q in range(world)]
    factors = [premul_factor(op, q) for q in range(world)] if op.startswith("PREMUL") else None
    expected, tol = reference_reduce(inputs, dt, op, factors)
    return inputs, expected, tol


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer dtypes and sizes")
    args = ap.parse_args()
    # torchrun's recipe: the device first, then the group (which finds the CUDA context and
    # loads chorus's kernels then, before any GPU work: docs/design.md, CUDA path)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    rank, world = init_dist()
    # Set by tests/test_cuda.py where every collective checked here runs on the shared-GPU
    # path, which never holds the host for the GPU; the other paths move data through the
    # host and wait for it by design.
    host_free = os.environ.get("CHORUS_TEST_HOST_FREE") == "1"

    def not_blocked(label):
        # A plain (synchronous) all_reduce behind ~100 ms of GPU work returns to Python long
        # before that work ends, as with NCCL; the result is right once the stream gets there.
        host_s, gpu_s, ok = allreduce_behind_sleep(rank, world, dev)
        if not ok:
            return f"{label}: wrong all_reduce result"
        if host_free and host_s > 0.05:
            return (f"{label}: the host was blocked for {host_s * 1e3:.0f} ms of the "
                    f"{gpu_s * 1e3:.0f} ms the GPU needed")
        return None

    # the very first device collective (it also sets up the CUDA state and IPC mappings)
    check("host not blocked (first collective)", not_blocked, "first")

    big = int(os.environ.get("CHORUS_TEST_CUDA_BIG", "300001"))
    sizes = [0, 1, 7, 4099, big]
    dtypes = DTYPES if not args.quick else {k: DTYPES[k] for k in ("float32", "bfloat16", "int64")}
    on = lambda t: t.to(dev)  # noqa: E731

    # ---------------------------------------------------------------- reductions
    def all_reduce(dt, op, n, key):
        inputs, expected, tol = reduced(key, dt, op, world, n)
        t = on(inputs[rank])
        dist.all_reduce(t, op=torch_op(op, dt, rank))
        return compare(t.cpu(), expected, tol)

    def reduce(dt, op, n, key, root):
        inputs, expected, tol = reduced(key, dt, op, world, n)
        t = on(inputs[rank])
        dist.reduce(t, dst=root, op=torch_op(op, dt, rank))
        return compare(t.cpu(), expected, tol) if rank == root else compare(t.cpu(), inputs[rank])

    def reduce_scatter_tensor(dt, op, n, key, inplace):
        inputs, expected, tol = reduced(key, dt, op, world, n * world)
        inp = on(inputs[rank])
        out = inp[rank * n:(rank + 1) * n] if inplace else on(poison_like(expected[:n], dt))
        dist.reduce_scatter_tensor(out, inp, op=torch_op(op, dt, rank))
        mine = expected[rank * n:(rank + 1) * n]
        return compare(out.cpu(), mine, None if tol is None else
                       (tol if tol[0] == "ulp" else ("abs", tol[1][rank * n:(rank + 1) * n])))

    def reduce_scatter_list(dt, op, n, key):
        inputs, expected, tol = reduced(key, dt, op, world, n * world)
        ins = [on(c) for c in inputs[rank].chunk(world)] if n else \
            [on(inputs[rank]) for _ in range(world)]
        out = on(poison_like(expected[:n], dt))
        dist.reduce_scatter(out, ins, op=torch_op(op, dt, rank))
        mine = expected[rank * n:(rank + 1) * n]
        return compare(out.cpu(), mine, None if tol is None else
                       (tol if tol[0] == "ulp" else ("abs", tol[1][rank * n:(rank + 1) * n])))

    for dname, dt in dtypes.items():
        for n in sizes:
            for op in ops_for(dt):
                key = ("ar", dname, n, op)
                check(f"all_reduce {dname} {op} n={n}", all_reduce, dt, op, n, key)
            for op in ("SUM", "MAX") if dt is not torch.bool else ("SUM",):
                root = n % world
                check(f"reduce {dname} {op} n={n} root={root}", reduce, dt, op, n,
                      ("rd", dname, n, op), root)
                m = n // world + 1 if n else 0
                for inplace in (False, True):
                    check(f"reduce_scatter_tensor {dname} {op} n={m} inplace={inplace}",
                          reduce_scatter_tensor, dt, op, m, ("rs", dname, n, op), inplace)
                check(f"reduce_scatter list {dname} {op} n={m}", reduce_scatter_list, dt, op, m,
                      ("rsl", dname, n, op))

    # ---------------------------------------------------------------- data movement
    def broadcast(dt, n, key, root):
        expected = make_data(key, root, n, dt)
        t = on(expected) if rank == root else on(poison_like(expected))
        dist.broadcast(t, src=root)
        return compare(t.cpu(), expected)

    def all_gather_into(dt, n, key, inplace):
        ins = [make_data(key, q, n, dt) for q in range(world)]
        expected = torch.cat(ins)
        out = on(poison_like(expected))
        if inplace:
            inp = out[rank * n:(rank + 1) * n]
            inp.copy_(on(ins[rank]))
        else:
            inp = on(ins[rank])
        dist.all_gather_into_tensor(out, inp)
        return compare(out.cpu(), expected)

    def all_gather_list(dt, n, key):
        ins = [make_data(key, q, n + q, dt) for q in range(world)]  # uneven sizes
        outs = [on(poison_like(x)) for x in ins]
        dist.all_gather(outs, on(ins[rank]))
        for q in range(world):
            msg = compare(outs[q].cpu(), ins[q], label=f"output[{q}]: ")
            if msg:
                return msg
        return None

    def all_to_all_single(dt, n, key, splits):
        # block (q -> p): make_data((key, q, p)) of length len_(q, p)
        length = (lambda q, p: n + (q + 2 * p) % 3) if splits else (lambda q, p: n)
        send = torch.cat([make_data(key + (rank, p), 0, length(rank, p), dt)
                          for p in range(world)])
        expected = torch.cat([make_data(key + (q, rank), 0, length(q, rank), dt)
                              for q in range(world)])
        out = on(poison_like(expected))
        if splits:
            dist.all_to_all_single(out, on(send),
                                   output_split_sizes=[length(q, rank) for q in range(world)],
                                   input_split_sizes=[length(rank, p) for p in range(world)])
        else:
            dist.all_to_all_single(out, on(send))
        return compare(out.cpu(), expected)

    def all_to_all_list(dt, n, key):
        ins = [on(make_data(key + (rank, p), 0, n, dt)) for p in range(world)]
        exp = [make_data(key + (q, rank), 0, n, dt) for q in range(world)]
        outs = [on(poison_like(e)) for e in exp]
        dist.all_to_all(outs, ins)
        for q in range(world):
            msg = compare(outs[q].cpu(), exp[q], label=f"output[{q}]: ")
            if msg:
                return msg
        return None

    def gather(dt, n, key, root):
        ins = [make_data(key, q, n, dt) for q in range(world)]
        outs = [on(poison_like(x)) for x in ins] if rank == root else None
        dist.gather(on(ins[rank]), gather_list=outs, dst=root)
        if rank != root:
            return None
        for q in range(world):
            msg = compare(outs[q].cpu(), ins[q], label=f"output[{q}]: ")
            if msg:
                return msg
        return None

    def scatter(dt, n, key, root):
        ins = [make_data(key, q, n, dt) for q in range(world)]
        out = on(poison_like(ins[rank]))
        dist.scatter(out, scatter_list=[on(x) for x in ins] if rank == root else None, src=root)
        return compare(out.cpu(), ins[rank])

    def send_recv(dt, n, key):
        # a ring: send to the next rank, receive from the previous one
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        mine = make_data(key, rank, n, dt)
        expected = make_data(key, prv, n, dt)
        got = on(poison_like(expected))
        ops = [dist.P2POp(dist.isend, on(mine), nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return compare(got.cpu(), expected)

    for dname, dt in dtypes.items():
        for i, n in enumerate(sizes):
            root = i % world
            check(f"broadcast {dname} n={n} root={root}", broadcast, dt, n, ("bc", dname, n), root)
            for inplace in (False, True):
                check(f"all_gather_into_tensor {dname} n={n} inplace={inplace}", all_gather_into,
                      dt, n, ("ag", dname, n), inplace)
            check(f"all_gather list {dname} n={n}", all_gather_list, dt, n, ("agl", dname, n))
            m = n // world
            for splits in (False, True):
                check(f"all_to_all_single {dname} n={m} splits={splits}", all_to_all_single, dt,
                      m, ("a2a", dname, n), splits)
            check(f"all_to_all list {dname} n={m}", all_to_all_list, dt, m, ("a2l", dname, n))
            check(f"gather {dname} n={n} root={root}", gather, dt, n, ("ga", dname, n), root)
            check(f"scatter {dname} n={n} root={root}", scatter, dt, n, ("sc", dname, n), root)
            check(f"send/recv {dname} n={n}", send_recv, dt, n, ("p2p", dname, n))

    # ---------------------------------------------------------------- float8
    # every float op and the data movement, on the GPU (float8.py: exact references)
    for case, fn in float8.cases(rank, world, device=dev, sizes=sizes):
        check(" ".join(f"{k}={v}" if k not in ("coll", "dtype", "op") else str(v)
                       for k, v in case.items()), fn)

    # ---------------------------------------------------------------- stream semantics
    def stream_order():
        # The op must run after work the caller queued, without the host waiting for it.
        n = 1 << 20
        t = torch.zeros(n, device=dev)
        t.mul_(2)  # torch's mul kernel loaded before the sleep (a first load waits for it)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        torch.cuda._sleep(int(2e8))  # ~100 ms of GPU time on the current stream
        t.fill_(rank + 1.0)          # queued after the sleep
        work = dist.all_reduce(t, async_op=True)
        work.wait()                  # the current stream waits; the host goes on
        t.mul_(2)                    # ordered after the collective by wait()
        host_s = time.monotonic() - t0
        torch.cuda.synchronize()
        expected = 2.0 * world * (world + 1) / 2
        if not bool((t == expected).all()):
            return f"got {t[0].item()} (first element), expected {expected}"
        # Off the shared-GPU path wait() is a host wait by design.
        if host_free and host_s > 0.05:
            return f"the host was blocked for {host_s * 1e3:.0f} ms (the GPU sleep is ~100 ms)"
        if not work.is_completed():
            return "work not completed after torch.cuda.synchronize()"
        return None

    def side_stream():
        # A collective issued on a side stream, its result used on that stream.
        s = torch.cuda.Stream()
        t = torch.full((4099,), float(rank), device=dev)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(t)
            t.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        expected = world * (world - 1) / 2 + 1
        return None if bool((t == expected).all()) else f"got {t[0].item()}, expected {expected}"

    def future_then():
        t = torch.full((1000,), 1.0, device=dev)
        fut = dist.all_reduce(t, async_op=True).get_future()
        fut2 = fut.then(lambda f: f.value()[0] * 3)
        r = fut2.wait()
        return None if bool((r == 3.0 * world).all()) else f"got {r[0].item()}"

    def mixed_cpu_cuda():
        for i in range(3):
            c = torch.full((333,), float(rank + i), device="cpu")
            g = torch.full((333,), float(rank + i), device=dev)
            dist.all_reduce(c)
            dist.all_reduce(g)
            exp = sum(q + i for q in range(world))
            if not bool((c == exp).all()) or not bool((g.cpu() == exp).all()):
                return f"round {i}: cpu {c[0].item()} cuda {g[0].item()} expected {exp}"
        return None

    def noncontiguous():
        base = torch.full((64, 8), float(rank), device=dev)
        t = base[:, 3]  # strided column
        dist.all_reduce(t)
        exp = world * (world - 1) / 2
        if not bool((base[:, 3] == exp).all()):
            return f"column got {base[0, 3].item()}, expected {exp}"
        if not bool((base[:, 2] == rank).all()):
            return "a neighbouring column changed"
        return None

    def many_async():
        ts = [torch.full((1000 + i,), float(i + rank), device=dev) for i in range(20)]
        works = [dist.all_reduce(t, async_op=True) for t in ts]
        for w in works:
            w.wait()
        for i, t in enumerate(ts):
            exp = sum(i + q for q in range(world))
            if not bool((t == exp).all()):
                return f"tensor {i}: got {t[0].item()}, expected {exp}"
        return None

    def coalesced():
        ts = [torch.full((n,), float(rank), device=dev) for n in (5, 4099, 1)]
        with dist._coalescing_manager(device=dev, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t)
        cm.wait()
        exp = world * (world - 1) / 2
        for t in ts:
            if not bool((t == exp).all()):
                return f"got {t[0].item()}, expected {exp}"
        return None

    for name, fn in (("stream order", stream_order),
                     ("host not blocked", lambda: not_blocked("later")),
                     ("side stream", side_stream),
                     ("future then", future_then), ("mixed cpu/cuda", mixed_cpu_cuda),
                     ("non-contiguous", noncontiguous), ("many async", many_async),
                     ("coalescing manager", coalesced)):
        check(name, fn)

    dist.barrier()
    print(f"CHECKS {passed} passed {len(failed)} failed", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
