"""Shared fixtures: one multi-rank check job per (world size, transport), run once per session
and read by many tests, plus the /dev/shm bookkeeping.

The backend under test is CHORUS_TEST_BACKEND (default "chorus"); "gloo" validates the harness.
With a backend other than chorus, checks the backend reports as unsupported are tolerated (and
counted in the summary); for chorus every combination must pass.
"""
import collections
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch import WORKERS, backend_under_test, chorus_shm_segments, run_job  # noqa: E402

WORLD_SIZES = (1, 2, 3, 4)
TRANSPORTS = ("shm", "socket")
# One rank has no peer and no transport: CHORUS_SHM_DISABLE changes nothing there, so a world
# of 1 runs once (as "shm").
CONFIGS = [(w, t) for w in WORLD_SIZES for t in TRANSPORTS if w > 1 or t == "shm"]
# Small staging rings so that 3 x BUFFSIZE (one of the sizes checked) stays cheap.
BUFFSIZE = "65536"
JOB_TIMEOUT = float(os.environ.get("CHORUS_TEST_JOB_TIMEOUT", "420"))
ALLOW_UNSUPPORTED = os.environ.get(
    "CHORUS_TEST_ALLOW_UNSUPPORTED", "0" if backend_under_test() == "chorus" else "1") == "1"
MAX_PROBLEMS_SHOWN = 25


def config_id(world, transport):
    return f"ws{world}-{transport}"


def transport_env(transport):
    # CHORUS_SHM_DISABLE=1 forces TCP sockets between ranks of one host.
    return {"CHORUS_SHM_DISABLE": "1" if transport == "socket" else "0",
            "CHORUS_BUFFSIZE": BUFFSIZE,
            # small direct-access halves, so that chunking is exercised too
            "CHORUS_SHM_SCRATCH": "65536"}


def describe_case(rec):
    keys = ("coll", "dtype", "op", "size", "inplace", "via", "root", "split_sizes", "uneven",
            "data", "api", "group", "round", "late_rank", "layout", "then")
    parts = [f"{k}={rec[k]}" for k in keys if k in rec and rec[k] is not None]
    return " ".join(parts)


class CheckRun:
    """Records of one check job (see tests/workers/run_checks.py)."""

    def __init__(self, world, transport, out_dir):
        self.world, self.transport, self.out_dir = world, transport, out_dir
        before = set(chorus_shm_segments())
        self.job = run_job(f"checks-{config_id(world, transport)}",
                           os.path.join(WORKERS, "run_checks.py"), world,
                           args=["--out", out_dir], env=transport_env(transport),
                           timeout=JOB_TIMEOUT)
        self.leaked_shm = sorted(set(chorus_shm_segments()) - before)
        self.records = collections.defaultdict(list)
        self.done = collections.defaultdict(dict)  # family -> rank -> harness error text
        self.current = {}
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    for line in f:
                        rec = json.loads(line)
                        if rec["status"] == "family_done":
                            self.done[rec["family"]][rank] = rec["detail"]
                        else:
                            self.records[rec["family"]].append(rec)
            cur = os.path.join(out_dir, f"rank{rank}.current")
            self.current[rank] = (open(cur).read().rstrip() if os.path.exists(cur)
                                  else "(not started)")

    def counts(self):
        c = collections.Counter()
        for recs in self.records.values():
            for r in recs:
                c[r["status"]] += 1
        return c

    def assert_family(self, family):
        """Fails with every mismatch of the family, precisely, or with why it did not run."""
        where = f"{family} on {self.world} rank(s), transport {self.transport}"
        done = self.done.get(family, {})
        missing = [r for r in range(self.world) if r not in done]
        if missing:
            last = "\n".join(f"  rank {r} was running: {self.current.get(r)}" for r in missing)
            pytest.fail(f"{where}: did not finish on rank(s) {missing}\n{last}\n\n"
                        f"{self.job.describe()}", pytrace=False)
        harness = {r: e for r, e in done.items() if e}
        if harness:
            pytest.fail(f"{where}: the check code itself raised:\n" + "\n".join(
                f"rank {r}:\n{e}" for r, e in harness.items()), pytrace=False)
        recs = [r for r in self.records.get(family, []) if r["status"] != "info"]
        bad_status = {"fail", "error"} | (set() if ALLOW_UNSUPPORTED else {"unsupported"})
        problems = [r for r in recs if r["status"] in bad_status]
        if problems:
            lines = [f"rank {r['rank']}: {r['status'].upper()} {describe_case(r)}: {r['detail']}"
                     for r in problems[:MAX_PROBLEMS_SHOWN]]
            more = len(problems) - len(lines)
            pytest.fail(f"{where}: {len(problems)} of {len(recs)} checks went wrong\n"
                        + "\n".join(lines) + (f"\n... and {more} more" if more > 0 else ""),
                        pytrace=False)
        passed = sum(r["status"] == "pass" for r in recs)
        if not recs or (passed == 0 and not ALLOW_UNSUPPORTED):
            pytest.fail(f"{where}: no check ran", pytrace=False)


class CheckRuns:
    def __init__(self, root):
        self.root = root
        self.runs = {}

    def get(self, world, transport):
        key = (world, transport)
        if key not in self.runs:
            out = os.path.join(self.root, config_id(world, transport))
            os.makedirs(out, exist_ok=True)
            self.runs[key] = CheckRun(world, transport, out)
        return self.runs[key]


_CHECK_RUNS = []


@pytest.fixture(scope="session")
def check_runs(tmp_path_factory):
    runs = CheckRuns(str(tmp_path_factory.mktemp("checks")))
    _CHECK_RUNS.append(runs)
    return runs


def family_params(families):
    """(family, world, transport) for every configuration the family needs (min world)."""
    return [pytest.param(f, w, t, id=f"{f}-{config_id(w, t)}")
            for f, min_world in families for w, t in CONFIGS if w >= min_world]


_SHM_AT_START = set()


def pytest_sessionstart(session):
    _SHM_AT_START.update(chorus_shm_segments())


def pytest_sessionfinish(session, exitstatus):
    # Backstop for the last test in test_shm_cleanup.py: a segment that appeared during the
    # session and is still there fails the run even if that test was deselected.
    leaked = sorted(set(chorus_shm_segments()) - _SHM_AT_START)
    if leaked:
        print(f"\nERROR: Chorus shared-memory segments left in /dev/shm: {leaked}", file=sys.stderr)
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if not _CHECK_RUNS or not _CHECK_RUNS[0].runs:
        return
    tr.section(f"check jobs (backend {backend_under_test()})")
    for (w, t), run in sorted(_CHECK_RUNS[0].runs.items()):
        c = run.counts()
        state = "ok" if run.job.ok else ("TIMED OUT" if run.job.timed_out else "exit codes "
                                         + ",".join(str(r.returncode) for r in run.job.ranks))
        tr.write_line(f"{config_id(w, t):12s} {sum(c.values()):6d} checks: pass {c['pass']}, "
                      f"fail {c['fail']}, error {c['error']}, unsupported {c['unsupported']}; "
                      f"{run.job.wall_s:.0f} s, job {state}")
