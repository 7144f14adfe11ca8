"""`python -m chorus.bench`: real multi-process sweeps (--nproc 2 and 3, every op) read back
through the printed table and the --json records, plus the wrong-result, failed-rank and
bad-input paths. Small sizes and few iterations: the whole file is meant to stay well under a
minute on 2 cores."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "alltoall",
       "sendrecv")
NO_INPLACE = ("alltoall", "sendrecv")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
FIELDS = {"op", "backend", "bytes", "count", "dtype", "redop", "inplace", "time_us",
          "algbw_gbps", "busbw_gbps", "wrong"}
SWEEP = ["-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1"]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
# Passed to every run: a rank process still holding it after its run is an orphan.
TOKEN_ENV = "CHORUS_BENCH_TEST_TOKEN"


def factor(op, n):
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def leftover_ranks(token):
    """Pids of processes whose environment holds token (the ranks of one run)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def bench(*args, env=None, timeout=120):
    token = uuid.uuid4().hex
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                    **{TOKEN_ENV: token})
    full_env.update(env or {})
    p = subprocess.Popen([sys.executable, "-m", "chorus.bench", *map(str, args)],
                         env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"bench {' '.join(map(str, args))} timed out\n{out}\n{err}")
    return p.returncode, out, err, token


def parse(out, compare):
    """Rows of the table: dicts with op, backend, size, count, type, redop, root, and per
    half (oop, ip) a dict of time/algbw/busbw/wrong/speedup as printed."""
    rows, op = [], None
    for line in out.splitlines():
        m = re.match(r"^# (\w+)(?: \(|,)", line)
        if m and m.group(1) in OPS:
            op = m.group(1)
            continue
        if not line.strip() or line.startswith("#"):
            continue
        tok = line.split()
        lead = 1 if compare else 0
        per_half = 5 if compare else 4
        assert len(tok) == lead + 5 + 2 * per_half, f"unparsable row: {line!r}"
        row = dict(op=op, backend=tok[0] if compare else None, size=int(tok[lead]),
                   count=int(tok[lead + 1]), type=tok[lead + 2], redop=tok[lead + 3],
                   root=int(tok[lead + 4]))
        for h, name in enumerate(("oop", "ip")):
            cells = tok[lead + 5 + h * per_half: lead + 5 + (h + 1) * per_half]
            row[name] = None if cells[0] == "n/a" else dict(
                time=float(cells[0]), algbw=float(cells[1]), busbw=float(cells[2]),
                wrong=cells[3], speedup=cells[4] if compare else None)
        rows.append(row)
    return rows


def check_rows(rows, n, backends):
    assert {r["op"] for r in rows} == set(OPS)
    for op in OPS:
        for be in backends:
            mine = [r for r in rows if r["op"] == op and r["backend"] == be]
            g = n * 4 if op in ("all_gather", "reduce_scatter", "alltoall") else 4
            # nccl-tests sizes from -b 8 -e 64K -f 8, rounded down to the granularity
            assert [r["size"] for r in mine] == [max(g, s // g * g)
                                                 for s in (8, 64, 512, 4096, 32768)], op
            for r in mine:
                per = n if g > 4 else 1
                assert r["count"] * 4 * per == r["size"], r
                assert r["type"] == "float"
                assert r["redop"] == ("sum" if op in REDUCING else "none")
                assert r["root"] == (0 if op in ("broadcast", "reduce") else -1)
                assert r["oop"] is not None, r
                assert (r["ip"] is None) == (op in NO_INPLACE), r
                for h in (r["oop"], r["ip"]):
                    if h is not None:
                        assert h["wrong"] == "0", r
                        assert h["time"] > 0
                        assert h["busbw"] == pytest.approx(h["algbw"] * factor(op, n),
                                                           abs=0.011)


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench2")
    args = ["--nproc", 2, "-o", "all", *SWEEP, "--compare", "gloo",
            "--json", d / "r.json"]
    if HAVE_MPL:
        args += ["--plot", d / "r.png"]
    rc, out, err, token = bench(*args)
    return dict(rc=rc, out=out, err=err, dir=d, token=token)


def test_two_ranks_every_op_against_gloo(compare_run):
    r = compare_run
    assert r["rc"] == 0, r["out"] + r["err"]
    assert not leftover_ranks(r["token"])
    out = r["out"]
    assert "# world size 2" in out and "compared with gloo" in out
    assert re.search(r"^# host: \d+ CPUs.*memcpy \(1 core\): [\d.]+ GB/s", out, re.M), out
    rows = parse(out, compare=True)
    check_rows(rows, 2, ("chorus", "gloo"))
    for row in rows:
        for h in (row["oop"], row["ip"]):
            if h is None:
                continue
            if row["backend"] == "chorus":
                assert float(h["speedup"]) > 0, row
            else:
                assert h["speedup"] == "-", row
    # one summary per op: bandwidths of both backends and the speed-up
    assert len(re.findall(r"^# Avg bus bandwidth    : [\d.e+-]+$", out, re.M)) == len(OPS)
    assert len(re.findall(r"^# Avg bus bandwidth \(gloo\) : [\d.e+-]+$", out, re.M)) == len(OPS)
    speed = re.findall(r"^# Speed-up chorus vs gloo \(gloo time / chorus time\): "
                       r"min ([\d.]+)x \(\d+ B (?:in|out-of)-place\), geomean ([\d.]+)x "
                       r"over (\d+) measurements$", out, re.M)
    assert len(speed) == len(OPS), out
    for lo, gm, cnt in speed:
        assert 0 < float(lo) <= float(gm) and int(cnt) > 0
    assert out.count("# Out of bounds values (chorus) : 0 OK") == len(OPS)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.mark.parametrize("tty", [False, True])
def test_progress_line_after_a_few_seconds(monkeypatch, capsys, tty):
    """A run that goes on for more than 2 s gets a progress line on stderr: on a terminal
    redrawn in place, in a log a plain line at 2 s and every 10 s after; nothing before 2 s,
    and nothing on the other ranks."""
    from chorus import bench as bench_mod

    clock = FakeClock()
    monkeypatch.setattr(bench_mod.time, "monotonic", clock)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    quiet = bench_mod.Progress(False)
    p = bench_mod.Progress(True)
    seen = []
    for i, t in enumerate([0.5, 1.9, 2.1, 2.5, 5.0, 12.2, 12.5, 30.0]):
        clock.t = 1000.0 + t
        p.update("all_reduce", i, 8)
        quiet.update("all_reduce", i, 8)
        seen.append(capsys.readouterr().err)
    assert seen[0] == seen[1] == "", seen  # under 2 s: nothing
    if tty:
        assert seen[2] == "\rbench: all_reduce 2/8 sizes, 2 s", seen
        assert all(x.startswith("\rbench: all_reduce ") for x in seen[2:]), seen
        p.done()
        assert capsys.readouterr().err.strip("\r ") == ""  # the line is wiped for the table
    else:
        assert seen[2] == "bench: all_reduce 2/8 sizes, 2 s\n", seen
        assert seen[3] == seen[4] == "" and seen[6] == "", seen  # within 10 s of the last
        assert seen[5] == "bench: all_reduce 5/8 sizes, 12 s\n", seen
        assert seen[7] == "bench: all_reduce 7/8 sizes, 30 s\n", seen


def test_progress_line_in_a_real_run():
    """The run through a pipe: rank 0 prints plain progress lines once it has gone on for
    2 s, one run over all its ops (each op alone may take less)."""
    t0 = time.monotonic()
    rc, out, err, _ = bench("--nproc", 2, "-o", "all_reduce,all_gather,broadcast", "-b", "8",
                            "-e", "16M", "-f", "4", "-n", "10", "-w", "2", "--compare", "gloo")
    took = time.monotonic() - t0
    assert rc == 0, out + err
    lines = re.findall(r"^bench: (\w+) (\d+)/(\d+) sizes, (\d+) s$", err, re.M)
    # the ranks' start and memcpy come first (3..4 s on the 2-core machine, where the whole
    # job takes 7..8 s): past 6 s, the sweep itself went on for more than 2 s
    if took > 6:
        assert lines, err
    for op, i, n, secs in lines:
        assert op in ("all_reduce", "all_gather", "broadcast") and int(i) < int(n) == 11
        assert int(secs) >= 2
    assert "\r" not in err


def test_json_records(compare_run):
    assert compare_run["rc"] == 0, compare_run["err"]
    recs = json.loads((compare_run["dir"] / "r.json").read_text())
    assert isinstance(recs, list)
    for rec in recs:
        assert set(rec) == FIELDS, rec
    # one record per row and nothing else: 7 ops x 5 sizes x 2 backends x 2 halves, less
    # in-place alltoall and sendrecv (the memcpy figure is in the header, not a record)
    rows = recs
    assert len(rows) == (7 * 2 - 2) * 5 * 2
    for x in rows:
        assert x["backend"] in ("chorus", "gloo")
        assert x["dtype"] == "float" and isinstance(x["inplace"], bool)
        assert x["redop"] == ("sum" if x["op"] in REDUCING else None)
        assert x["wrong"] == 0
        assert x["time_us"] > 0 and x["count"] > 0
        assert x["algbw_gbps"] == pytest.approx(x["bytes"] / x["time_us"] / 1e3)
        assert x["busbw_gbps"] == pytest.approx(x["algbw_gbps"] * factor(x["op"], 2))
        assert not (x["inplace"] and x["op"] in NO_INPLACE)
    table = {(r["op"], r["backend"], r["size"]): r
             for r in parse(compare_run["out"], compare=True)}
    for x in rows:
        row = table[(x["op"], x["backend"], x["bytes"])]
        assert row["count"] == x["count"]
        printed = row["ip" if x["inplace"] else "oop"]["time"]
        assert printed == pytest.approx(x["time_us"], rel=0.01, abs=0.01)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not importable here (make test "
                    "installs it)")
def test_plot_png(compare_run):
    assert compare_run["rc"] == 0, compare_run["err"]
    png = compare_run["dir"] / "r.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10000


def test_three_ranks_every_op_plain_columns():
    rc, out, err, token = bench("--nproc", 3, "-o", "all", *SWEEP)
    assert rc == 0, out + err
    assert not leftover_ranks(token)
    rows = parse(out, compare=False)
    check_rows(rows, 3, (None,))
    # nccl-tests header and summary lines
    assert re.search(r"^#\s+size\s+count\s+type\s+redop\s+root\s+time\s+algbw\s+busbw\s+"
                     r"#wrong\s+time\s+algbw\s+busbw\s+#wrong$", out, re.M), out
    assert out.count("# Out of bounds values : 0 OK") == len(OPS)
    assert len(re.findall(r"^# Avg bus bandwidth    : [\d.e+-]+$", out, re.M)) == len(OPS)
    assert "sizes rounded down to a multiple of 12 B (3 ranks x 4 B)" in out
    assert "speedup" not in out


def test_blocking_mode_waits_each_op(tmp_path):
    # -z 1 (nccl-tests' --blocking): every op waited before the next, results still checked
    rc, out, err, token = bench("--nproc", 2, "-o", "all", *SWEEP, "-z", 1, "--compare",
                                "gloo", "--json", tmp_path / "r.json")
    assert rc == 0, out + err
    assert not leftover_ranks(token)
    assert "of the mean of 3 blocking ops (each waited before the next)" in out, out
    check_rows(parse(out, compare=True), 2, ("chorus", "gloo"))
    records = json.loads((tmp_path / "r.json").read_text())
    assert records and all(r["wrong"] == 0 for r in records), records


@pytest.mark.parametrize("blocking", [0, 1])
def test_blocking_waits_before_each_launch(monkeypatch, blocking):
    # The timing loop itself, with a runner that records calls: -z 1 drains after every
    # start, the default only once at the end.
    from chorus import bench as B
    calls = []

    class Recorder:
        def __init__(self, *args):
            self.align = None

        def start(self, k):
            calls.append(f"start{k}")

        def drain(self):
            calls.append("drain")

    monkeypatch.setattr(B, "Runner", Recorder)
    monkeypatch.setattr(B.dist, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(B.dist, "all_reduce", lambda *a, **k: None)
    ctx = B.Ctx()
    ctx.check, ctx.warmup, ctx.iters, ctx.cuda, ctx.blocking, ctx.ctrl = 0, 1, 3, False, \
        blocking, None
    t, wrong = B.measure(ctx, "all_reduce", True, None, None, None, None)
    assert t > 0 and wrong is None
    if blocking:
        assert calls == ["start0", "drain", "drain",
                         "start0", "drain", "start1", "drain", "start2", "drain", "drain"]
    else:
        assert calls == ["start0", "drain", "start0", "start1", "start2", "drain"]


def test_emulated_out_of_place_rotates_output_buffers(monkeypatch):
    # One output buffer per call within 4 MiB (at least two); call k copies into buffer
    # k % depth and waits first for the call that last used it, never for a newer one.
    import torch
    from chorus import bench as B
    ctx = B.Ctx()
    ctx.iters, ctx.warmup, ctx.world, ctx.rank, ctx.root = 10, 2, 2, 1, 0
    ctx.dtype, ctx.device, ctx.cuda, ctx.redop = torch.float32, "cpu", False, None
    assert len(B.Buffers("all_reduce", 32, 8, ctx).out) == 10
    assert len(B.Buffers("broadcast", 1 << 20, 1 << 18, ctx).out) == 4
    assert len(B.Buffers("reduce", 4 << 20, 1 << 20, ctx).out) == 2
    assert len(B.Buffers("reduce", 64 << 20, 16 << 20, ctx).out) == 2
    assert len(B.Buffers("all_gather", 32, 8, ctx).out) == 1
    log = []

    class Work:
        def __init__(self, k):
            self.k = k

        def wait(self):
            log.append(("wait", self.k))

    calls = []

    def fake_all_reduce(buf, **kw):
        calls.append(buf.data_ptr())
        log.append(("call", len(calls) - 1))
        return Work(len(calls) - 1)

    monkeypatch.setattr(B.dist, "all_reduce", fake_all_reduce)
    bufs = B.Buffers("all_reduce", 1 << 20, 1 << 18, ctx)
    runner = B.Runner("all_reduce", False, None, bufs, ctx)
    for k in range(10):
        runner.start(k)
    ptrs = [t.data_ptr() for t in bufs.out]
    assert calls == [ptrs[k % 4] for k in range(10)]
    expect = []
    for k in range(10):
        if k >= 4:
            expect.append(("wait", k - 4))
        expect.append(("call", k))
    assert log == expect
    runner.drain()
    assert sorted(k for w, k in log[len(expect):]) == [6, 7, 8, 9]


@pytest.mark.parametrize("dtype", ["f8e4m3", "float8_e5m2"])
def test_float8_rows_are_checked(tmp_path, dtype):
    # 3 ranks: sums of the pattern leave what float8 holds exactly and round once
    rc, out, err, _ = bench("--nproc", 3, "-o", "all_reduce,reduce_scatter,all_gather",
                            "-d", dtype, "-b", "8", "-e", "64K", "-f", "32", "-n", "2",
                            "-w", "1", "--json", tmp_path / "r.json")
    assert rc == 0, out + err
    records = json.loads((tmp_path / "r.json").read_text())
    assert len(records) == 3 * 3 * 2, records
    want = "f8e4m3" if dtype == "f8e4m3" else "f8e5m2"  # nccl-tests' name for the alias
    for r in records:
        assert r["dtype"] == want and r["wrong"] == 0 and r["time_us"] > 0, r


def test_wrong_result_is_detected():
    # Test-only hook: one element of the checked out-of-place output is changed.
    rc, out, err, _ = bench("--nproc", 2, "-o", "all_reduce,reduce_scatter", "-b", "1K",
                            "-e", "1K", "-n", "2", "-w", "0",
                            env={"_CHORUS_BENCH_TEST_CORRUPT": "1"})
    assert rc == 3, out + err
    rows = parse(out, compare=False)
    assert len(rows) == 2
    for r in rows:
        assert int(r["oop"]["wrong"]) > 0 and r["ip"]["wrong"] == "0", r
    assert out.count("FAILED") == 2
    assert "wrong results" in err


def test_failed_rank_is_reported_and_nothing_is_left():
    rc, out, err, token = bench("--nproc", 2, "-o", "all_reduce", "-b", "1K", "-e", "1K",
                                "-n", "2", "--kill-after", "5",
                                env={"_CHORUS_BENCH_TEST_FAIL_RANK": "1"})
    assert rc == 1, out + err
    assert "bench: rank 1 failed (exit code 7)" in err, err
    assert re.search(r"ranks? failed", err)
    assert not leftover_ranks(token)


@pytest.mark.parametrize("same", [False, True], ids=["session-each", "same-session"])
def test_rank_sessions(same):
    # Each rank leads a session of its own, as under torchrun, unless --same-session; the
    # header says which. With --same-session each rank still leads its own process group,
    # so a failed rank's peers are stopped without signalling the launcher's group.
    extra = ["--same-session"] if same else []
    rc, out, err, _ = bench("--nproc", 2, *extra, "-o", "all_reduce", "-b", "8", "-e", "8",
                            "-n", "2", "-w", "0")
    assert rc == 0, out + err
    want = "shares its launcher's session" if same else "leads a session of its own"
    assert f"# session: rank 0 {want}; kernel autogroup scheduling" in out, out
    rc, out, err, token = bench("--nproc", 2, *extra, "-o", "all_reduce", "-b", "1K", "-e",
                                "1K", "-n", "2", "--kill-after", "5",
                                env={"_CHORUS_BENCH_TEST_FAIL_RANK": "1"})
    assert rc == 1, out + err
    assert "bench: rank 1 failed (exit code 7)" in err, err
    assert not leftover_ranks(token)


def run_main(capsys, args):
    """chorus.bench.main in this process (argument errors are found before any rank starts,
    so this is the same code path as the command, without the cost of a torch import)."""
    from chorus import bench as bench_mod

    try:
        rc = bench_mod.main([str(a) for a in args])
    except SystemExit as e:  # argparse: --help, and errors in the argument types
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("args, message", [
    (["-o", "all_reduce,bogus"], "unknown op 'bogus'"),
    (["-b", "1M", "-e", "1K"], "is larger than -e/--maxbytes"),
    (["-e", "12X"], "not a size: '12X'"),
    (["-f", "1", "-b", "8", "-e", "64"], "-f/--stepfactor must be > 1"),
    (["--nproc", 2, "-o", "broadcast", "-r", 2], "-r/--root 2 is not a rank of 2"),
    (["-d", "int32", "--redop", "avg"], "only defined here for floating types"),
    (["-d", "complex"], "unknown datatype 'complex'"),
    (["--compare", "chorus"], "is the backend under test already"),
    (["--same-session"], "--same-session applies only to ranks started with --nproc"),
    (["--nproc", 0], "--nproc must be >= 1"),
    (["--nproc", -3], "--nproc must be >= 1"),
], ids=["op", "min-max", "size", "factor", "root", "avg-int", "dtype", "compare-self",
        "same-session", "nproc-0", "nproc-negative"])
def test_bad_input_is_a_clear_error(capsys, args, message):
    rc, out, err = run_main(capsys, args)
    assert rc == 2, out + err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("has_nccl", [True, False])
def test_compare_nccl_needs_nccl_and_cuda_tensors(capsys, monkeypatch, has_nccl):
    # before: every rank died in new_group() with a traceback
    import torch.distributed as dist
    monkeypatch.setattr(dist, "is_nccl_available", lambda: has_nccl)
    rc, out, err = run_main(capsys, ["--nproc", 2, "--compare", "nccl", "-b", 8, "-e", 8])
    assert rc == 2, out + err
    want = "NCCL moves CUDA tensors only: add --device cuda" if has_nccl else \
        "this torch build has no NCCL"
    assert f"--compare nccl: {want}" in err and "Traceback" not in err, err


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, out, err = run_main(capsys, ["--nproc", 2, "--plot", tmp_path / "x.png"])
    assert rc == 2, out + err
    assert "--plot needs matplotlib" in err and "Traceback" not in err, err
    assert not (tmp_path / "x.png").exists()


def test_help_documents_every_flag(capsys):
    rc, out, err = run_main(capsys, ["--help"])
    assert rc == 0, err
    for flag in ("--op", "--minbytes", "--maxbytes", "--stepfactor", "--iters",
                 "--warmup_iters", "--blocking", "--check", "--datatype", "--root", "--redop", "--device",
                 "--backend", "--compare", "--nproc", "--same-session", "--json", "--plot", "busbw",
                 "memcpy (1 core)", "speed-up", "in-place", "K/M/G"):
        assert flag in out, flag
    for op in OPS:
        assert op in out


def test_helper_threads_split_big_copies_and_reductions():
    # CHORUS_SHM_THREADS=2: each rank's engine hands half of every big same-host copy and
    # reduction to a helper thread; chunks of 1 MiB so that the splits happen; odd rank
    # count so that slices are uneven. Every result is checked by the benchmark.
    rc, out, err, token = bench("--nproc", 3, "-o", "all", "-b", "384K", "-e", "3M", "-f", 8,
                                "-n", 1, "-w", 1,
                                env={"CHORUS_SHM_THREADS": "2", "CHORUS_SHM_SCRATCH": "2M",
                                     "CHORUS_DEBUG": "INFO", "CHORUS_DEBUG_SUBSYS": "INIT"})
    assert rc == 0, out + err
    assert not leftover_ranks(token)
    assert err.count("1 helper thread(s) for same-host copies") == 3, err
    rows = parse(out, compare=False)
    assert len(rows) == 2 * len(OPS), out
    for r in rows:
        assert r["oop"]["wrong"] == "0" and (r["ip"] is None or r["ip"]["wrong"] == "0"), r
