"""Many TCP connections, few file descriptors: 4 ranks over sockets with 16 connections per
peer and channel (3 peers x 2 channels x 17 descriptors each) after every rank lowered its
soft RLIMIT_NOFILE to a few above what it had open. Chorus raises the soft limit within the
hard one, says so at INFO, and the job runs correctly."""
import os
import re

from launch import WORKERS, run_job

WORKER = os.path.join(WORKERS, "fd_limit.py")


def test_soft_open_file_limit_is_raised_for_striped_connections():
    env = {"CHORUS_SHM_DISABLE": "1", "CHORUS_NSOCKS_PERTHREAD": "16",
           "CHORUS_DEBUG": "INFO", "CHORUS_DEBUG_SUBSYS": "NET"}
    res = run_job("fd-limit", WORKER, 4, env=env, timeout=180)
    assert res.ok, res.describe()
    results = res.results()
    for r in res.ranks:
        got = results[r.rank]
        assert got["correct"], got
        # 102 descriptors for the connections did not fit under the lowered limit
        assert got["soft_after"] > got["lowered_to"], got
        assert got["open_fds"] > got["lowered_to"], got
        assert re.search(r"raised the open-file limit \(RLIMIT_NOFILE\) from \d+ to \d+ for "
                         r"the 102 descriptors of TCP connections", r.output), r.output[-3000:]
