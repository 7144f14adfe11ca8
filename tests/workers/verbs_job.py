"""Rank worker of tests/test_verbs.py: ranks on simulated hosts (CHORUS_HOSTID = simhost<k>,
HOSTS_OF ranks each) over the verbs transport, loaded from the libibverbs test double.

usage: verbs_job.py --out DIR --mode coll|fault|plain
  coll   every collective and point-to-point op, values checked against a reference each rank
         computes from every rank's deterministic input (outputs poisoned first)
  fault  all-reduces until the injected completion error (FAKEVERBS_FAIL_AFTER on rank 0);
         records the exception text and how long the failure took
  plain  one checked all_reduce on a registered tensor (for runs where verbs must be
         unavailable: registering succeeds and does nothing)
  register  all_reduce, broadcast, all_gather and a ring of sends on a tensor registered with
         chorus.register (rewritten as soon as each op returns), then the same unregistered;
         bad registrations must raise
  ddp    DDP with chorus.hooks.allreduce_hook (buckets registered) against the default hook
Writes <out>/rank<r>.json: {"checks": n, "failures": [...], "error": text, "seconds": s}.
"""
import argparse
import json
import os
import sys
import time
import traceback

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
PER_HOST = int(os.environ.get("VERBS_RANKS_PER_HOST", "2"))
# Must be set before the first communicator reads its parameters.
os.environ["CHORUS_HOSTID"] = f"simhost{RANK // PER_HOST}"
# VERBS_LIB_OF_RANK="a,b": rank r loads entry r (empty: the default library name)
if os.environ.get("VERBS_LIB_OF_RANK"):
    os.environ["CHORUS_IBVERBS_LIB"] = os.environ["VERBS_LIB_OF_RANK"].split(",")[RANK]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import init_dist  # noqa: E402


def data(rank, case, n, dtype):
    """Deterministic input of `rank` for `case`: small integers, exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randint(-20, 21, (n,), generator=g, dtype=torch.int64).to(dtype)


class Checker:
    def __init__(self):
        self.checks = 0
        self.failures = []

    def same(self, what, got, want):
        self.checks += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            diff = (got.to(torch.float64) - want.to(torch.float64)).abs()
            idx = int(diff.argmax()) if diff.numel() else -1
            self.failures.append(f"{what}: first wrong index {idx}: got {got.flatten()[idx]} "
                                 f"want {want.flatten()[idx]}" if idx >= 0 else what)


def run_collectives(ck):
    sizes = [1, 4099, 100000]  # the last one is bigger than the 64 KiB rings
    case = 0
    for n in sizes:
        # every dtype class on the small sizes; the big one (wraps the rings) in float32
        for dtype in (torch.float32, torch.int64, torch.bfloat16)[:1 if n > 10000 else 3]:
            case += 1
            ins = [data(r, case, n, dtype) for r in range(WORLD)]
            # all_reduce SUM and MAX
            t = ins[RANK].clone()
            dist.all_reduce(t)
            ck.same(f"all_reduce sum n={n} {dtype}", t, torch.stack(ins).sum(0).to(dtype))
            t = ins[RANK].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ck.same(f"all_reduce max n={n} {dtype}", t, torch.stack(ins).max(0).values)
            # broadcast from the last rank
            t = ins[RANK].clone() if RANK == WORLD - 1 else torch.full((n,), 77, dtype=dtype)
            dist.broadcast(t, src=WORLD - 1)
            ck.same(f"broadcast n={n} {dtype}", t, ins[WORLD - 1])
            # reduce to rank 1
            t = ins[RANK].clone()
            dist.reduce(t, dst=1)
            if RANK == 1:
                ck.same(f"reduce n={n} {dtype}", t, torch.stack(ins).sum(0).to(dtype))
            # all_gather (list) and all_gather_into_tensor
            outs = [torch.full((n,), 55, dtype=dtype) for _ in range(WORLD)]
            dist.all_gather(outs, ins[RANK])
            ck.same(f"all_gather n={n} {dtype}", torch.cat(outs), torch.cat(ins))
            out = torch.full((WORLD * n,), 55, dtype=dtype)
            dist.all_gather_into_tensor(out, ins[RANK])
            ck.same(f"all_gather_into_tensor n={n} {dtype}", out, torch.cat(ins))
            # gather to rank 2, scatter from rank 3
            outs = [torch.full((n,), 55, dtype=dtype) for _ in range(WORLD)] if RANK == 2 else None
            dist.gather(ins[RANK], gather_list=outs, dst=2)
            if RANK == 2:
                ck.same(f"gather n={n} {dtype}", torch.cat(outs), torch.cat(ins))
            chunks = [data(100 + r, case, n, dtype) for r in range(WORLD)]
            t = torch.full((n,), 55, dtype=dtype)
            dist.scatter(t, scatter_list=chunks if RANK == 3 else None, src=3)
            ck.same(f"scatter n={n} {dtype}", t, chunks[RANK])
            # reduce_scatter (list) and reduce_scatter_tensor: rank r's input is WORLD x n
            big = [data(r, case + 500, WORLD * n, dtype) for r in range(WORLD)]
            want = torch.stack(big).sum(0).to(dtype)[RANK * n:(RANK + 1) * n]
            t = torch.full((n,), 55, dtype=dtype)
            dist.reduce_scatter_tensor(t, big[RANK].clone())
            ck.same(f"reduce_scatter_tensor n={n} {dtype}", t, want)
            t = torch.full((n,), 55, dtype=dtype)
            dist.reduce_scatter(t, list(big[RANK].clone().chunk(WORLD)))
            ck.same(f"reduce_scatter n={n} {dtype}", t, want)
            # all_to_all_single, even and uneven; all_to_all (list)
            out = torch.full((WORLD * n,), 55, dtype=dtype)
            dist.all_to_all_single(out, big[RANK].clone())
            ck.same(f"all_to_all_single n={n} {dtype}", out,
                    torch.cat([big[r][RANK * n:(RANK + 1) * n] for r in range(WORLD)]))
            # rank s sends (d + s + 1) % 3 * (n // 3 + 1) elements to rank d
            def sp(s, d):
                return (d + s + 1) % 3 * (n // 3 + 1)
            send_sizes = [sp(RANK, d) for d in range(WORLD)]
            recv_sizes = [sp(s, RANK) for s in range(WORLD)]
            src = [data(200 + RANK, case, sum(send_sizes), dtype)]
            out = torch.full((sum(recv_sizes),), 55, dtype=dtype)
            dist.all_to_all_single(out, src[0], output_split_sizes=recv_sizes,
                                   input_split_sizes=send_sizes)
            want = []
            for s in range(WORLD):
                ss = [sp(s, d) for d in range(WORLD)]
                full = data(200 + s, case, sum(ss), dtype)
                off = sum(ss[:RANK])
                want.append(full[off:off + ss[RANK]])
            ck.same(f"all_to_all_single uneven n={n} {dtype}", out, torch.cat(want))
            outs = [torch.full((n,), 55, dtype=dtype) for _ in range(WORLD)]
            dist.all_to_all(outs, list(big[RANK].clone().chunk(WORLD)))
            ck.same(f"all_to_all n={n} {dtype}", torch.cat(outs),
                    torch.cat([big[r][RANK * n:(RANK + 1) * n] for r in range(WORLD)]))
        # point-to-point: a ring both ways with batch_isend_irecv, bigger than the rings
        nxt, prv = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        rf, rb = torch.full((n,), 55.0), torch.full((n,), 55.0)
        ops = [dist.P2POp(dist.isend, data(RANK, 900 + n, n, torch.float32), nxt),
               dist.P2POp(dist.isend, data(RANK, 901 + n, n, torch.float32), prv),
               dist.P2POp(dist.irecv, rf, prv), dist.P2POp(dist.irecv, rb, nxt)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        ck.same(f"p2p from previous n={n}", rf, data(prv, 900 + n, n, torch.float32))
        ck.same(f"p2p from next n={n}", rb, data(nxt, 901 + n, n, torch.float32))
    dist.barrier()


def run_registered(ck):
    import chorus
    n = 300000  # 1.2 MB of float32: many times the 64 KiB rings
    buf = torch.zeros(2 * n)
    reg = chorus.register(buf)
    with chorus.register(buf[n // 2:n]) as inner:  # inside the first: shared, closed early
        assert not inner.closed
    assert inner.closed and not reg.closed
    t = buf[:n]  # a view: the registration covers the whole storage
    got = torch.empty(n)
    got_reg = chorus.register(got)  # receives land in it without a copy where they can
    for rnd in range(3):
        t.copy_(data(RANK, 50 + rnd, n, torch.float32))
        dist.all_reduce(t)
        ck.same(f"registered all_reduce {rnd}", t,
                sum(data(r, 50 + rnd, n, torch.float32) for r in range(WORLD)))
        root = rnd % WORLD
        t.copy_(data(RANK, 60 + rnd, n, torch.float32))  # rewritten at once after the op
        dist.broadcast(t, src=root)
        ck.same(f"registered broadcast {rnd}", t, data(root, 60 + rnd, n, torch.float32))
        small = buf[n:n + 5000]
        small.copy_(data(RANK, 70 + rnd, 5000, torch.float32))
        out = torch.empty(WORLD * 5000)
        dist.all_gather_into_tensor(out, small)
        ck.same(f"registered all_gather {rnd}", out,
                torch.cat([data(r, 70 + rnd, 5000, torch.float32) for r in range(WORLD)]))
        to, frm = (RANK + 1) % WORLD, (RANK - 1) % WORLD
        t.copy_(data(RANK, 80 + rnd, n, torch.float32))
        got.zero_()
        reqs = [dist.isend(t, to), dist.irecv(got, frm)]
        reqs[0].wait()
        t.fill_(float("nan"))  # the send completed: the buffer is the caller's again
        reqs[1].wait()
        ck.same(f"registered send/recv {rnd}", got, data(frm, 80 + rnd, n, torch.float32))
    reg.close()
    reg.close()  # twice: nothing
    got_reg.close()
    plain = data(RANK, 90, n, torch.float32)
    dist.all_reduce(plain)
    ck.same("unregistered all_reduce", plain,
            sum(data(r, 90, n, torch.float32) for r in range(WORLD)))
    for bad, what in ((torch.zeros(4).to_sparse(), "dense"), (torch.empty(0), "no memory")):
        try:
            chorus.register(bad)
            ck.failures.append(f"registering a {what} tensor did not raise")
        except RuntimeError as e:
            if what not in str(e):
                ck.failures.append(f"registering a {what} tensor: {e}")
        ck.checks += 1
    chorus.register(torch.ones(1000))  # left open: destroy releases it


def run_ddp(ck):
    """DDP with chorus.hooks.allreduce_hook against DDP's own default hook, same seeds: the
    parameters must come out identical (the same division, then a deterministic sum)."""
    import chorus
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train(hooked):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 256))  # 2 MiB of gradients
        ddp = DDP(model, bucket_cap_mb=1)
        state = chorus.hooks.RegisteredBuckets() if hooked else None
        if hooked:
            ddp.register_comm_hook(state, chorus.hooks.allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + RANK)
            loss = ddp(torch.randn(32, 256, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], state

    want, _ = train(False)
    got, state = train(True)
    for i, (a, b) in enumerate(zip(got, want)):
        ck.same(f"ddp parameter {i}", a, b)
    ck.checks += 1
    if state.registered < 2:  # 2 MiB in buckets of at most 1 MiB
        ck.failures.append(f"only {state.registered} bucket registrations")
    state.close()
    return {"registered": state.registered, "replaced": state.replaced}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", required=True, choices=["coll", "fault", "plain", "register", "ddp"])
    args = ap.parse_args()
    if args.mode == "fault" and RANK == 0:
        os.environ["FAKEVERBS_FAIL_AFTER"] = os.environ.get("VERBS_FAIL_AFTER", "40")
    rec = {"checks": 0, "failures": [], "error": None, "seconds": None}
    init_dist()
    ck = Checker()
    if args.mode == "coll":
        run_collectives(ck)
    elif args.mode == "register":
        run_registered(ck)
    elif args.mode == "ddp":
        rec["ddp"] = run_ddp(ck)
    elif args.mode == "plain":
        import chorus
        t = data(RANK, 1, 1000, torch.float32)
        with chorus.register(t):  # no verbs here: registering does nothing, and succeeds
            dist.all_reduce(t)
        ck.same("all_reduce", t, sum(data(r, 1, 1000, torch.float32) for r in range(WORLD)))
    else:
        t0 = time.monotonic()
        try:
            for i in range(2000):
                t = torch.ones(4096)
                dist.all_reduce(t)
                ck.same(f"all_reduce {i}", t, torch.full((4096,), float(WORLD)))
        except Exception as e:  # noqa: BLE001 - the exception is what is checked
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["seconds"] = time.monotonic() - t0
    rec["checks"], rec["failures"] = ck.checks, ck.failures
    with open(os.path.join(args.out, f"rank{RANK}.json"), "w") as f:
        json.dump(rec, f)
    if args.mode == "fault":
        # the process group is broken: leave without the collective teardown
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
