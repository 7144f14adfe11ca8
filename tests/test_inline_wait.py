"""Where the ranks of a host outnumber half its cores (no spinning), a thread that waits for
a CPU collective the engine has not started runs it itself instead of waking the engine and
sleeping until the engine wakes it (docs/design.md, "Waiters run the collective"). These
tests check that the caller, not the engine thread, does the work of blocking collectives;
that a collective nobody waits for still starts; and that async collectives waited out of
order, from two threads, polled, and mixed with point-to-point messages all stay correct."""
import os

from launch import WORKERS, run_job

WORKER = os.path.join(WORKERS, "inline_wait.py")
NOSPIN = {"CHORUS_SPIN_COUNT": "0"}  # the oversubscribed mode, whatever the runner's cores


def test_blocking_collectives_run_on_the_calling_thread():
    res = run_job("inline-cpu", WORKER, 2, env=dict(NOSPIN, CHORUS_TEST_PART="cpu"),
                  timeout=180)
    assert res.ok, res.describe()
    for rank, got in res.results().items():
        assert got["correct"] and got["engines"] == 1, got
        # The engine thread only naps (a timed sleep every 0.5 ms): a few microseconds per
        # wake-up. Running the all_reduces itself it would take a large share of the
        # caller's time, which includes Python and torch.
        assert got["engine_ns"] < 0.15 * got["caller_ns"], got


def test_a_collective_nobody_waits_for_still_starts():
    res = run_job("inline-unwaited", WORKER, 3, env=dict(NOSPIN, CHORUS_TEST_PART="unwaited"),
                  timeout=120)
    assert res.ok, res.describe()
    got = res.results()
    assert all(g["correct"] for g in got.values()), got
    for rank in (1, 2):
        # rank 0 sleeps 2 s before it waits: its engine started the collective long before
        assert got[rank]["blocked_s"] < 0.5, got


def test_out_of_order_threaded_and_polled_waits_with_p2p():
    for extra in (NOSPIN, {"CHORUS_SPIN_COUNT": "0", "CHORUS_SHM_DISABLE": "1"}):
        res = run_job("inline-mixed", WORKER, 3, env=dict(extra, CHORUS_TEST_PART="mixed"),
                      timeout=180)
        assert res.ok, res.describe()
        got = res.results()
        assert all(g["correct"] for g in got.values()), (extra, got)
