"""Flight recorder (issue bar): rank 2 of 4 skips one all_reduce; one job of 4 ranks on CPU
(tests/workers/flight_recorder.py), CHORUS_TRACE_DIR set, group timeout 5 s.

- On-demand dumps first: chorus.dump_trace() (every communicator, and one group) and
  CHORUS_TRACE_SIGNAL=SIGUSR2, each record checked by the rank against the calls it made.
- Mismatch, on a group of its own: the calls' sizes differ per step, so the skipper's next
  call meets the others' skipped one: the fingerprint fails every rank at once (no
  timeout), and chorus.trace names rank 2 as the rank whose call at that sequence number
  differs from the other three's.
- Timeout, on the world group: every call has one shape. Chorus numbers collectives per
  communicator, so the skipper's later calls pair with the others' and nothing shows until
  the others' last all_reduce, which nobody answers: the survivors time out. The skipper,
  busy elsewhere meanwhile (in no Chorus operation), writes its record when its engine sees
  the others' failure notices, then calls barrier() and fails too. Every rank's record is in
  CHORUS_TRACE_DIR before its exception surfaces, and `python -m chorus.trace` names rank 2
  and the sequence number it never started (the one the others are stuck at).
- chorus.trace on the records with one rank's file removed (as after a SIGKILL) says that
  rank wrote none, and on the on-demand records (taken while all was well) that all agree.
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
ONDEMAND_OPS = 2  # all_reduce calls on the world group before its loop


def run_trace_tool(directory, *extra):
    return subprocess.run([sys.executable, "-m", "chorus.trace", str(directory), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def reports(res, tag):
    out = {}
    for r in res.ranks:
        m = re.search(rf"^{tag} (\S+) ([01]) (.*)$", r.output, re.M)
        assert m, f"rank {r.rank} printed no {tag} line:\n" + res.describe()
        out[r.rank] = (m.group(1), m.group(2) == "1", m.group(3))
    return out


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's flight recorder")
def test_flight_recorder_names_the_skipping_rank(tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {"SKIPPER": str(SKIPPER), "CHORUS_TEST_PG_TIMEOUT": "5",
           "CHORUS_TRACE_DIR": str(trace), "CHORUS_TRACE_SIGNAL": "SIGUSR2",
           "CHORUS_DEBUG_FILE": str(tmp_path / "chorus.%p.log")}
    res = Job("flight-recorder", WORKER, WORLD, args=[str(tmp_path)], env=env).wait(timeout=150)
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert "API_OK" in r.output and "SIGNAL_OK" in r.output, res.describe()

    mism = reports(res, "MISMATCH")
    for rank, (etype, on_disk, msg) in mism.items():
        assert etype == "DistBackendError" and "mismatched calls" in msg, (rank, msg)
        assert on_disk, f"rank {rank}: its record was not on disk when the exception surfaced"
    assert re.search(r"^IDLE_RECORD 1$", res.ranks[SKIPPER].output, re.M), res.describe()
    fails = reports(res, "FAILED")
    stuck_seq = ONDEMAND_OPS + 7  # the survivors' 8th call of the loop
    for rank, (etype, on_disk, msg) in fails.items():
        assert etype == "DistBackendError", (rank, msg)
        assert on_disk, f"rank {rank}: its record was not on disk when the exception surfaced"
        if rank != SKIPPER:
            assert f"all_reduce seq {stuck_seq}" in msg and "timed out" in msg, (rank, msg)

    files = sorted(os.listdir(trace))
    assert len(files) == 2 * WORLD and all(f.endswith(".json") for f in files), files
    seen = set()
    for f in files:
        rec = json.loads((trace / f).read_text())
        seen.add((rec["comm"], rec["rank"]))
        assert rec["error"] and rec["failed"] and rec["reason"] in ("timeout", "failure"), rec
        assert rec["host"] and rec["pid"] > 0 and rec["world"] == WORLD
        assert rec["global_ranks"] == list(range(WORLD)), rec["global_ranks"]
    assert len({c for c, _ in seen}) == 2 and len(seen) == 2 * WORLD, seen

    tool = run_trace_tool(trace)
    text = tool.stdout + tool.stderr
    assert tool.returncode == 1, text
    assert re.search(rf"rank {SKIPPER} never started all_reduce seq {stuck_seq} \(ranks 0, 1, 3 "
                     rf"started it at [\d:.]+\); rank {SKIPPER} last completed seq "
                     rf"{stuck_seq - 1}\b", text), text
    # the mismatch group: the skipper's 6th call (256 + 64 * 5 elements) met the others' 5th
    assert re.search(rf"rank {SKIPPER} called all_reduce \(576 x float32 sum\) as seq 4 where "
                     r"ranks 0, 1, 3 called all_reduce \(512 x float32 sum\)", text), text
    found = json.loads(run_trace_tool(trace, "--json").stdout)["findings"]
    assert sorted((f["kind"], f["rank"], f["seq"], f["op"]) for f in found) == \
        [("behind", SKIPPER, stuck_seq, "all_reduce"), ("mismatch", SKIPPER, 4, "all_reduce")], \
        found

    # the on-demand records of a healthy moment: every rank agrees, exit status 0
    tool = run_trace_tool(tmp_path / "api")
    assert tool.returncode == 0 and "all ranks agree" in tool.stdout, tool.stdout + tool.stderr

    # a rank that wrote nothing (as after SIGKILL) is named as such
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in files:
        if not f.startswith("chorus-trace.r3."):
            shutil.copy(trace / f, partial / f)
    tool = run_trace_tool(partial)
    assert tool.returncode == 1 and re.search(r"rank 3 wrote no record", tool.stdout), tool.stdout
    assert f"rank {SKIPPER} never started all_reduce seq {stuck_seq}" in tool.stdout, tool.stdout
