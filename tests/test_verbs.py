"""The verbs (InfiniBand/RoCE) transport, end to end through torch.distributed, over the
libibverbs test double tests/fakeverbs (no RDMA hardware needed): the double is built here
with its Makefile and loaded through the transport's own dlopen path (CHORUS_IBVERBS_LIB).

Ranks count as separate hosts through CHORUS_HOSTID (simhost<rank // 2>): ranks of one
simulated host talk over shared memory, ranks of different ones over verbs, and the log must
say so. Checked: every collective and point-to-point op with values computed independently,
over IB with one QP per connection, and over RoCE with 2 QPs per connection on 2 NICs; an
injected completion error becomes an exception on both ranks, naming the peer and the verbs
status, long before the timeout; without a usable libibverbs (a path that does not exist, and
the default library name) the job runs over TCP and says once why.
"""
import json
import os
import re
import subprocess

import pytest

from launch import REPO, WORKERS, backend_under_test, run_job

FAKE_DIR = os.path.join(REPO, "tests", "fakeverbs")
FAKE_LIB = os.path.join(FAKE_DIR, "build", "libfakeverbs.so")
WORKER = os.path.join(WORKERS, "verbs_job.py")

pytestmark = pytest.mark.skipif(backend_under_test() != "chorus",
                                reason="the verbs transport is Chorus's own")


@pytest.fixture(scope="module")
def fake_lib():
    res = subprocess.run(["make", "-s", "-C", FAKE_DIR], capture_output=True, text=True)
    assert res.returncode == 0, f"building the test double failed:\n{res.stdout}{res.stderr}"
    assert os.path.exists(FAKE_LIB)
    return FAKE_LIB


def verbs_env(lib, **extra):
    env = {"CHORUS_IBVERBS_LIB": lib, "CHORUS_BUFFSIZE": "64K", "CHORUS_DEBUG": "INFO",
           "CHORUS_DEBUG_SUBSYS": "INIT,NET", "CHORUS_TEST_PG_TIMEOUT": "60",
           "FAKEVERBS_FAIL_AFTER": None, "CHORUS_IB_DISABLE": None, "NCCL_IB_DISABLE": None,
           "CHORUS_IB_HCA": None, "NCCL_IB_HCA": None}
    env.update(extra)
    return env


def records(tmp_path, world):
    out = {}
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no record"
        out[r] = json.loads(path.read_text())
    return out


def assert_links(res, world, remote):
    """Each rank's log names the transport to every peer: shm inside a simulated host,
    `remote` between them."""
    for r in res.ranks:
        for p in range(world):
            if p == r.rank:
                continue
            want = "shm" if p // 2 == r.rank // 2 else remote
            line = f"peer {p} (simhost{p // 2}) via {want}"
            assert line in r.output, f"rank {r.rank}: no '{line}' in its log:\n{r.output[-3000:]}"


CONFIGS = {
    "ib-1qp-1nic": {"FAKEVERBS_DEVICES": "fake0", "CHORUS_IB_QPS_PER_CONNECTION": "1"},
    "roce-2qp-2nic": {"FAKEVERBS_DEVICES": "fake0/roce,fake1/roce",
                      "CHORUS_IB_QPS_PER_CONNECTION": "2"},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_collective_over_verbs(fake_lib, tmp_path, config):
    res = run_job(f"verbs-{config}", WORKER, 4, args=["--out", str(tmp_path), "--mode", "coll"],
                  env=verbs_env(fake_lib, **CONFIGS[config]), timeout=180)
    assert res.ok, res.describe()
    assert_links(res, 4, "verbs")
    recs = records(tmp_path, 4)
    for r, rec in recs.items():
        assert rec["failures"] == [], f"rank {r}: {rec['failures'][:10]}"
        # 7 (size, dtype) cases x 11 checks + 2 point-to-point checks x 3 sizes on every rank;
        # rank 1 also checks reduce's result, rank 2 gather's
        want = 7 * 11 + 3 * 2 + (7 if r in (1, 2) else 0)
        assert rec["checks"] == want, f"rank {r} ran {rec['checks']} checks, not {want}"
    log = res.ranks[0].output
    if config.startswith("roce"):
        # both NICs in use, each addressed by its RoCE v2 IPv4-mapped GID (table index 2)
        assert re.search(r"verbs: 2 NICs: fake0:1 \(RoCE v2, GID index 2\), "
                         r"fake1:1 \(RoCE v2, GID index 2\)", log), log[-3000:]
        assert "2 QPs per connection" in log, log[-3000:]
    else:
        assert re.search(r"verbs: 1 NIC: fake0:1 \(IB, LID \d+\)", log), log[-3000:]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_registered_buffers_are_sent_without_a_copy(fake_lib, tmp_path, config):
    """chorus.register: results stay right (the double fails any send whose source changes
    before its completion, and the worker rewrites each buffer as soon as an op returns), the
    ranks whose ring of sends crosses hosts (1 -> 2, 3 -> 0) send at least those bytes
    straight from the registered tensor and their receivers (2, 0) take some straight into
    their registered receive tensor, bad tensors are refused, and a registration left open
    is released at destroy."""
    res = run_job(f"verbs-register-{config}", WORKER, 4,
                  args=["--out", str(tmp_path), "--mode", "register"],
                  env=verbs_env(fake_lib, **CONFIGS[config]), timeout=180)
    assert res.ok, res.describe()
    recs = records(tmp_path, 4)
    for r, rec in recs.items():
        assert rec["failures"] == [], f"rank {r}: {rec['failures'][:10]}"
        assert rec["checks"] == 3 * 4 + 1 + 2, f"rank {r} ran {rec['checks']} checks"
    for r in res.ranks:
        m = re.search(r"verbs: sent (\d+) bytes straight from registered buffers and (\d+) "
                      r"through the rings, (\d+) of them into the peers' registered buffers; "
                      r"received (\d+) bytes straight into registered buffers", r.output)
        assert m, f"rank {r.rank}: no verbs summary at destroy:\n{r.output[-3000:]}"
        zero_copy, received = int(m.group(1)), int(m.group(4))
        if r.rank in (1, 3):
            assert zero_copy >= 3 * 300000 * 4, f"rank {r.rank}: {zero_copy} bytes zero-copy"
        if r.rank in (0, 2):  # 1.2 MB into a registered tensor through 64 KiB rings
            assert received > 0, f"rank {r.rank}: nothing received into a registered buffer"
        assert "1 buffer registration still held; released" in r.output, r.output[-3000:]
        assert "fakeverbs:" not in r.output, r.output[-3000:]


def test_ddp_hook_registers_buckets_and_matches_the_default_hook(fake_lib, tmp_path):
    """chorus.hooks.allreduce_hook on 2 simulated hosts x 2 ranks over verbs (4 MiB rings,
    so the ring all-reduce's messages reach the zero-copy path): the parameters after 4 steps
    equal those of DDP's default hook bit for bit, every bucket was registered, and bytes
    went straight from the buckets."""
    res = run_job("verbs-ddp", WORKER, 4, args=["--out", str(tmp_path), "--mode", "ddp"],
                  env=verbs_env(fake_lib, FAKEVERBS_DEVICES="fake0", CHORUS_BUFFSIZE="4M"),
                  timeout=180)
    assert res.ok, res.describe()
    recs = records(tmp_path, 4)
    for r, rec in recs.items():
        assert rec["failures"] == [], f"rank {r}: {rec['failures'][:10]}"
        assert rec["checks"] == 5, f"rank {r} ran {rec['checks']} checks"
    zero_copy = 0
    for r in res.ranks:
        m = re.search(r"verbs: sent (\d+) bytes straight from registered buffers", r.output)
        assert m, f"rank {r.rank}: no verbs summary at destroy:\n{r.output[-3000:]}"
        zero_copy += int(m.group(1))
        assert "fakeverbs:" not in r.output, r.output[-3000:]
    assert zero_copy >= 1 << 20, f"only {zero_copy} bytes went zero-copy"
    # DDP rebuilds its buckets after the first step: the hook replaced a registration
    assert all(rec["ddp"]["replaced"] >= 1 for rec in recs.values()), recs


def test_completion_error_raises_naming_peer_and_status(fake_lib, tmp_path):
    res = run_job("verbs-fault", WORKER, 2, args=["--out", str(tmp_path), "--mode", "fault"],
                  env=verbs_env(fake_lib, FAKEVERBS_DEVICES="fake0", VERBS_RANKS_PER_HOST="1",
                                VERBS_FAIL_AFTER="40"),
                  timeout=120)
    assert res.ok, res.describe()
    recs = records(tmp_path, 2)
    for r, rec in recs.items():
        err = rec["error"]
        assert err, f"rank {r}: no exception after the injected error ({rec['checks']} checks)"
        assert rec["failures"] == [], f"rank {r}: wrong values before the error: {rec['failures']}"
        # the process-group timeout is 60 s: a failure that waits for it is a hang
        assert rec["seconds"] < 20, f"rank {r} took {rec['seconds']:.1f} s to fail: {err}"
        assert "transport retry counter exceeded" in err and "status 12" in err, \
            f"rank {r}: the verbs status is not named: {err}"
        other = 1 - r
        assert f"rank {r} peer {other} (verbs" in err, f"rank {r}: the peer is not named: {err}"
    # the rank whose completion failed says so first-hand, with the vendor error it got
    assert "vendor error 0x81" in recs[0]["error"], recs[0]["error"]


def test_without_libibverbs_the_job_runs_over_tcp(tmp_path):
    """Rank 0 names a library that does not exist, rank 1 the default name (libibverbs.so.1:
    absent in CI, or present without any RDMA device): on both, verbs are unavailable, said
    once, and the two simulated hosts talk over TCP."""
    missing = "/nonexistent/libibverbs.so.1"
    res = run_job("verbs-none", WORKER, 2, args=["--out", str(tmp_path), "--mode", "plain"],
                  env=verbs_env("", VERBS_RANKS_PER_HOST="1", VERBS_LIB_OF_RANK=f"{missing},"),
                  timeout=120)
    assert res.ok, res.describe()
    recs = records(tmp_path, 2)
    for r, rec in recs.items():
        assert rec["failures"] == [] and rec["checks"] == 1, rec
    for r in res.ranks:
        said = re.findall(r"verbs unavailable \(.*\)|verbs: no usable NIC", r.output)
        assert len(said) == 1, f"rank {r.rank}: {said}\n{r.output[-3000:]}"
        if r.rank == 0:
            assert f"cannot load {missing}" in said[0], said
        line = f"peer {1 - r.rank} (simhost{1 - r.rank}) via socket"
        assert line in r.output, r.output[-3000:]
