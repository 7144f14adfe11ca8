"""One rank of the multi-host job (tests/test_multihost.py, tools/multihost_bench.py), started
by torchrun on a simulated host. Runs every collective and point-to-point op once or twice
(small and large) and checks each result against values this rank computes itself from the
closed-form input of every rank (x[r][i] = base(r) + i % 251: small integers, so float sums
are exact); outputs are poisoned first. Writes MH_OUT/rank<R>.json: {"checks": {name: error
or ""}, "host": hostname, "perf": {...} (rank 0, when MH_PERF_BYTES > 0)}.

Perf (MH_PERF_BYTES > 0): ranks 0 and world/2 (one per host) measure, interleaved, over one
plain TCP connection between them (to the other rank's veth address, MH_PEER_ADDR):
MH_PERF_BYTES from rank 0 to the other ("uni"), then MH_PERF_BYTES each way at once ("bidir",
rate per direction: the traffic pattern of a 2-rank all_reduce, which sends and receives its
size on each rank), and Chorus all_reduce of MH_PERF_BYTES of float32 on a 2-rank group of
the same two ranks; MH_PERF_ROUNDS rounds, median of each."""
import json
import os
import socket
import statistics
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import chorus  # noqa: F401  (registers the backend)

OUT = os.environ["MH_OUT"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
checks = {}


def base(r):
    return float(1000 * (r + 1))


def data(r, n, dtype=torch.float32):
    return (torch.arange(n, dtype=torch.int64) % 251 + int(base(r))).to(dtype)


def poison(t):
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-7777)
    return t


def check(name, fn):
    try:
        fn()
        checks[name] = ""
    except Exception:  # noqa: BLE001 - recorded, reported by the test
        checks[name] = traceback.format_exc(limit=3)


def expect(got, want, what):
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).nonzero()
        first = bad[0].tolist() if len(bad) else "shape/dtype"
        raise AssertionError(f"{what}: {len(bad)} wrong elements, first at {first}: "
                             f"got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")


SIZES = (1000, 1 << 20)  # 1 MiB+ crosses the stripes and the direct copy paths


def t_all_reduce():
    for n in SIZES:
        t = data(rank, n)
        dist.all_reduce(t)
        expect(t, sum(data(r, n) for r in range(world)), f"all_reduce sum n={n}")
    t = data(rank, 777, torch.int64) * (rank % 2 * 2 - 1)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    want = torch.stack([data(r, 777, torch.int64) * (r % 2 * 2 - 1) for r in range(world)]).max(0).values
    expect(t, want, "all_reduce max int64")


def t_broadcast():
    for root in (world - 1, 1):
        for n in SIZES:
            t = data(rank, n, torch.float64) if rank == root else poison(torch.empty(n, dtype=torch.float64))
            dist.broadcast(t, src=root)
            expect(t, data(root, n, torch.float64), f"broadcast root {root} n={n}")


def t_reduce():
    root = world - 1
    for n in SIZES:
        t = data(rank, n)
        dist.reduce(t, dst=root)
        if rank == root:
            expect(t, sum(data(r, n) for r in range(world)), f"reduce n={n}")


def t_all_gather():
    n = 3001
    outs = [poison(torch.empty(n)) for _ in range(world)]
    dist.all_gather(outs, data(rank, n))
    for r in range(world):
        expect(outs[r], data(r, n), f"all_gather slot {r}")
    n = 1 << 18
    out = poison(torch.empty(world * n))
    dist.all_gather_into_tensor(out, data(rank, n))
    expect(out, torch.cat([data(r, n) for r in range(world)]), "all_gather_into_tensor")


def t_reduce_scatter():
    for n in (1001, 1 << 18):
        inp = torch.cat([data(rank, n) + 7 * k for k in range(world)])
        out = poison(torch.empty(n))
        dist.reduce_scatter_tensor(out, inp)
        expect(out, sum(data(r, n) + 7 * rank for r in range(world)), f"reduce_scatter n={n}")


def t_alltoall():
    n = 1 << 16
    inp = torch.cat([data(rank, n) + 100000 * k for k in range(world)])
    out = poison(torch.empty(world * n))
    dist.all_to_all_single(out, inp)
    expect(out, torch.cat([data(r, n) + 100000 * rank for r in range(world)]), "all_to_all_single")
    ins = [data(rank, 257 + k) + k for k in range(world)]
    outs = [poison(torch.empty(257 + rank)) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for r in range(world):
        expect(outs[r], data(r, 257 + rank) + rank, f"all_to_all from {r}")


def t_send_recv():
    # a ring: every rank sends to the next, so same-host and cross-host pairs both carry data
    for n in SIZES:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        out = poison(torch.empty(n))
        reqs = [dist.isend(data(rank, n) * 3, nxt), dist.irecv(out, prv)]
        for q in reqs:
            q.wait()
        expect(out, data(prv, n) * 3, f"send/recv ring n={n}")
    # cross-host pair only, blocking calls, both directions in turn
    peer = (rank + world // 2) % world
    t = poison(torch.empty(5000))
    if rank < peer:
        dist.send(data(rank, 5000), peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(data(rank, 5000), peer)
    expect(t, data(peer, 5000), "send/recv cross-host pair")


def t_gather_scatter():
    root = 2 % world
    n = 4099
    outs = [poison(torch.empty(n)) for _ in range(world)] if rank == root else None
    dist.gather(data(rank, n), gather_list=outs, dst=root)
    if rank == root:
        for r in range(world):
            expect(outs[r], data(r, n), f"gather slot {r}")
    root = 1
    out = poison(torch.empty(n))
    ins = [data(r, n) - 5 for r in range(world)] if rank == root else None
    dist.scatter(out, scatter_list=ins, src=root)
    expect(out, data(rank, n) - 5, "scatter")


def t_barrier():
    for _ in range(3):
        dist.barrier()


# ------------------------------------------------------------------ perf
def recv_exact(s, view):
    got = 0
    while got < len(view):
        k = s.recv_into(view[got:], len(view) - got)
        if k == 0:
            raise ConnectionError("plain TCP peer closed early")
        got += k


def perf(nbytes, rounds):
    """Rank 0 and rank world/2 (one on each host): plain TCP vs Chorus all_reduce between
    them, interleaved; with more than one rank per host, an all_reduce of the whole group
    too (every rank), in the same rounds."""
    other = world // 2
    group = dist.new_group([0, other])  # every rank takes part in creating it
    pair = rank in (0, other)
    port = int(os.environ.get("MH_PLAIN_PORT", "29611"))
    buf = bytearray(nbytes) if pair else None
    view = memoryview(buf) if pair else None
    conn = lst = None
    if rank == other:
        fam = socket.AF_INET6 if ":" in os.environ["MH_PEER_ADDR"] else socket.AF_INET
        lst = socket.socket(fam, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((os.environ["MH_PEER_ADDR"], port))
        lst.listen(1)
    if pair:
        dist.barrier(group=group)
        if rank == 0:
            conn = socket.create_connection((os.environ["MH_PEER_ADDR"], port), timeout=120)
        else:
            conn, _ = lst.accept()
            lst.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = torch.ones(nbytes // 4)
    tw = torch.ones(nbytes // 4) if world > 2 else None
    out = bytearray(nbytes) if pair else None
    plain, bidir, coll, whole = [], [], [], []
    if pair:
        dist.all_reduce(t, group=group)  # warm-up: connections, first touch of the pages
    if tw is not None:
        dist.all_reduce(tw)
    for _ in range(rounds):
        if pair:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if rank == 0:
                conn.sendall(view)
                recv_exact(conn, view[:1])  # the receiver has everything
            else:
                recv_exact(conn, view)
                conn.sendall(b"k")
            plain.append(time.perf_counter() - t0)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            sender = threading.Thread(target=conn.sendall, args=(out,))
            sender.start()
            recv_exact(conn, view)
            sender.join()
            bidir.append(time.perf_counter() - t0)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            coll.append(time.perf_counter() - t0)
        if tw is not None:
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tw)
            whole.append(time.perf_counter() - t0)
    if conn is not None:
        conn.close()
    dist.barrier()
    if rank != 0:
        return None
    tp, tb, tc = statistics.median(plain), statistics.median(bidir), statistics.median(coll)
    res = {"bytes": nbytes, "rounds": rounds, "plain_s": plain, "bidir_s": bidir,
           "allreduce_s": coll, "plain_GBps": nbytes / tp / 1e9,
           "bidir_GBps": nbytes / tb / 1e9, "allreduce_busbw_GBps": nbytes / tc / 1e9,
           "ratio": tp / tc, "ratio_bidir": tb / tc}
    if whole:
        # nccl-tests' bus bandwidth of the whole group's all_reduce: 2(n-1)/n x size / time
        tw_med = statistics.median(whole)
        res.update(world=world, world_allreduce_s=whole,
                   world_busbw_GBps=2 * (world - 1) / world * nbytes / tw_med / 1e9,
                   world_ratio=2 * (world - 1) / world * tp / tw_med)
    return res


def main():
    dist.init_process_group(backend="chorus", timeout=timedelta(seconds=120))
    assert dist.get_world_size() == world
    perf_bytes = int(os.environ.get("MH_PERF_BYTES", "0"))
    result = {"rank": rank, "host": socket.gethostname(), "checks": checks}
    if os.environ.get("MH_CHECKS", "1") == "1":
        for name, fn in [("all_reduce", t_all_reduce), ("broadcast", t_broadcast),
                         ("reduce", t_reduce), ("all_gather", t_all_gather),
                         ("reduce_scatter", t_reduce_scatter), ("alltoall", t_alltoall),
                         ("send_recv", t_send_recv), ("gather_scatter", t_gather_scatter),
                         ("barrier", t_barrier)]:
            check(name, fn)
    if perf_bytes > 0:
        result["perf"] = perf(perf_bytes, int(os.environ.get("MH_PERF_ROUNDS", "3")))
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
