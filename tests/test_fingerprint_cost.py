"""The cross-rank call fingerprint costs at most 5% of an 8-byte all_reduce.

Runs tools/fp_cost.sh on 4 ranks over shared memory and over sockets: bench_comm built with
-DCHORUS_FP_SWITCH, whose every run interleaves calls with the fingerprint and without it
(on, off, off, on, ...), and bounds the median over the runs of the per-run ratio of the
mean call times by MAX_RATIO.

Why interleaved within a run: on the 2-core test machine one 4-rank run's time moves by up
to 2x from run to run (where the scheduler puts the ranks), so a comparison of two builds
run one after the other (the method until 2026-12-07) had a median ratio that strayed by
+-6% over 80 rounds even for two identical builds, and failed CI twice at 1.06-1.09. Calls
of the two kinds in one run share that placement: there the median of 100 per-run ratios
of identical code (FP_AA=1) comes out within 1% of 1, and the fingerprint's cost at about
1-2% (docs/PERFORMANCE.md). 100 runs of 2000 calls: under a minute on 2 cores
(FP_COST_ROUNDS / FP_COST_ITERS override it).

A transport whose paired ratio exceeds the bound is measured once more and the bound applies
to that second measurement (both are printed): a burst of load from outside can still
bias one measurement, a real regression of the fingerprint path fails both.
"""
import os
import re
import signal
import subprocess

from launch import REPO

MAX_RATIO = 1.05
ROUNDS = os.environ.get("FP_COST_ROUNDS", "100")
ITERS = os.environ.get("FP_COST_ITERS", "2000")
TIMEOUT = 300  # a hang, not a slow machine: the setting takes 40-60 s on 2 cores
RESULT = re.compile(r"^RESULT transport=(\S+) ranks=(\d+) bytes=(\d+) with_us=(\S+) "
                    r"without_us=(\S+) ratio=(\S+) paired=(\S+) rounds=(\d+)$", re.M)


def run_fp_cost():
    env = dict(os.environ, FP_RANKS="4", FP_TRANSPORTS="shm socket", FP_BYTES="8")
    proc = subprocess.Popen(["bash", os.path.join(REPO, "tools", "fp_cost.sh"), ROUNDS, ITERS],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and the ranks it started
        out, err = proc.communicate()
        raise AssertionError(f"tools/fp_cost.sh ran past {TIMEOUT} s:\n{out}\n{err[-4000:]}")
    return proc.returncode, out, err


def measure():
    rc, out, err = run_fp_cost()
    assert rc == 0, f"tools/fp_cost.sh exited {rc}:\n{out}\n{err[-6000:]}"
    results = {m[0]: m for m in RESULT.findall(out)}
    assert set(results) == {"shm", "socket"}, f"expected shm and socket results:\n{out}"
    print(out)
    for transport, (_, ranks, _, with_us, without_us, _, _, rounds) in results.items():
        assert int(rounds) == int(ROUNDS) and ranks == "4"
        assert float(with_us) > 0 and float(without_us) > 0
    return results, out, err


def test_fingerprint_costs_at_most_5_percent():
    results, out, err = measure()
    over = [t for t, m in results.items() if float(m[6]) > MAX_RATIO]
    if over:
        print(f"over the bound on the first measurement: {over}; measuring again")
        again, out, err = measure()
        results = {t: again[t] for t in over}
    for transport, (_, ranks, _, with_us, without_us, ratio, paired, rounds) in results.items():
        assert float(paired) <= MAX_RATIO, (
            f"{transport}, {ranks} ranks: the fingerprint costs {100 * (float(paired) - 1):.1f}% "
            f"(median of {rounds} per-run ratios {paired}; medians {with_us} us with, "
            f"{without_us} us without, ratio {ratio}), more than "
            f"{100 * (MAX_RATIO - 1):.0f}% on two measurements:\n{out}\n{err[-6000:]}")
