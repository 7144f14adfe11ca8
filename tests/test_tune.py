"""The tuner seen from Python: `python -m chorus.tune` for a few topologies (output, JSON,
input errors), and in real multi-rank jobs that CHORUS_ALGO=bogus makes init_process_group
fail with a message naming the bad token, that CHORUS_DEBUG=INFO logs one choice line per
(collective, algorithm, size bucket), that the choices logged are the plan's, and that the
ranks agree on whether every engine spins (the socket constants) when their
CHORUS_SPIN_COUNT differs."""
import json
import os
import re
import subprocess
import sys

import pytest

from launch import REPO, WORKERS, backend_under_test, run_job

pytestmark = pytest.mark.skipif(backend_under_test() != "chorus",
                                reason="the tuner is Chorus's own")
WORKER = os.path.join(WORKERS, "tune_worker.py")


def tune(*args, env=None):
    e = dict(os.environ)
    e.pop("CHORUS_ALGO", None)
    e.pop("NCCL_ALGO", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "chorus.tune", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=e, cwd=REPO)


def tune_json(*args, env=None):
    proc = tune(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("n,k,shm", [(1, 1, 1), (4, 4, 1), (4, 4, 0), (12, 5, 1), (64, 8, 1),
                                     (4096, 8, 1), (4096, 1, 0)])
def test_tune_cli_prints_a_choice_per_size(n, k, shm):
    proc = tune("--nranks", n, "--ranks-per-host", k, "--shm", shm, "-b", 8, "-e", "1M", "-f", 4)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if not l.startswith("#")]
    sizes = [8 * 4 ** i for i in range(10) if 8 * 4 ** i <= 1 << 20]
    assert len(lines) == len(sizes), proc.stdout
    hosts = -(-n // k)
    assert f"{n} ranks on {hosts} host" in proc.stdout
    if n % k:
        assert f"the last holds {n - (hosts - 1) * k}" in proc.stdout
    for line, size in zip(lines, sizes):
        cols = line.split()
        assert cols[0] == "all_reduce" and int(cols[1]) == size, line
        assert re.fullmatch(r"[a-z]+", cols[2]), line


def test_tune_cli_json_all_collectives_with_unimplemented():
    doc = tune_json("--nranks", 4096, "--ranks-per-host", 8, "--collective", "all",
                    "--unimplemented", "-b", 8, "-e", "1G", "-f", 1024)
    assert doc["nhosts"] == 512 and doc["ranks_per_host"] == 8
    colls = {r["collective"] for r in doc["results"]}
    assert colls == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                     "all_to_all", "gather", "scatter", "barrier"}
    for r in doc["results"]:
        costs = [c["predicted_us"] for c in r["candidates"] if c["predicted_us"] is not None]
        assert r["algo"] == r["candidates"][0]["algo"]
        assert costs == sorted(costs), r
        # one-host algorithms never appear on 512 hosts
        assert all(c["algo"] not in ("oneshot", "twoshot") for c in r["candidates"]), r
    ar = {r["bytes"]: r for r in doc["results"] if r["collective"] == "all_reduce"}
    # latency-bound at 8 bytes, not an O(n)-step or O(n)-message algorithm
    assert ar[8]["algo"] not in ("ring", "direct", "pairwise"), ar[8]
    assert ar[8]["predicted_us"] < ar[max(ar)]["predicted_us"]


def test_tune_cli_without_flag_lists_only_built_algorithms():
    doc = tune_json("--nranks", 8, "--ranks-per-host", 8, "-b", 8, "-e", 8)
    assert all(c["implemented"] for r in doc["results"] for c in r["candidates"])


def test_tune_cli_honours_algo_override_and_env():
    doc = tune_json("-n", 64, "-k", 8, "--algo", "allreduce:rd", "--unimplemented", "-b", 8, "-e", 8)
    assert doc["results"][0]["algo"] == "rd" and doc["results"][0]["forced"]
    doc = tune_json("-n", 64, "-k", 8, "--unimplemented", "-b", 8, "-e", 8,
                    env={"NCCL_ALGO": "Tree"})
    assert doc["results"][0]["algo"] == "tree" and doc["results"][0]["forced"]


def test_tune_cli_spin_picks_the_socket_constants():
    """--spin 1 plans for engines that spin (cheaper socket steps: the ring for a 32 KB
    broadcast on 4 ranks), --spin 0 for engines that do not (direct); auto follows
    CHORUS_SPIN_COUNT, else this machine's cores; with shm the answer does not change."""
    args = ("-n", 4, "--shm", 0, "-c", "broadcast", "-b", "32K", "-e", "32K")
    on, off = tune_json(*args, "--spin", 1), tune_json(*args, "--spin", 0)
    assert on["spin"] is True and off["spin"] is False
    assert (on["results"][0]["algo"], off["results"][0]["algo"]) == ("ring", "direct")
    assert on["results"][0]["predicted_us"] < off["results"][0]["predicted_us"]
    for count, want in (("0", False), ("7", True)):
        doc = tune_json(*args, env={"CHORUS_SPIN_COUNT": count})
        assert doc["spin"] is want, doc
    text = tune(*args, "--spin", 1).stdout
    assert "intra-host socket, every engine spins" in text, text
    text = tune(*args, env={"CHORUS_SPIN_COUNT": "0"}).stdout
    assert "not every engine spins (auto: as on this machine)" in text, text
    shm = [tune_json("-n", 4, "-c", "all", "-b", 8, "-e", "64M", "-f", 8, "--spin", s)["results"]
           for s in (0, 1)]
    assert [r["algo"] for r in shm[0]] == [r["algo"] for r in shm[1]]


@pytest.mark.parametrize("args,needle", [
    (["--nranks", 0], "--nranks must be >= 1"),
    (["--nranks", 4, "--spin", 2], "--spin: invalid choice"),
    (["--nranks", 4, "--ranks-per-host", 8], "--ranks-per-host must be between 1 and"),
    (["--nranks", 4, "--ranks-per-host", 0], "--ranks-per-host must be between 1 and"),
    (["--nranks", 4, "--collective", "allredux"], "unknown collective 'allredux'"),
    (["--nranks", 4, "-b", "1G", "-e", "1K"], "is larger than -e"),
    (["--nranks", 4, "-b", "12Q"], "not a size"),
    (["--nranks", 4, "--algo", "bogus"], 'unknown algorithm "bogus"'),
])
def test_tune_cli_rejects_bad_input_clearly(args, needle):
    proc = tune(*args)
    assert proc.returncode == 2, proc.stdout
    assert needle in proc.stderr, proc.stderr


def test_chorus_algo_bogus_fails_init_process_group():
    res = run_job("tune-bogus", WORKER, 2, args=["64"], env={"CHORUS_ALGO": "allreduce:bogus"},
                  timeout=120)
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert r.returncode == 3, res.describe()
        m = re.search(r"INIT_FAILED: (.*)", r.output)
        assert m, res.describe()
        assert 'CHORUS_ALGO="allreduce:bogus"' in m.group(1) and '"bogus"' in m.group(1), m.group(1)
        assert "valid: direct" in m.group(1), m.group(1)


SPINS = re.compile(r"INFO TUNE tuner: 4 ranks, .*, (every engine spins|not every engine spins)")


@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_debug_info_logs_each_choice_once_and_matches_the_plan(transport):
    sizes = [64, 64, 1 << 20, 1 << 20]  # repeats must not log again
    res = run_job(f"tune-info-{transport}", WORKER, 4, args=[str(s) for s in sizes],
                  env={"CHORUS_DEBUG": "INFO", "CHORUS_DEBUG_SUBSYS": "TUNE",
                       "CHORUS_SHM_DISABLE": "1" if transport == "socket" else "0"},
                  timeout=180)
    assert res.ok, res.describe()
    shm = 1 if transport == "shm" else 0
    seen, spins = set(), set()
    for r in res.ranks:
        assert "TUNE_WORKER_OK" in r.output, res.describe()
        spins.update(SPINS.findall(r.output))
        choices = re.findall(r"INFO TUNE (all_reduce|all_gather|barrier) (\d+) bytes x 4 ranks: "
                             r"(\w+) \((?:predicted [\d.]+ us|no prediction)[^)]*\) \[tuner\]",
                             r.output)
        ar = [c for c in choices if c[0] == "all_reduce"]
        assert sorted(int(c[1]) for c in ar) == [64, 1 << 20], r.output
        assert any(c[0] == "all_gather" for c in choices), r.output
        assert any(c[0] == "barrier" for c in choices), r.output
        seen.update(choices)
    assert len(spins) == 1, res.describe()  # one spin verdict, the same on every rank
    from chorus.tune import plan  # the same chorus_tune_plan the CLI prints
    for coll, nbytes, algo in sorted(seen):
        p = plan(coll, int(nbytes), 4, 4, shm=bool(shm), algo="",
                 spin=spins == {"every engine spins"})
        assert p["algo"] == algo, (coll, nbytes, algo, p)


@pytest.mark.parametrize("counts,verdict", [("5,5,5,5", "every engine spins"),
                                            ("5,5,0,5", "not every engine spins"),
                                            ("0,0,0,0", "not every engine spins")])
def test_spinning_engines_are_agreed_and_pick_the_socket_constants(counts, verdict):
    """Over sockets, the tuner takes faster constants where every rank's engine spins. The
    ranks must agree on that even when their CHORUS_SPIN_COUNT differs (a rank that chose
    alone would run another algorithm than its peers): one rank at 0 makes every rank take
    the slower constants. The 32 KB broadcast is where the two models choose differently
    (ring against direct), so its logged choice shows which model each rank used."""
    res = run_job("tune-spin", WORKER, 4, args=["64", str(1 << 20)],
                  env={"CHORUS_DEBUG": "INFO", "CHORUS_DEBUG_SUBSYS": "TUNE",
                       "CHORUS_SHM_DISABLE": "1", "TUNE_SPIN_COUNTS": counts},
                  timeout=180)
    assert res.ok, res.describe()
    from chorus.tune import plan
    spin = verdict == "every engine spins"
    want = plan("broadcast", 32768, 4, 4, shm=False, algo="", spin=spin)["algo"]
    assert want != plan("broadcast", 32768, 4, 4, shm=False, algo="", spin=not spin)["algo"]
    for r in res.ranks:
        assert "TUNE_WORKER_OK" in r.output, res.describe()
        assert SPINS.findall(r.output) == [verdict], r.output
        got = re.findall(r"INFO TUNE broadcast 32768 bytes x 4 ranks: (\w+) ", r.output)
        assert got == [want], r.output
