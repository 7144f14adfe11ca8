"""Every collective x dtype x op x size (0, 1, 7, 4099, 3 x CHORUS_BUFFSIZE) x in-place /
out-of-place, for 1-4 ranks over shared memory and over sockets, against a reference each rank
computes locally from every rank's deterministic input. Outputs are poisoned before each call.

One job per (world size, transport) runs all checks (see conftest.CheckRun); each test below
asserts on one family of that job's records and lists every mismatch it found.
"""
import os

import pytest

from conftest import family_params
from launch import WORKERS, run_job

COLLECTIVE_FAMILIES = [
    ("broadcast", 1),
    ("all_reduce", 1),  # includes two's-complement wrap-around cases
    ("all_reduce_coalesced", 1),  # dist.all_reduce_coalesced and _coalescing_manager
    ("reduce", 1),
    ("all_gather", 1),  # list form, also uneven sizes across ranks
    ("all_gather_into_tensor", 1),  # in-place = input is a slice of the output (FSDP2)
    ("allgather_into_tensor_coalesced", 1),  # _coalescing_manager and functional collectives
    ("gather", 1),
    ("scatter", 1),
    ("reduce_scatter", 1),
    ("reduce_scatter_tensor", 1),  # in-place = output is a chunk of the input (ZeRO)
    ("reduce_scatter_tensor_coalesced", 1),
    ("all_to_all_single", 1),  # with and without split sizes
    ("all_to_all", 1),
    ("float8", 1),  # float8_e4m3fn / float8_e5m2: reductions with every float op, data movement
    ("noncontiguous", 1),  # works, or raises an error naming contiguity
]


@pytest.mark.parametrize("family,world,transport", family_params(COLLECTIVE_FAMILIES))
def test_collective_matches_reference(check_runs, family, world, transport):
    check_runs.get(world, transport).assert_family(family)


def test_harness_reports_a_corrupted_element_precisely(tmp_path):
    """The harness itself: with CHORUS_TEST_SABOTAGE=1 the last rank overwrites element n//2
    of each all_reduce result after the call. Every such case must be reported as a failure
    on that rank, naming that index; the other rank must still pass. Runs on gloo because it
    tests the checker, not the backend."""
    res = run_job("sabotage", os.path.join(WORKERS, "run_checks.py"), 2,
                  args=["--out", str(tmp_path), "--families", "all_reduce"],
                  env={"CHORUS_TEST_BACKEND": "gloo", "CHORUS_TEST_SABOTAGE": "1",
                       "CHORUS_BUFFSIZE": "4096"}, timeout=300)
    assert res.ok, res.describe()
    import json
    recs = {r: [json.loads(x) for x in open(tmp_path / f"rank{r}.jsonl")] for r in (0, 1)}
    checked = [x for x in recs[1] if x["status"] in ("pass", "fail") and x["size"] > 0]
    assert checked, "no all_reduce case ran"
    for x in checked:
        assert x["status"] == "fail", x
        assert f"first wrong index {x['size'] // 2}:" in x["detail"], x
    assert all(x["status"] in ("pass", "unsupported", "family_done") for x in recs[0]), \
        [x for x in recs[0] if x["status"] not in ("pass", "unsupported", "family_done")][:3]
