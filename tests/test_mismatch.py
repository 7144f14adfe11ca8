"""Mismatched collectives (issue bar): rank 0 all_reduce of 100 elements and the others 200;
float32 against float64; SUM against MAX; all_reduce against broadcast. Each on a fresh
group of 4 ranks, over shared memory and over sockets. Every rank raises within 5 s a
DistBackendError whose text shows both sides. Documented behaviour afterwards: the group of
the mismatch is cleanly unusable (every later call raises the same error at once), and every
other group, the world group included, goes on working."""
import os
import re

import pytest

from launch import WORKERS, backend_under_test, run_job

WORKER = os.path.join(WORKERS, "mismatch.py")

# both sides of each case, as the fingerprint text shows them
SIDES = {
    "count": (r"count 100 float32 sum", r"count 200 float32 sum"),
    "dtype": (r"count 100 float32 sum", r"count 100 float64 sum"),
    "op": (r"count 100 float32 sum", r"count 100 float32 max"),
    "kind": (r"all_reduce seq \d+ count 100", r"broadcast seq \d+ count 100"),
}


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_mismatch_raises_on_every_rank_naming_both_sides(transport, tmp_path):
    check_mismatch(transport, tmp_path)


def check_mismatch(transport, tmp_path, device="cpu"):
    """The test above; tests/test_cuda.py runs it with CUDA tensors (device="cuda")."""
    env = {"CHORUS_SHM_DISABLE": "1" if transport == "socket" else "0",
           "CHORUS_TEST_DEVICE": device}
    # the core's log goes to its own files, so its lines never split the worker's
    env["CHORUS_DEBUG_FILE"] = str(tmp_path / "chorus.%p.log")
    res = run_job(f"mismatch-{transport}-{device}", WORKER, 4, env=env, timeout=200)
    assert res.ok, res.describe()
    for r in res.ranks:
        cases = dict(re.findall(r"^CASE (\w+) (.*)$", r.output, re.M))
        after = dict(re.findall(r"^AFTER (\w+) (.*)$", r.output, re.M))
        assert set(cases) == set(SIDES) == set(after), res.describe()
        for name, (mine, theirs) in SIDES.items():
            secs, etype, msg = cases[name].split(" ", 2)
            where = f"rank {r.rank} {transport} {name}: {cases[name]}"
            assert etype == "DistBackendError", where
            assert float(secs) < 5.0, where
            assert "mismatched calls" in msg, where
            assert re.search(mine, msg) and re.search(theirs, msg), where
            # the group of the mismatch is cleanly unusable: the next call raises at once
            secs2, etype2, msg2 = after[name].split(" ", 2)
            assert etype2 == "DistBackendError" and float(secs2) < 1.0, after[name]
            assert "mismatched calls" in msg2, after[name]
        assert "WORLD_STILL_WORKS" in r.output, res.describe()
