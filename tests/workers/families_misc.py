"""Point-to-point, barrier, async Work/Future, subgroup and sequence-number check families."""
import os
import time

import torch
import torch.distributed as dist

from common import (DTYPES, compare, compare_list, make_data, poison_like, reference_reduce,
                    sizes_for)


def _p2p_cases(coll):
    for dname, dt in DTYPES.items():
        for n in sizes_for(dt):
            yield dict(coll=coll, dtype=dname, size=n), dt, n


def _key(case):
    return tuple(sorted((k, v) for k, v in case.items() if k != "family"))


# ------------------------------------------------------------------ point-to-point
def fam_send_recv(ctx):
    """Ring: rank r sends to r+1 and receives from r-1 with blocking send/recv. Even ranks
    send first, odd ranks receive first, so no cycle of blocked sends can form."""
    w, r = ctx.world, ctx.rank
    nxt, prv = (r + 1) % w, (r - 1) % w

    def run(case, dt, n):
        key = _key(case)
        payload = make_data(key, r, n, dt)
        expected = make_data(key, prv, n, dt)
        buf = poison_like(expected)
        if r % 2 == 0:
            dist.send(payload, dst=nxt, tag=7, group=ctx.group)
            dist.recv(buf, src=prv, tag=7, group=ctx.group)
        else:
            dist.recv(buf, src=prv, tag=7, group=ctx.group)
            dist.send(payload, dst=nxt, tag=7, group=ctx.group)
        return compare(buf, expected)

    for case, dt, n in _p2p_cases("send_recv"):
        ctx.check(case, run, case, dt, n)


def fam_recv_any_source(ctx):
    """Rank 0 receives world-1 messages with dist.recv(t) (no src); the returned sender must
    be each other rank exactly once and the data that sender's."""
    w, r = ctx.world, ctx.rank

    def run(case, dt, n):
        key = _key(case)
        if r != 0:
            dist.send(make_data(key, r, n, dt), dst=0, group=ctx.group)
            return None
        pending = set(range(1, w))
        for _ in range(w - 1):
            buf = poison_like(make_data(key, 1, n, dt))
            src = dist.recv(buf, group=ctx.group)
            if src not in pending:
                return f"recv() reported sender {src!r}; still expected one of {sorted(pending)}"
            pending.discard(src)
            msg = compare(buf, make_data(key, src, n, dt), label=f"message from rank {src}: ")
            if msg:
                return msg
        return None

    for case, dt, n in _p2p_cases("recv_any_source"):
        ctx.check(case, run, case, dt, n)


def _all_pairs(ctx, case, dt, n, post):
    """Every rank exchanges a distinct message with every other rank; post(sends, recvs)
    issues them and waits. Message p->q is make_data(key + (q,), p)."""
    w, r = ctx.world, ctx.rank
    key = _key(case)
    peers = [p for p in range(w) if p != r]
    expecteds = [make_data(key + (r,), p, n, dt) for p in peers]
    bufs = [poison_like(e) for e in expecteds]
    sends = [(make_data(key + (p,), r, n, dt), p) for p in peers]
    post(sends, list(zip(bufs, peers)))
    return compare_list(bufs, expecteds, label="message from peer index")


def fam_isend_irecv(ctx):
    def post(sends, recvs):
        reqs = [dist.irecv(b, src=p, group=ctx.group) for b, p in recvs] + [dist.isend(t, dst=p, group=ctx.group) for t, p in sends]
        for q in reqs:
            q.wait()

    for case, dt, n in _p2p_cases("isend_irecv"):
        ctx.check(case, _all_pairs, ctx, case, dt, n, post)


def fam_batch_isend_irecv(ctx):
    def post(sends, recvs):
        ops = [dist.P2POp(dist.irecv, b, p, group=ctx.group) for b, p in recvs] + \
              [dist.P2POp(dist.isend, t, p, group=ctx.group) for t, p in sends]
        for q in dist.batch_isend_irecv(ops):
            q.wait()

    for case, dt, n in _p2p_cases("batch_isend_irecv"):
        ctx.check(case, _all_pairs, ctx, case, dt, n, post)


# ------------------------------------------------------------------ barrier
def fam_barrier(ctx):
    """One rank arrives late and leaves a marker file just before entering the barrier; every
    other rank must find the marker when its barrier returns."""
    w, r = ctx.world, ctx.rank

    def run(late):
        marker = os.path.join(ctx.out_dir, f"barrier-late-{late}")
        if r == late:
            time.sleep(0.2)
            open(marker, "w").close()
        dist.barrier(group=ctx.group)
        if r != late and not os.path.exists(marker):
            return f"barrier returned before rank {late} entered it"
        return None

    for late in range(w):
        ctx.check(dict(coll="barrier", late_rank=late), run, late)


# ------------------------------------------------------------------ async_op, Work, Future
def _async_ops(ctx, dt, n, tag):
    """Starts several different collectives with async_op=True before waiting on any.
    Returns (name, work, outputs, expecteds, tol) tuples."""
    w, r = ctx.world, ctx.rank
    started = []

    def key(name):
        return ("async", tag, name, str(dt), n)

    terms = [make_data(key("ar"), q, n, dt) for q in range(w)]
    e, tol = reference_reduce(terms, dt, "SUM")
    t = terms[r].clone()
    started.append(("all_reduce", dist.all_reduce(t, async_op=True, group=ctx.group), [t], [e], tol))

    src = make_data(key("bc"), w - 1, n, dt)
    t = src.clone() if r == w - 1 else poison_like(src)
    started.append(("broadcast", dist.broadcast(t, src=w - 1, async_op=True, group=ctx.group), [t], [src], None))

    parts = [make_data(key("ag"), q, n, dt) for q in range(w)]
    e = torch.cat(parts)
    out = poison_like(e)
    started.append(("all_gather_into_tensor",
                    dist.all_gather_into_tensor(out, parts[r].clone(), async_op=True, group=ctx.group), [out], [e], None))

    ins = [make_data(key("rs"), q, w * n, dt) for q in range(w)]
    e, tol_rs = reference_reduce([x.narrow(0, r * n, n) for x in ins], dt, "SUM")
    out = poison_like(e, dt)
    started.append(("reduce_scatter_tensor",
                    dist.reduce_scatter_tensor(out, ins[r].clone(), async_op=True, group=ctx.group), [out], [e], tol_rs))

    outs = [poison_like(p) for p in parts]
    started.append(("all_gather", dist.all_gather(outs, parts[r].clone(), async_op=True, group=ctx.group),
                    outs, parts, None))

    ins = [make_data(key("a2a"), q, w * n, dt) for q in range(w)]
    e = torch.cat([x.narrow(0, r * n, n) for x in ins])
    out = poison_like(e)
    started.append(("all_to_all_single",
                    dist.all_to_all_single(out, ins[r].clone(), async_op=True, group=ctx.group), [out], [e], None))
    return started


ASYNC_DTYPES = ("float32", "bfloat16", "int64")


def fam_async_wait(ctx):
    """async_op=True for six collectives in flight at once, waited in reverse order."""
    for dname in ASYNC_DTYPES:
        dt = DTYPES[dname]
        for n in sizes_for(dt)[1:]:
            state = {}

            def start(dt=dt, n=n, state=state):
                state["ops"] = _async_ops(ctx, dt, n, "wait")

            case = dict(coll="async_batch_start", dtype=dname, size=n)
            if not ctx.check(case, start):
                continue
            for name, work, outs, exps, tol in reversed(state["ops"]):
                def finish(work=work, outs=outs, exps=exps, tol=tol):
                    if work.wait() is False:
                        return "Work.wait() returned False"
                    if not work.is_completed():
                        return "Work.is_completed() is False after wait()"
                    return compare_list(outs, exps, tol)
                ctx.check(dict(coll=name, dtype=dname, size=n, api="Work.wait"), finish)


def fam_async_future(ctx):
    """Work.get_future(): its value is the list of output tensors (the same storage), and a
    then() callback sees the finished result (DDP comm hooks chain on this)."""
    for dname in ASYNC_DTYPES:
        dt = DTYPES[dname]
        for n in (7, 4099):
            state = {}

            def start(dt=dt, n=n, state=state):
                state["ops"] = _async_ops(ctx, dt, n, "future")
            if not ctx.check(dict(coll="async_batch_start", dtype=dname, size=n), start):
                continue
            for name, work, outs, exps, tol in state["ops"]:
                def check(name=name, work=work, outs=outs, exps=exps, tol=tol):
                    fut = work.get_future()
                    chained = fut.then(lambda f: [x.clone() for x in _flat(f.value())])
                    value = _flat(fut.wait())
                    if not fut.done():
                        return "Future.done() is False after wait()"
                    if len(value) != len(outs):
                        return f"future value has {len(value)} tensors, expected {len(outs)}"
                    for j, (v, o) in enumerate(zip(value, outs)):
                        if v.data_ptr() != o.data_ptr() and o.numel() > 0:
                            return f"future value[{j}] is not the output tensor (other storage)"
                    return (compare_list(value, exps, tol, label="future value")
                            or compare_list(chained.wait(), exps, tol, label="then() value"))
                ctx.check(dict(coll=name, dtype=dname, size=n, api="Work.get_future"), check)


CALLBACK_WAIT_S = 20.0


def fam_future_callback_waits(ctx):
    """A then() callback that issues another collective and blocks on its future, as
    PowerSGD's DDP hook does. The callback runs on the thread that completes futures, so the
    backend must complete the inner future elsewhere. A deadlock is reported (after
    CALLBACK_WAIT_S) and then broken by waiting on the inner Work from this thread, so the
    job goes on."""
    w, r = ctx.world, ctx.rank
    dt = torch.float32
    for n in (7, 4099):
        def run(n=n):
            outer = [make_data(("cb_wait", "outer", n), q, n, dt) for q in range(w)]
            inner = [make_data(("cb_wait", "inner", n), q, n, dt) for q in range(w)]
            e_outer, tol = reference_reduce(outer, dt, "SUM")
            e_inner, _ = reference_reduce(inner, dt, "SUM")
            state = {}

            def callback(fut):
                t = inner[r].clone()
                state["work"] = dist.all_reduce(t, async_op=True, group=ctx.group)
                got = _flat(state["work"].get_future().wait())
                return [_flat(fut.value())[0].clone(), got[0].clone()]

            t = outer[r].clone()
            if r > 0:
                # Rank 0's callback is then attached before its all_reduce completes, so it
                # runs on the completing thread rather than inline in then().
                time.sleep(0.3)
            chained = dist.all_reduce(t, async_op=True, group=ctx.group).get_future().then(
                callback)
            deadline = time.monotonic() + CALLBACK_WAIT_S
            while not chained.done() and time.monotonic() < deadline:
                time.sleep(0.005)
            if not chained.done():
                if "work" in state:
                    state["work"].wait()  # completes the inner future: the callback returns
                chained.wait()
                return (f"a then() callback blocked on another all_reduce's future had not "
                        f"returned after {CALLBACK_WAIT_S:.0f} s (deadlock)")
            got = _flat(chained.wait())
            return compare_list(got, [e_outer, e_inner], tol, label="outer/inner all_reduce")

        ctx.check(dict(coll="all_reduce", dtype="float32", size=n,
                       api="then() callback waits on a Future"), run)


def _flat(value):
    # all_gather's future holds [[t0, t1, ...]]: one list per input tensor.
    out = []
    for v in value if isinstance(value, (list, tuple)) else [value]:
        out.extend(_flat(v) if isinstance(v, (list, tuple)) else [v])
    return out


# ------------------------------------------------------------------ subgroups
def _group_layouts(w):
    return {
        1: [[0]],
        2: [[0, 1], [1], [0]],
        3: [[0, 1], [1, 2], [2, 0], [1]],
        4: [[0, 1], [2, 3], [1, 2, 3], [3, 0], [0, 1, 2, 3], [2]],
    }[w]


def fam_new_group(ctx):
    """Several groups, some overlapping, some disjoint (running at the same time); ranks
    outside a group do nothing for it; groups alternate over three rounds."""
    w, r = ctx.world, ctx.rank
    layouts = _group_layouts(w)
    groups = []

    def create():
        groups.extend(dist.new_group(ranks=g) for g in layouts)
        for g, pg in zip(layouts, groups):
            members = sorted(g)
            if r in members:
                if dist.get_rank(pg) != members.index(r):
                    return f"get_rank(group {members}) = {dist.get_rank(pg)}, expected {members.index(r)}"
                if dist.get_world_size(pg) != len(members):
                    return f"get_world_size(group {members}) = {dist.get_world_size(pg)}"
        return None

    if not ctx.check(dict(coll="new_group", layout=str(layouts)), create):
        return

    def run(rnd, members, pg, n):
        key = ("groups", rnd, tuple(members), n)
        me = members.index(r)
        # all_reduce within the group: the sum over members only.
        terms = [make_data(key + ("ar",), q, n, torch.float32) for q in range(len(members))]
        e, tol = reference_reduce(terms, torch.float32, "SUM")
        t = terms[me].clone()
        dist.all_reduce(t, group=pg)
        msg = compare(t, e, tol, label="all_reduce: ")
        if msg:
            return msg
        # broadcast from the group's last member, named by its global rank.
        src = make_data(key + ("bc",), 0, n, torch.int32)
        t = src.clone() if me == len(members) - 1 else poison_like(src)
        dist.broadcast(t, src=members[-1], group=pg)
        msg = compare(t, src, label="broadcast: ")
        if msg:
            return msg
        parts = [make_data(key + ("ag",), q, n, torch.bfloat16) for q in range(len(members))]
        e = torch.cat(parts)
        out = poison_like(e)
        dist.all_gather_into_tensor(out, parts[me].clone(), group=pg)
        msg = compare(out, e, label="all_gather_into_tensor: ")
        if msg or len(members) < 2:
            return msg
        # point-to-point inside the group, addressed by global ranks.
        payload = make_data(key + ("p2p",), 0, n, torch.int64)
        if me == 0:
            dist.send(payload, dst=members[1], group=pg)
        elif me == 1:
            buf = poison_like(payload)
            dist.recv(buf, src=members[0], group=pg)
            return compare(buf, payload, label="send/recv: ")
        return None

    def run_round(rnd, n):
        # Every rank walks the groups in one global order (reversed in odd rounds), joining
        # those it belongs to: disjoint groups run at the same time, and no wait cycle forms.
        order = list(zip(layouts, groups))
        if rnd % 2:
            order.reverse()
        for g, pg in order:
            members = sorted(g)
            if r in members:
                msg = run(rnd, members, pg, n)
                if msg:
                    return f"group {members}: {msg}"
        return None

    for rnd in range(3):
        for n in (7, 4099):
            ctx.check(dict(coll="group_ops", round=rnd, size=n), run_round, rnd, n)
    # The default group still works after all that.
    for n in (1, 4099):
        ctx.check(dict(coll="world_after_groups", size=n), _world_sum, ctx, n)


def _world_sum(ctx, n):
    terms = [make_data(("world_after", n), q, n, torch.float64) for q in range(ctx.world)]
    e, tol = reference_reduce(terms, torch.float64, "SUM")
    t = terms[ctx.rank].clone()
    dist.all_reduce(t, group=ctx.group)
    return compare(t, e, tol)


# ------------------------------------------------------------------ sequence numbers
def fam_sequence_numbers(ctx):
    """Each collective advances the group's sequence number by one; on a new group (which
    has seen only collectives) the number is equal on all members, before and after."""
    w, r = ctx.world, ctx.rank
    store = dist.distributed_c10d._get_default_store()

    def seq(pg):
        # Asked of the backend object: ProcessGroup's own method refuses custom backends.
        return pg._get_backend(torch.device("cpu"))._get_sequence_number_for_group()

    def agree(tag, value):
        store.set(f"seqcheck/{tag}/{r}", str(value))
        vals = [int(store.get(f"seqcheck/{tag}/{q}")) for q in range(w)]
        return None if len(set(vals)) == 1 else f"ranks disagree on the sequence number: {vals}"

    def run(k):
        # Only the step is compared on this group: earlier point-to-point traffic differs per
        # rank, and backends differ on whether it counts.
        pg = ctx.group
        s0 = seq(pg)
        for _ in range(k):
            dist.all_reduce(torch.ones(3), group=pg)
        s1 = seq(pg)
        if s1 - s0 != k:
            return f"sequence number went {s0} -> {s1} over {k} all_reduce calls"
        return None

    for k in (1, 5):
        ctx.check(dict(coll="sequence_number", group="world", collectives=k), run, k)

    def subgroup():
        pg = dist.new_group(ranks=list(range(w)))
        s0 = seq(pg)
        msg = agree("new0", s0)
        if msg:
            return msg
        for _ in range(3):
            dist.all_reduce(torch.ones(2), group=pg)
        s1 = seq(pg)
        if s1 - s0 != 3:
            return f"new group's sequence number went {s0} -> {s1} over 3 collectives"
        return agree("new1", s1)

    ctx.check(dict(coll="sequence_number", group="new_group"), subgroup)


FAMILIES = [
    ("barrier", fam_barrier, 2),
    ("send_recv", fam_send_recv, 2),
    ("recv_any_source", fam_recv_any_source, 2),
    ("isend_irecv", fam_isend_irecv, 2),
    ("batch_isend_irecv", fam_batch_isend_irecv, 2),
    ("async_wait", fam_async_wait, 1),
    ("async_future", fam_async_future, 1),
    ("future_callback_waits", fam_future_callback_waits, 1),
    ("new_group", fam_new_group, 2),
    ("sequence_numbers", fam_sequence_numbers, 1),
]
