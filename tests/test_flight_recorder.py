"""Flight recorder (issue bar): rank 2 of 4 skips one all_reduce.

Two jobs of 4 ranks on CPU, run side by side (tests/workers/flight_recorder.py):
- timeout: every call has one shape. Chorus numbers collectives per communicator, so the
  skipper's later calls pair with the others' and nothing is noticed until the others' last
  all_reduce, which nobody answers: the survivors time out (group timeout 5 s). The skipper,
  busy elsewhere meanwhile, then calls barrier() and fails too. Every rank's record is in
  CHORUS_TRACE_DIR before its exception surfaces, and `python -m chorus.trace` names rank 2
  and the sequence number the others are stuck at (the one it never started). Before that,
  the on-demand dumps: chorus.dump_trace() (all communicators, and one group) and
  CHORUS_TRACE_SIGNAL=SIGUSR2, each record checked against the calls made.
- mismatch: the calls' sizes differ per step, so the skipper's next call meets the others'
  skipped one: the fingerprint fails every rank at once (no timeout), and chorus.trace names
  rank 2 as the rank whose call at that sequence number differs from the other three.
Also: chorus.trace on the records with one rank's file removed says that rank wrote none.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from launch import REPO, WORKERS, Job, backend_under_test

WORKER = os.path.join(WORKERS, "flight_recorder.py")
SKIPPER = 2
WORLD = 4
ONDEMAND_OPS = 2  # all_reduce calls the timeout job makes before the loop


def run_trace_tool(directory, *extra):
    return subprocess.run([sys.executable, "-m", "chorus.trace", str(directory), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def failures(res):
    out = {}
    for r in res.ranks:
        m = re.search(r"^FAILED (\S+) ([01]) (.*)$", r.output, re.M)
        assert m, f"rank {r.rank} did not fail:\n" + res.describe()
        out[r.rank] = (m.group(1), m.group(2) == "1", m.group(3))
    return out


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's flight recorder")
def test_flight_recorder_names_the_skipping_rank(tmp_path):
    jobs = {}
    for mode in ("timeout", "mismatch"):
        d = tmp_path / mode
        (d / "trace").mkdir(parents=True)
        env = {"MODE": mode, "SKIPPER": str(SKIPPER), "CHORUS_TEST_PG_TIMEOUT": "5",
               "CHORUS_TRACE_DIR": str(d / "trace"), "CHORUS_TRACE_SIGNAL": "SIGUSR2",
               "ONDEMAND": "1" if mode == "timeout" else "0",
               "CHORUS_DEBUG_FILE": str(d / "chorus.%p.log")}
        jobs[mode] = (d, Job(f"flight-{mode}", WORKER, WORLD, args=[str(d)], env=env))
    results = {mode: job.wait(timeout=150) for mode, (d, job) in jobs.items()}

    # ---------------------------------------------------------------- timeout
    d, res = jobs["timeout"][0], results["timeout"]
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert "API_OK" in r.output and "SIGNAL_OK" in r.output, res.describe()
    fails = failures(res)
    stuck_seq = ONDEMAND_OPS + 7  # the survivors' 8th call of the loop
    for rank, (etype, on_disk, msg) in fails.items():
        assert etype == "DistBackendError", (rank, msg)
        assert on_disk, f"rank {rank}: its record was not on disk when the exception surfaced"
        if rank != SKIPPER:
            assert f"seq {stuck_seq}" in msg, (rank, msg)
    assert any("timed out" in fails[r][2] for r in fails if r != SKIPPER), fails
    files = sorted(os.listdir(d / "trace"))
    assert len(files) == WORLD and all(f.endswith(".json") for f in files), files
    reasons = {}
    for f in files:
        rec = json.loads((d / "trace" / f).read_text())
        reasons[rec["rank"]] = rec["reason"]
        assert rec["error"] and rec["failed"], rec
        assert rec["host"] and rec["pid"] > 0 and rec["world"] == WORLD
    assert sorted(reasons) == list(range(WORLD)), reasons
    assert all(v in ("timeout", "failure") for v in reasons.values()), reasons

    tool = run_trace_tool(d / "trace")
    text = tool.stdout + tool.stderr
    assert tool.returncode == 1, text
    assert re.search(rf"rank {SKIPPER} never started all_reduce seq {stuck_seq} \(ranks 0, 1, 3 "
                     rf"started it at [\d:.]+\); rank {SKIPPER} last completed seq "
                     rf"{stuck_seq - 1}\b", text), text
    found = json.loads(run_trace_tool(d / "trace", "--json").stdout)["findings"]
    behind = [f for f in found if f["kind"] == "behind"]
    assert [(f["rank"], f["seq"], f["op"]) for f in behind] == \
        [(SKIPPER, stuck_seq, "all_reduce")], found

    # a rank that wrote nothing (as after SIGKILL) is named as such
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in files:
        if not f.startswith("chorus-trace.r3."):
            shutil.copy(d / "trace" / f, partial / f)
    tool = run_trace_tool(partial)
    assert tool.returncode == 1 and re.search(r"rank 3 wrote no record", tool.stdout), tool.stdout
    assert f"rank {SKIPPER} never started all_reduce seq {stuck_seq}" in tool.stdout, tool.stdout

    # ---------------------------------------------------------------- mismatch
    d, res = jobs["mismatch"][0], results["mismatch"]
    assert not res.timed_out, res.describe()
    fails = failures(res)
    for rank, (etype, on_disk, msg) in fails.items():
        assert etype == "DistBackendError" and "mismatched calls" in msg, (rank, msg)
        assert on_disk, f"rank {rank}: its record was not on disk when the exception surfaced"
    assert len(os.listdir(d / "trace")) == WORLD, os.listdir(d / "trace")
    tool = run_trace_tool(d / "trace")
    assert tool.returncode == 1, tool.stdout + tool.stderr
    # the skipper's 6th call (256 + 64 * 5 elements) meets the others' 5th (256 + 64 * 4)
    assert re.search(rf"rank {SKIPPER} called all_reduce \(576 x float32 sum\) as seq 4 where "
                     r"ranks 0, 1, 3 called all_reduce \(512 x float32 sum\)", tool.stdout), \
        tool.stdout
