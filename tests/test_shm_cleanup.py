"""Nothing of Chorus is left in /dev/shm (segments carry "chorus" in their name): not after
any check job, not after ranks killed with SIGKILL in the middle of all_reduce, not at the
end of the suite. (Segments should be unlinked as soon as every rank has mapped them.)"""
import os
import signal
import time

import pytest

from conftest import CONFIGS, _SHM_AT_START, config_id
from launch import WORKERS, Job, backend_under_test, chorus_shm_segments


@pytest.mark.parametrize("world,transport", [pytest.param(w, t, id=config_id(w, t))
                                             for w, t in CONFIGS])
def test_check_job_leaves_no_shm_segment(check_runs, world, transport):
    run = check_runs.get(world, transport)
    assert run.leaked_shm == [], f"left in /dev/shm after the job: {run.leaked_shm}"


def _maps_chorus_memory(pid):
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("chorus" in line for line in f)
    except OSError:
        return False


def test_sigkill_during_all_reduce_leaves_no_shm_segment(tmp_path):
    before = set(chorus_shm_segments())
    job = Job("shm-kill", os.path.join(WORKERS, "shm_kill.py"), 4, args=[str(tmp_path)],
              env={"CHORUS_SHM_DISABLE": "0", "CHORUS_BUFFSIZE": "65536"}, workdir=str(tmp_path))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if all(os.path.exists(tmp_path / f"ready{r}") for r in range(4)):
            break
        if any(p.poll() is not None for p in job.procs):
            break
        time.sleep(0.1)
    mapped = [_maps_chorus_memory(p.pid) for p in job.procs]
    running = all(p.poll() is None for p in job.procs)
    job.kill(signal.SIGKILL)
    res = job.wait(timeout=60)
    assert running, "ranks did not reach the all_reduce loop:\n" + res.describe()
    assert [r.returncode for r in res.ranks] == [-signal.SIGKILL] * 4, res.describe()
    if backend_under_test() == "chorus":
        # Otherwise the test would prove nothing: the ranks must have used shared memory.
        assert any(mapped), "no rank had a Chorus shared-memory mapping while running"
    time.sleep(0.5)
    leaked = sorted(set(chorus_shm_segments()) - before)
    assert leaked == [], f"left in /dev/shm after SIGKILL of every rank: {leaked}"


def test_dev_shm_holds_no_chorus_segment_after_suite():
    # Last test of the last file (pytest runs files in name order); conftest's
    # pytest_sessionfinish repeats this check in case the order changes.
    leaked = sorted(set(chorus_shm_segments()) - _SHM_AT_START)
    assert leaked == [], f"Chorus segments in /dev/shm: {leaked}"
