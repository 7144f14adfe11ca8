"""Rank worker for tests/test_flight_recorder.py. Argument: a scratch directory.

1. On-demand dumps: two checked all_reduce calls on the world group, then chorus.dump_trace()
   for every communicator and for the world group into <dir>/api, whose records this rank
   checks against what it issued (prints API_OK), then SIGUSR2 (CHORUS_TRACE_SIGNAL) to
   itself and a wait for the record in CHORUS_TRACE_DIR (prints SIGNAL_OK).
2. Mismatch, on a new group of every rank: 8 all_reduce calls whose sizes grow per step;
   rank SKIPPER skips the 5th, so its 6th call meets the others' 5th and the fingerprint
   fails every rank at once. Prints MISMATCH <exception type> <record on disk 1/0> <message>.
3. Timeout, on the world group: 8 all_reduce calls of one shape, of which the skipper skips
   the 5th. Chorus numbers collectives per communicator, so its later calls pair with the
   others' and the others' 8th call finds nobody: they time out. The skipper, after its 7
   calls, waits until the others have failed (files failed<r>), checks that it wrote its
   record meanwhile although it was in no operation (prints IDLE_RECORD 1), then calls
   barrier(), which fails. Prints FAILED <exception type> <record on disk 1/0> <message>.
"""
import glob
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import init_dist  # noqa: E402

import chorus  # noqa: E402

T0 = time.monotonic()
rank, world = init_dist()
scratch = sys.argv[1]
skipper = int(os.environ.get("SKIPPER", "2"))
trace_dir = os.environ["CHORUS_TRACE_DIR"]


def my_records(directory):
    return sorted(glob.glob(os.path.join(directory, f"chorus-trace.r{rank}.*.{os.getpid()}.json")))


def check_record(path, reason, expect_seqs):
    with open(path) as f:
        rec = json.load(f)
    assert rec["format"] == "chorus-flight-recorder", rec.get("format")
    assert rec["reason"] == reason, (rec["reason"], reason)
    assert (rec["rank"], rec["world"], rec["pid"]) == (rank, world, os.getpid()), rec
    assert rec["global_ranks"] == list(range(world)), rec["global_ranks"]
    colls = [e for e in rec["entries"] if not e["p2p"]]
    got = [(e["seq"], e["op"], e["count"], e["bytes"], e["dtype"], e["redop"], e["state"])
           for e in colls]
    want = [(s, "all_reduce", 1024, 4096, "float32", "sum", "done") for s in expect_seqs]
    assert got == want, f"{path}: {got} != {want}"
    for e in colls:
        assert e["queued_ns"] <= e["started_ns"] <= e["ended_ns"], e
        assert abs(e["ended_wall"] - time.time()) < 600, e
        assert e["algo"], e
    return rec


# 1. on-demand dumps
t = torch.ones(1024)
for _ in range(2):
    t.fill_(1.0)
    dist.all_reduce(t)
    assert torch.all(t == world), t[:4]
api_dir = os.path.join(scratch, "api")
every = chorus.dump_trace(path=api_dir)
assert every == my_records(api_dir) and len(every) == 1, (every, my_records(api_dir))
check_record(every[0], "api", [0, 1])
one = chorus.dump_trace(dist.group.WORLD, path=api_dir, reason="test")
assert one == every, (one, every)
check_record(one[0], "test", [0, 1])
print(f"API_OK at {time.monotonic() - T0:.1f} s", flush=True)
os.kill(os.getpid(), signal.SIGUSR2)
deadline = time.monotonic() + 30
while not my_records(trace_dir) and time.monotonic() < deadline:
    time.sleep(0.02)
found = my_records(trace_dir)
assert found, "no record in CHORUS_TRACE_DIR 30 s after SIGUSR2"
check_record(found[0], "signal", [0, 1])
print("SIGNAL_OK", flush=True)


def failed_records():
    """How many of this rank's records in CHORUS_TRACE_DIR describe a failed communicator."""
    n = 0
    for path in my_records(trace_dir):
        with open(path) as f:
            n += bool(json.load(f)["failed"])
    return n


def report(tag, e, want_records):
    on_disk = int(failed_records() >= want_records)
    msg = " ".join(str(e).split())[:800]
    print(f"{tag} {type(e).__name__} {on_disk} {msg}", flush=True)
    print(f"at {time.monotonic() - T0:.1f} s", flush=True)


# 2. mismatch on a group of its own
group = dist.new_group(list(range(world)))
try:
    for i in range(8):
        if rank == skipper and i == 4:
            continue
        x = torch.ones(256 + 64 * i)
        dist.all_reduce(x, group=group)
        assert torch.all(x == world), x[:4]
    print("MISMATCH_NOT_NOTICED", flush=True)
except Exception as e:  # noqa: BLE001 (the test reads type and text)
    report("MISMATCH", e, 1)

# 3. timeout on the world group
group_name = dist.distributed_c10d._get_process_group_name(dist.group.WORLD)
try:
    for i in range(8):
        if rank == skipper and i == 4:
            continue
        t.fill_(1.0)
        dist.all_reduce(t)
        assert torch.all(t == world), t[:4]
    if rank == skipper:
        deadline = time.monotonic() + 90
        others = [os.path.join(scratch, f"failed{r}") for r in range(world) if r != rank]
        while not all(os.path.exists(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)
        # in no operation meanwhile: the engine's idle watch saw the others' failure notices
        # and wrote this rank's record of the world group
        idle = 0
        deadline = time.monotonic() + 10
        while not idle and time.monotonic() < deadline:
            for path in my_records(trace_dir):
                with open(path) as f:
                    rec = json.load(f)
                if rec["comm"] == group_name and rec["reason"].startswith("peer "):
                    idle = 1
            time.sleep(0.05)
        print(f"IDLE_RECORD {idle}", flush=True)
        dist.barrier()
    print("NO_FAILURE", flush=True)
except Exception as e:  # noqa: BLE001
    report("FAILED", e, 2)
    open(os.path.join(scratch, f"failed{rank}"), "w").close()
    sys.exit(5)
