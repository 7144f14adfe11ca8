"""Over sockets, a payload that an algorithm copies to its destination (all-gather,
all-to-all, broadcast) is received straight into the caller's buffer, not through the
connection's receive ring: the ring reads only 64 KiB ahead of the reader, except through a
payload a reduction announced (docs/design.md, "Socket I/O threads", Read-ahead). The core
says at destroy (CHORUS_DEBUG=INFO) where each rank's received bytes landed."""
import os
import re

from launch import WORKERS, run_job

WORKER = os.path.join(WORKERS, "read_ahead.py")
LINE = re.compile(r"socket: received (\d+) bytes: ([0-9.]+)% straight into the callers' "
                  r"buffers, ([0-9.]+)% through receive rings, ([0-9.]+)% through staging")


def test_copied_payloads_skip_the_receive_ring():
    env = {"CHORUS_SHM_DISABLE": "1", "CHORUS_SOCKET_THREADS": "0", "CHORUS_DEBUG": "INFO",
           "CHORUS_DEBUG_SUBSYS": "NET"}
    res = run_job("read-ahead", WORKER, 3, env=env, timeout=180)
    assert res.ok, res.describe()
    results = res.results()
    for r in res.ranks:
        assert results[r.rank]["correct"], res.describe()
        got = LINE.search(r.output)
        assert got, res.describe()
        total, direct, ring = int(got.group(1)), float(got.group(2)), float(got.group(3))
        # 3 all-gathers, all-to-alls and broadcasts of 4 MiB: tens of MiB per rank
        assert total > 20 << 20, got.group(0)
        # Only the all-reduce's reduce-scatter half (under a tenth of the bytes) and headers
        # and the first 64 KiB of payloads may take the ring; reading ahead through the
        # whole ring, as before, sent about three quarters of the bytes through it.
        assert ring < 25.0 and direct > 70.0, got.group(0)
