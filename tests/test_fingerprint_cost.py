"""The cross-rank call fingerprint costs at most 5% of an 8-byte all_reduce.

Runs tools/fp_cost.sh (bench_comm built as shipped and with -DCHORUS_NO_FINGERPRINT,
alternating from round to round) on 4 ranks over shared memory and over sockets, and bounds
the slowdown of the shipped build by MAX_RATIO.

The bound is checked on the median of the per-round ratios (each round times both builds
back to back, so the slow drift of a shared machine cancels within a round), which on the
2-core test machine is far steadier than the ratio of the two builds' medians: there one
4-rank run's time varies by 10-20% from run to run, and the ratio of medians still strays by
about 5% (it is printed, not bounded). 80 rounds: about a minute on 2 cores, the two builds
included (FP_COST_ROUNDS / FP_COST_ITERS override it).

A transport whose paired ratio exceeds the bound is measured once more and the bound applies
to that second measurement (both are printed). With 40 rounds that was not enough: on a
loaded CI machine whose shared-memory runs spread from 7 to 24 us per call, the paired median
of 40 rounds came out at 1.094 on the second measurement as well, while on this machine
two identical builds (FP_AA=1) give 0.96-1.02 over 40 rounds. 80 rounds halve the median's
variance; a real regression of the fingerprint path still fails both measurements.
"""
import os
import re
import signal
import subprocess

from launch import REPO

MAX_RATIO = 1.05
ROUNDS = os.environ.get("FP_COST_ROUNDS", "80")
ITERS = os.environ.get("FP_COST_ITERS", "1000")
TIMEOUT = 300  # a hang, not a slow machine: the setting takes 30-70 s on 2 cores
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
            f"(median of {rounds} per-round ratios {paired}; medians {with_us} us with, "
            f"{without_us} us without, ratio {ratio}), more than "
            f"{100 * (MAX_RATIO - 1):.0f}% on two measurements:\n{out}\n{err[-6000:]}")
