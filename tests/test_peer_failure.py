"""One rank of 4 fails in the middle of an all_reduce loop (issue bars): SIGKILLed, over
shared memory and over sockets, or silent (it stops calling; group timeout 5 s). Every
survivor raises a DistBackendError naming that rank, within 10 s of the kill (within the
timeout plus 5 s for the silent rank); no process hangs; /dev/shm keeps no Chorus segment."""
import os
import re
import signal
import time

import pytest

from launch import WORKERS, Job, backend_under_test, chorus_shm_segments

WORKER = os.path.join(WORKERS, "peer_failure.py")
VICTIM = 2


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
@pytest.mark.parametrize("mode,transport", [("kill", "shm"), ("kill", "socket"),
                                            ("silent", "shm"), ("silent", "socket")])
def test_survivors_raise_naming_the_failed_rank(tmp_path, mode, transport):
    check_peer_failure(tmp_path, mode, transport)


def check_peer_failure(tmp_path, mode, transport, device="cpu"):
    """The test above; tests/test_cuda.py runs it with CUDA tensors (device="cuda")."""
    before = set(chorus_shm_segments())
    env = {"CHORUS_SHM_DISABLE": "1" if transport == "socket" else "0", "MODE": mode,
           "VICTIM": str(VICTIM), "CHORUS_TEST_PG_TIMEOUT": "5", "CHORUS_TEST_DEVICE": device,
           # the core's log goes to its own files, so its lines never split the worker's
           "CHORUS_DEBUG_FILE": str(tmp_path / "chorus.%p.log")}
    job = Job(f"fail-{mode}-{transport}-{device}", WORKER, 4, args=[str(tmp_path)], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all(os.path.exists(tmp_path / f"ready{r}") for r in range(4)):
            break
        if any(p.poll() is not None for p in job.procs):
            break
        time.sleep(0.05)
    t_fail = time.time()
    if mode == "kill":
        os.kill(job.procs[VICTIM].pid, signal.SIGKILL)
    limit = 10.0 if mode == "kill" else 5.0 + 10.0
    # survivors must all have exited by then; the victim (silent) is killed afterwards
    end = time.monotonic() + limit + 5
    while time.monotonic() < end:
        if all(p.poll() is not None for i, p in enumerate(job.procs) if i != VICTIM):
            break
        time.sleep(0.05)
    job.procs[VICTIM].kill()
    res = job.wait(timeout=60)
    for r in res.ranks:
        if r.rank == VICTIM:
            continue
        m = re.search(r"^FAILED (\S+) (\S+) (.*)$", r.output, re.M)
        assert m, f"rank {r.rank} did not raise:\n" + res.describe()
        took = float(m.group(1)) - t_fail
        assert m.group(2) == "DistBackendError", m.group(0)
        assert took < limit, f"rank {r.rank} raised after {took:.1f} s: {m.group(3)}"
        assert re.search(rf"\brank {VICTIM}\b", m.group(3)), f"rank {r.rank}: {m.group(3)}"
    time.sleep(0.3)
    leaked = sorted(set(chorus_shm_segments()) - before)
    assert leaked == [], f"left in /dev/shm: {leaked}"
