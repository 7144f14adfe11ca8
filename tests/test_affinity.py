"""Chorus sizes its defaults (spinning waits, helper threads, socket I/O threads) by the cores
the ranks of a host may use: the union of their affinity masks, not the host's CPU count. Two
ranks pinned to one CPU share 1 core; pinned to two different CPUs they have 2; the group
works either way."""
import os
import re

import pytest

from launch import WORKERS, run_job

WORKER = os.path.join(WORKERS, "affinity.py")


def usable_cpus():
    return sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize("layout", ["shared", "disjoint"])
def test_cores_are_the_union_of_the_ranks_affinity_masks(layout):
    cpus = usable_cpus()
    assert len(cpus) >= 2, f"this test needs 2 usable CPUs, the runner has {cpus}"
    picks = [cpus[0], cpus[0]] if layout == "shared" else [cpus[0], cpus[1]]
    env = {"CHORUS_DEBUG": "INFO", "CHORUS_DEBUG_SUBSYS": "INIT",
           "CHORUS_TEST_CPUS_0": picks[0], "CHORUS_TEST_CPUS_1": picks[1]}
    res = run_job(f"affinity-{layout}", WORKER, 2, env=env, timeout=120)
    assert res.ok, res.describe()
    want = len(set(picks))
    results = res.results()
    for r in res.ranks:
        got = results[r.rank]
        assert got["correct"] and got["cpus"] == [picks[r.rank]], got
        m = re.search(r"(\d+) cores for the 2 ranks on this host \(the union of their affinity "
                      r"masks; this rank may use (\d+)\)", r.output)
        assert m, r.output[-3000:]
        assert (int(m.group(1)), int(m.group(2))) == (want, 1), m.group(0)
