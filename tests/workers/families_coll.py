"""Collective check families: every collective x dtype x op x size x in-place/out-of-place.

Each family is a function f(ctx) that calls ctx.check(case, fn) once per combination; fn runs
the collective on poisoned outputs and returns None or the first mismatch against the local
reference. ctx is common.Ctx: rank, world, group (the group under test) and check().
"""
import contextlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from common import (DTYPES, compare, compare_list, kind_for, make_data, ops_for,
                    poison_like, premul_factor, reference_reduce, sizes_for, torch_op)

INPLACE_BOTH = (False, True)


@contextlib.contextmanager
def coalescing(group, device=None):
    """dist._coalescing_manager that leaves no queued ops behind when a collective inside
    raises (torch would otherwise refuse every later coalescing block on the group)."""
    try:
        with dist._coalescing_manager(group=group, device=device):
            yield
    except BaseException:
        dist.distributed_c10d._world.pg_coalesce_state.pop(group, None)
        raise


def _factors(op, world):
    return [premul_factor(op, q) for q in range(world)] if op.startswith("PREMUL") else None


def _reduced(key, dt, op, world, n):
    """Every rank's input for key and the reference reduction of them."""
    inputs = [make_data(key, q, n, dt, kind_for(dt, op)) for q in range(world)]
    return inputs, reference_reduce(inputs, dt, op, _factors(op, world))


def reducing_cases(ctx, coll, variants=(None,), sizes=sizes_for):
    """Yields (case, dt, op, n) over the full dtype x size x op x variant matrix."""
    for dname, dt in DTYPES.items():
        for n in sizes(dt):
            for op in ops_for(dt):
                for v in variants:
                    case = dict(coll=coll, dtype=dname, op=op, size=n)
                    if v is not None:
                        case.update(v)
                    yield case, dt, op, n


def moving_cases(ctx, coll, variants=(None,), sizes=sizes_for):
    for dname, dt in DTYPES.items():
        for si, n in enumerate(sizes(dt)):
            for v in variants:
                case = dict(coll=coll, dtype=dname, size=n)
                if v is not None:
                    case.update(v)
                yield case, dt, n, si


def _key(case):
    # The op is left out: the ops of one dtype and size share inputs (make_data caches them);
    # the data kind that an op needs is passed to make_data separately.
    return tuple(sorted((k, v) for k, v in case.items() if k not in ("family", "op")))


COALESCED_LENGTHS = (1, 7)  # every coalesced call also carries tensors of 1 and 7 elements
# _coalescing_manager without a device takes the backend's *_coalesced fast path; with a
# device it brackets the calls with startCoalescing/endCoalescing (the DeepSpeed path).
COALESCED_VARIANTS = [dict(via="coalescing_manager", inplace=b) for b in INPLACE_BOTH] + [
    dict(via="coalescing_manager_device", inplace=False), dict(via="functional", inplace=False)]


def coalesced_sizes(dt):
    """Lead-tensor sizes for coalesced calls: 0, 4099 and 3 x BUFFSIZE; with the 1- and
    7-element tensors in each call every size of sizes_for is covered."""
    return [n for n in sizes_for(dt) if n not in COALESCED_LENGTHS]


# ------------------------------------------------------------------ broadcast
def fam_broadcast(ctx):
    def run(case, dt, n, root):
        expected = make_data(_key(case), root, n, dt)
        t = expected.clone() if ctx.rank == root else poison_like(expected)
        dist.broadcast(t, src=root, group=ctx.group)
        return compare(t, expected)

    for di, (case, dt, n, si) in enumerate(moving_cases(ctx, "broadcast")):
        root = di % ctx.world  # every rank is root for some cases
        case.update(root=root, inplace=True)
        ctx.check(case, run, case, dt, n, root)


# ------------------------------------------------------------------ all_reduce
def fam_all_reduce(ctx):
    def run(case, dt, op, n, kind=None):
        key = _key(case)
        if kind:
            inputs = [make_data(key, q, n, dt, kind) for q in range(ctx.world)]
            expected, tol = reference_reduce(inputs, dt, op)
        else:
            inputs, (expected, tol) = _reduced(key, dt, op, ctx.world, n)
        t = inputs[ctx.rank].clone()
        dist.all_reduce(t, op=torch_op(op, dt, ctx.rank), group=ctx.group)
        if ctx.sabotage and ctx.rank == ctx.world - 1 and n > 0:
            t[n // 2] = poison_like(t[n // 2: n // 2 + 1])[0]  # harness self-test only
        return compare(t, expected, tol)

    for case, dt, op, n in reducing_cases(ctx, "all_reduce"):
        case["inplace"] = True
        ctx.check(case, run, case, dt, op, n)
    # Two's-complement wrap-around: values chosen so SUM/PRODUCT overflow the dtype.
    for dname, op in (("int8", "SUM"), ("uint8", "PRODUCT"), ("int32", "SUM"), ("int64", "SUM")):
        for n in (7, 4099):
            case = dict(coll="all_reduce", dtype=dname, op=op, size=n, inplace=True, data="wrap")
            ctx.check(case, run, case, DTYPES[dname], op, n, "wrap")


def fam_all_reduce_coalesced(ctx):
    def run(case, dt, op, n, via):
        lens = (n,) + COALESCED_LENGTHS  # several tensors of different lengths in one call
        tensors, expecteds, tols = [], [], []
        for j, ln in enumerate(lens):
            inputs, (e, tol) = _reduced(_key(case) + (j,), dt, op, ctx.world, ln)
            tensors.append(inputs[ctx.rank].clone())
            expecteds.append(e)
            tols.append(tol)
        rop = torch_op(op, dt, ctx.rank)
        if via == "all_reduce_coalesced":
            dist.all_reduce_coalesced(tensors, op=rop, group=ctx.group)
        else:
            device = torch.device("cpu") if via == "coalescing_manager_device" else None
            with coalescing(ctx.group, device):
                for t in tensors:
                    dist.all_reduce(t, op=rop, group=ctx.group)
        return compare_list(tensors, expecteds, tols)

    vias = [dict(via=v) for v in ("all_reduce_coalesced", "coalescing_manager",
                                  "coalescing_manager_device")]
    for case, dt, op, n in reducing_cases(ctx, "all_reduce_coalesced", vias, coalesced_sizes):
        case["inplace"] = True
        ctx.check(case, run, case, dt, op, n, case["via"])


# ------------------------------------------------------------------ reduce
def fam_reduce(ctx):
    def run(case, dt, op, n, root):
        inputs, (expected, tol) = _reduced(_key(case), dt, op, ctx.world, n)
        t = inputs[ctx.rank].clone()
        dist.reduce(t, dst=root, op=torch_op(op, dt, ctx.rank), group=ctx.group)
        # Non-root buffers are unspecified after reduce (backends differ); only root is checked.
        return compare(t, expected, tol) if ctx.rank == root else None

    for i, (case, dt, op, n) in enumerate(reducing_cases(ctx, "reduce")):
        root = i % ctx.world
        case.update(root=root, inplace=True)
        ctx.check(case, run, case, dt, op, n, root)


# ------------------------------------------------------------------ all_gather family
def fam_all_gather(ctx):
    def run(case, dt, n, inplace, uneven):
        lens = [n + q if uneven else n for q in range(ctx.world)]
        expecteds = [make_data(_key(case), q, lens[q], dt) for q in range(ctx.world)]
        outs = [poison_like(e) for e in expecteds]
        if inplace:
            outs[ctx.rank] = expecteds[ctx.rank].clone()  # input is the rank's own output slot
            inp = outs[ctx.rank]
        else:
            inp = expecteds[ctx.rank].clone()
        dist.all_gather(outs, inp, group=ctx.group)
        return compare_list(outs, expecteds)

    for case, dt, n, _ in moving_cases(ctx, "all_gather", [dict(inplace=b) for b in INPLACE_BOTH]):
        ctx.check(case, run, case, dt, n, case["inplace"], False)
    # Uneven: rank q contributes n + q elements.
    for case, dt, n, _ in moving_cases(ctx, "all_gather", [dict(inplace=False, uneven=True)]):
        ctx.check(case, run, case, dt, n, False, True)


def _gather_into(ctx, key, dt, n, inplace):
    """Output tensor, input tensor and expected output of an all_gather_into_tensor; in-place
    means the input is this rank's slice of the output (FSDP2/DeepSpeed copy-in)."""
    parts = [make_data(key, q, n, dt) for q in range(ctx.world)]
    expected = torch.cat(parts)
    out = poison_like(expected)
    if inplace:
        inp = out.narrow(0, ctx.rank * n, n)
        inp.copy_(parts[ctx.rank])
    else:
        inp = parts[ctx.rank].clone()
    return out, inp, expected


def fam_all_gather_into_tensor(ctx):
    def run(case, dt, n, inplace):
        out, inp, expected = _gather_into(ctx, _key(case), dt, n, inplace)
        dist.all_gather_into_tensor(out, inp, group=ctx.group)
        return compare(out, expected)

    for case, dt, n, _ in moving_cases(ctx, "all_gather_into_tensor",
                                       [dict(inplace=b) for b in INPLACE_BOTH]):
        ctx.check(case, run, case, dt, n, case["inplace"])


def fam_all_gather_into_tensor_coalesced(ctx):
    def run(case, dt, n, inplace, via):
        triples = [_gather_into(ctx, _key(case) + (j,), dt, ln, inplace)
                   for j, ln in enumerate((n,) + COALESCED_LENGTHS)]
        if via == "functional":
            # Functional collectives allocate their outputs: nothing to poison.
            outs = fc.all_gather_into_tensor_coalesced([t[1] for t in triples], ctx.group)
            outs = [fc.wait_tensor(o) for o in outs]
        else:
            device = torch.device("cpu") if via == "coalescing_manager_device" else None
            with coalescing(ctx.group, device):
                for out, inp, _ in triples:
                    dist.all_gather_into_tensor(out, inp, group=ctx.group)
            outs = [t[0] for t in triples]
        return compare_list(outs, [t[2] for t in triples])

    for case, dt, n, _ in moving_cases(ctx, "allgather_into_tensor_coalesced", COALESCED_VARIANTS,
                                       coalesced_sizes):
        ctx.check(case, run, case, dt, n, case["inplace"], case["via"])


# ------------------------------------------------------------------ gather / scatter
def fam_gather(ctx):
    def run(case, dt, n, root, inplace):
        expecteds = [make_data(_key(case), q, n, dt) for q in range(ctx.world)]
        inp = expecteds[ctx.rank].clone()
        if ctx.rank == root:
            glist = [poison_like(e) for e in expecteds]
            if inplace:
                glist[root] = inp  # root's input is its own slot of the gather list
            dist.gather(inp, gather_list=glist, dst=root, group=ctx.group)
            return compare_list(glist, expecteds)
        dist.gather(inp, gather_list=None, dst=root, group=ctx.group)
        return None

    for i, (case, dt, n, _) in enumerate(moving_cases(ctx, "gather",
                                                      [dict(inplace=b) for b in INPLACE_BOTH])):
        root = (i // 2) % ctx.world
        case["root"] = root
        ctx.check(case, run, case, dt, n, root, case["inplace"])


def fam_scatter(ctx):
    def run(case, dt, n, root, inplace):
        chunks = [make_data(_key(case), q, n, dt) for q in range(ctx.world)]
        expected = chunks[ctx.rank]
        if ctx.rank == root:
            slist = [c.clone() for c in chunks]
            out = slist[root] if inplace else poison_like(expected)
            dist.scatter(out, scatter_list=slist, src=root, group=ctx.group)
        else:
            out = poison_like(expected)
            dist.scatter(out, scatter_list=None, src=root, group=ctx.group)
        return compare(out, expected)

    for i, (case, dt, n, _) in enumerate(moving_cases(ctx, "scatter",
                                                      [dict(inplace=b) for b in INPLACE_BOTH])):
        root = (i // 2) % ctx.world
        case["root"] = root
        ctx.check(case, run, case, dt, n, root, case["inplace"])


# ------------------------------------------------------------------ reduce_scatter family
def fam_reduce_scatter(ctx):
    def run(case, dt, op, n, inplace):
        key = _key(case)
        r, w = ctx.rank, ctx.world
        # Rank q's input list holds one n-element tensor per destination rank p.
        mine = [make_data(key + (p,), r, n, dt, kind_for(dt, op)) for p in range(w)]
        _, (expected, tol) = _reduced(key + (r,), dt, op, w, n)
        inputs = [t.clone() for t in mine]
        out = inputs[r] if inplace else poison_like(expected, dt)
        dist.reduce_scatter(out, inputs, op=torch_op(op, dt, r), group=ctx.group)
        return compare(out, expected, tol)

    for case, dt, op, n in reducing_cases(ctx, "reduce_scatter",
                                          [dict(inplace=b) for b in INPLACE_BOTH]):
        ctx.check(case, run, case, dt, op, n, case["inplace"])


def _scatter_from(ctx, key, dt, op, n, inplace):
    """Input, output, reference and tolerance of a reduce_scatter_tensor; in-place means the
    output is this rank's chunk of its input (the FSDP2/DeepSpeed layout). Rank q's input is
    the concatenation over p of chunk (key + (p,), q), so a rank generates only its own input
    and the chunks that reduce into its output."""
    w, r = ctx.world, ctx.rank
    kind = kind_for(dt, op)
    inp = torch.cat([make_data(key + (p,), r, n, dt, kind) for p in range(w)])
    terms = [make_data(key + (r,), q, n, dt, kind) for q in range(w)]
    expected, tol = reference_reduce(terms, dt, op, _factors(op, w))
    out = inp.narrow(0, r * n, n) if inplace else poison_like(expected, dt)
    return inp, out, expected, tol


def fam_reduce_scatter_tensor(ctx):
    def run(case, dt, op, n, inplace):
        inp, out, expected, tol = _scatter_from(ctx, _key(case), dt, op, n, inplace)
        dist.reduce_scatter_tensor(out, inp, op=torch_op(op, dt, ctx.rank), group=ctx.group)
        return compare(out, expected, tol)

    for case, dt, op, n in reducing_cases(ctx, "reduce_scatter_tensor",
                                          [dict(inplace=b) for b in INPLACE_BOTH]):
        ctx.check(case, run, case, dt, op, n, case["inplace"])


FUNCTIONAL_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max",
                  "BAND": "band", "BOR": "bor", "BXOR": "bxor"}


def fam_reduce_scatter_tensor_coalesced(ctx):
    def run(case, dt, op, n, inplace, via):
        quads = [_scatter_from(ctx, _key(case) + (j,), dt, op, ln, inplace)
                 for j, ln in enumerate((n,) + COALESCED_LENGTHS)]
        if via == "functional":
            outs = fc.reduce_scatter_tensor_coalesced(
                [q[0] for q in quads], FUNCTIONAL_OPS[op], [0] * len(quads), ctx.group)
            outs = [fc.wait_tensor(o) for o in outs]
        else:
            device = torch.device("cpu") if via == "coalescing_manager_device" else None
            rop = torch_op(op, dt, ctx.rank)
            with coalescing(ctx.group, device):
                for inp, out, _, _ in quads:
                    dist.reduce_scatter_tensor(out, inp, op=rop, group=ctx.group)
            outs = [q[1] for q in quads]
        return compare_list(outs, [q[2] for q in quads], [q[3] for q in quads])

    for case, dt, op, n in reducing_cases(ctx, "reduce_scatter_tensor_coalesced",
                                          COALESCED_VARIANTS, coalesced_sizes):
        if case["via"] == "functional" and op not in FUNCTIONAL_OPS:
            continue  # functional collectives take the op as a string: no PREMUL_SUM factor
        ctx.check(case, run, case, dt, op, n, case["inplace"], case["via"])


# ------------------------------------------------------------------ all_to_all family
def _split(q, p, n, world):
    """Elements rank q sends to rank p: uneven (depends on both), 0 when n is 0."""
    return 0 if n == 0 else n // world + (q + 2 * p) % 3


def fam_all_to_all_single(ctx):
    def run(case, dt, n, uneven):
        w, r = ctx.world, ctx.rank
        count = (lambda q, p: _split(q, p, n, w)) if uneven else (lambda q, p: n)
        key = _key(case)
        # Rank q's input is the concatenation over p of the piece (key + (p,), q) it sends to p.
        inp = torch.cat([make_data(key + (p,), r, count(r, p), dt) for p in range(w)])
        expected = torch.cat([make_data(key + (r,), q, count(q, r), dt) for q in range(w)])
        out = poison_like(expected)
        if uneven:
            dist.all_to_all_single(out, inp, output_split_sizes=[count(q, r) for q in range(w)],
                                   input_split_sizes=[count(r, p) for p in range(w)],
                                   group=ctx.group)
        else:
            dist.all_to_all_single(out, inp, group=ctx.group)
        return compare(out, expected)

    for case, dt, n, _ in moving_cases(ctx, "all_to_all_single",
                                       [dict(split_sizes=b, inplace=False) for b in (False, True)]):
        ctx.check(case, run, case, dt, n, case["split_sizes"])


def fam_all_to_all(ctx):
    def run(case, dt, n, uneven):
        w, r = ctx.world, ctx.rank
        count = (lambda q, p: _split(q, p, n, w)) if uneven else (lambda q, p: n)
        key = _key(case)
        inputs = [make_data(key + (p,), r, count(r, p), dt) for p in range(w)]
        expecteds = [make_data(key + (r,), q, count(q, r), dt) for q in range(w)]
        outs = [poison_like(e) for e in expecteds]
        dist.all_to_all(outs, inputs, group=ctx.group)
        return compare_list(outs, expecteds)

    for case, dt, n, _ in moving_cases(ctx, "all_to_all",
                                       [dict(uneven=b, inplace=False) for b in (False, True)]):
        ctx.check(case, run, case, dt, n, case["uneven"])


# ------------------------------------------------------------------ non-contiguous inputs
def fam_noncontiguous(ctx):
    """A non-contiguous tensor must either work (view elements right, the rest of the base
    untouched) or raise an error that says "contiguous"; either way the group keeps working."""
    w, r = ctx.world, ctx.rank

    def outcome(run_op, check):
        try:
            run_op()
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            if "contiguous" in msg.lower():
                return None, f"raises: {msg.splitlines()[0][:200]}"
            return f"raised an error that does not mention contiguity: {type(e).__name__}: {msg[:300]}", None
        return check(), "works"

    def all_reduce_view():
        bases = [make_data(("nc_ar",), q, 48, torch.float32).reshape(6, 8) for q in range(w)]
        base = bases[r].clone()
        view = base[:, ::2]
        expected = sum(b.double() for b in bases)[:, ::2]
        untouched = bases[r][:, 1::2].clone()

        def check():
            return (compare(view, expected, ("abs", 1e-6 * sum(b.double().abs() for b in bases)[:, ::2]))
                    or compare(base[:, 1::2], untouched, label="outside the view: "))
        return outcome(lambda: dist.all_reduce(view, group=ctx.group), check)

    def broadcast_view():
        src = make_data(("nc_bc",), 0, 35, torch.int32).reshape(5, 7)
        base = src.clone() if r == 0 else poison_like(src)
        view = base.t()

        def check():
            return compare(view, src.t())
        return outcome(lambda: dist.broadcast(view, src=0, group=ctx.group), check)

    def all_gather_view():
        parts = [make_data(("nc_ag",), q, 20, torch.float64).reshape(4, 5) for q in range(w)]
        inp = parts[r].clone()[:, 1:4]
        expected = torch.cat([p[:, 1:4] for p in parts])  # (world*4, 3), as torch requires
        out = poison_like(expected)

        def check():
            return compare(out, expected)
        return outcome(lambda: dist.all_gather_into_tensor(out, inp, group=ctx.group), check)

    def after():
        t = torch.full((5,), float(r + 1))
        dist.all_reduce(t, group=ctx.group)
        return compare(t, torch.full((5,), float(w * (w + 1) // 2)))

    for name, fn in (("all_reduce", all_reduce_view), ("broadcast", broadcast_view),
                     ("all_gather_into_tensor", all_gather_view)):
        case = dict(coll=name, dtype="mixed", size=-1, layout="non-contiguous")
        result = {}

        def run(fn=fn, result=result):
            problem, behaviour = fn()
            result["behaviour"] = behaviour
            return problem
        ctx.check(case, run)
        if result.get("behaviour"):
            ctx.note(dict(case, note="behaviour"), "info", result["behaviour"])
        ctx.check(dict(case, then="group still works"), after)


# ------------------------------------------------------------------ float8
def fam_float8(ctx):
    import float8
    for case, fn in float8.cases(ctx.rank, ctx.world, lambda: ctx.group):
        ctx.check(case, fn)


FAMILIES = [
    ("broadcast", fam_broadcast, 1),
    ("all_reduce", fam_all_reduce, 1),
    ("all_reduce_coalesced", fam_all_reduce_coalesced, 1),
    ("reduce", fam_reduce, 1),
    ("all_gather", fam_all_gather, 1),
    ("all_gather_into_tensor", fam_all_gather_into_tensor, 1),
    ("allgather_into_tensor_coalesced", fam_all_gather_into_tensor_coalesced, 1),
    ("gather", fam_gather, 1),
    ("scatter", fam_scatter, 1),
    ("reduce_scatter", fam_reduce_scatter, 1),
    ("reduce_scatter_tensor", fam_reduce_scatter_tensor, 1),
    ("reduce_scatter_tensor_coalesced", fam_reduce_scatter_tensor_coalesced, 1),
    ("all_to_all_single", fam_all_to_all_single, 1),
    ("all_to_all", fam_all_to_all, 1),
    ("float8", fam_float8, 1),
]
LATE_FAMILIES = [("noncontiguous", fam_noncontiguous, 1)]
