"""tools/op_timeline.py, tools/launch_cost.py, tools/ab_env.py and tools/perf_table.py, the
diagnostics and table maker docs/PERFORMANCE.md quotes: each runs, and prints one row per
case with numbers that hold together."""
import os
import re
import subprocess
import sys

from launch import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def run(args, timeout=240):
    p = subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_op_timeline_rows(tmp_path):
    ops = ["broadcast", "all_reduce", "all_gather_ip"]
    out = run(["tools/op_timeline.py", "--nproc", "2", "--ops", ",".join(ops), "--bytes",
               "64", "-n", "100", "--keep", str(tmp_path)])
    rows = {}
    for line in out.splitlines():
        f = line.replace("|", " ").split()
        if f and f[0] in ops:
            rows[(f[0], int(f[1]))] = [float(x) for x in f[2:]]
    assert sorted(rows) == sorted((op, r) for op in ops for r in (0, 1)), out
    for key, v in rows.items():
        assert len(v) == 13, (key, v)  # us/op, then p10/median/p90 of four intervals
        per_call, launch, start, run_, gap = v[0], v[1:4], v[4:7], v[7:10], v[10:13]
        for trio in (launch, start, run_, gap):
            assert 0 <= trio[0] <= trio[1] <= trio[2], (key, v)
        # every timed call is queued and started inside the timed loop, so the n-1 intervals
        # of each kind sum to at most n x us/op, and no more than half of them can exceed
        # twice their mean: the medians are at most ~2 x us/op
        assert per_call > 0, (key, v)
        assert launch[1] <= 3 * per_call and start[1] <= 3 * per_call, (key, v)
    # one flight record per op and rank, as written by the ranks
    for op in ops:
        assert len(list((tmp_path / op).glob("*.json"))) == 2, op


def test_op_timeline_rejects_unknown_op():
    p = subprocess.run([sys.executable, "tools/op_timeline.py", "--ops", "bogus"], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "ops from" in p.stderr, p.stderr


def test_launch_cost_layers():
    out = run(["tools/launch_cost.py", "chorus"])
    got = dict(re.findall(r"^chorus\s+(\S+)\s+([\d.]+) us per launch$", out, re.M))
    names = [f"{layer}.{op}" for op in ("broadcast", "allreduce") for layer in ("pg", "backend")]
    names += ["dist.broadcast", "dist.all_reduce"]
    assert sorted(got) == sorted(names), out
    for name, us in got.items():
        assert 0 < float(us) < 1000, (name, us)
    # torch's Python function does at least what the ProcessGroup call it makes does
    assert float(got["dist.broadcast"]) > 0.8 * float(got["pg.broadcast"]), out


def test_ab_env_alternates_variants(tmp_path):
    """tools/ab_env.py: each variant's variables reach its jobs (an unknown algorithm fails
    communicator creation, so that variant's jobs fail and the tool says so), and the
    summary gives every size and half of the variant that ran, over both rounds."""
    p = subprocess.run([sys.executable, "tools/ab_env.py", "--rounds", "2", "--out",
                        str(tmp_path), "-v", "base", "-v",
                        "bad:CHORUS_ALGO=allreduce:nosuch,broadcast:ring", "--", "--nproc", "2",
                        "-o", "all_reduce", "-b", "8", "-e", "64", "-f", "8", "-n", "5", "-w",
                        "1"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.count("job failed") == 2, p.stderr
    assert "CHORUS_ALGO=allreduce:nosuch,broadcast:ring" in p.stderr, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.startswith("all_reduce ")]
    want = [f"all_reduce {s} {h}" for s in (8, 64) for h in ("in place", "out-of-place")]
    assert sorted(r.split(" |")[0] for r in rows) == sorted(want), p.stdout
    for r in rows:
        base, bad = r.split(" | ")[1:]
        m = re.fullmatch(r"([\d.]+) \(([\d.]+)\.\.([\d.]+)\)", base)
        assert m and float(m[2]) <= float(m[1]) <= float(m[3]), r
        assert bad == "-", r
    assert sorted(x.name for x in tmp_path.glob("*.json")) == ["base-r0.json", "base-r1.json"]


def test_ab_env_rejects_bad_variants():
    for args in (["-v", "x:NOEQUALS"], ["-v", "a", "-v", "a"], ["-v", "a", "--rounds", "0"]):
        p = subprocess.run([sys.executable, "tools/ab_env.py", *args, "--", "-o",
                            "all_reduce"], cwd=REPO, env=ENV, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and "ab_env.py: error" in p.stderr, (args, p.stderr)


def test_perf_table_from_a_bench_job(tmp_path):
    """tools/perf_table.py on a job laid out as tools/perf_cpu.sh leaves it (NAME-1.json and
    the job's stdout as NAME-1.txt): a table per collective with a row per size, both
    backends' times and the speed-up, and the memcpy figure of the job's header."""
    p = subprocess.run([sys.executable, "-m", "chorus.bench", "--nproc", "2", "--compare",
                        "gloo", "-o", "all_reduce,alltoall", "-b", "8", "-e", "512", "-f", "8",
                        "-n", "3", "-w", "1", "--json", str(tmp_path / "others-1.json")],
                       cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    (tmp_path / "others-1.txt").write_text(p.stdout)
    header = re.search(r"memcpy \(1 core\): ([\d.]+) GB/s", p.stdout)
    assert header, p.stdout
    out = run(["tools/perf_table.py", str(tmp_path), "others"])
    assert f"memcpy (1 core, one figure per job): {header[1]} GB/s" in out, out
    for op in ("all_reduce", "alltoall"):
        assert f"**{op}**" in out, out
    rows = [line for line in out.splitlines() if re.match(r"\| (8|64|512) \|", line)]
    assert len(rows) == 6, out  # three sizes per collective
    for r in rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0, r
        assert re.fullmatch(r"[\d.]+x( \(slower\))?", cells[3]), r
