"""destroy_process_group() and the backend's abort() while a collective is in flight (issue
bar): ranks 0..2 start an async all_reduce that rank 3 never joins, then destroy or abort.
abort() returns at once; destroy gives in-flight operations a 3 s grace and then aborts
them (documented in design.md). Either way the pending work raises a DistBackendError at
once, every rank exits, and nothing hangs until the 30 s operation timeout."""
import os
import re

import pytest

from launch import WORKERS, backend_under_test, run_job

WORKER = os.path.join(WORKERS, "destroy_inflight.py")


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
@pytest.mark.parametrize("mode,limit", [("abort", 1.0), ("destroy", 5.0)])
def test_destroy_or_abort_ends_an_inflight_collective(tmp_path, mode, limit):
    # the core's log goes to its own files, so its lines never split the worker's
    env = {"CHORUS_DEBUG_FILE": str(tmp_path / "chorus.%p.log")}
    res = run_job(f"inflight-{mode}", WORKER, 4, args=[mode, str(tmp_path)], env=env,
                  timeout=120)
    assert res.ok, res.describe()
    assert res.wall_s < 25, res.describe()
    for r in res.ranks:
        assert "EXIT" in r.output, res.describe()
        ended = float(re.search(r"ENDED ([0-9.]+)", r.output).group(1))
        assert ended < limit, f"rank {r.rank}: {mode} took {ended} s"
        if r.rank < 3:
            m = re.search(r"WAIT (\w+) ([0-9.]+) (.*)$", r.output, re.M)
            assert m and m.group(1) == "DistBackendError" and float(m.group(2)) < 1.0, r.output
            assert re.search(r"aborted|destroyed", m.group(3)), m.group(3)
