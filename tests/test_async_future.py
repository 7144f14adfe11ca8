"""async_op=True: six different collectives in flight at once, waited in reverse order
(Work.wait, Work.is_completed); Work.get_future() whose value is the output tensors themselves
and whose then() callback sees the finished result (what DDP comm hooks rely on); a then()
callback that blocks on another collective's future (what PowerSGD's hook does) returns."""
import os

import pytest

from conftest import family_params
from launch import WORKERS, run_job

ASYNC_FAMILIES = [("async_wait", 1), ("async_future", 1), ("future_callback_waits", 1)]


@pytest.mark.parametrize("family,world,transport", family_params(ASYNC_FAMILIES))
def test_async_work_completes_with_correct_outputs(check_runs, family, world, transport):
    check_runs.get(world, transport).assert_family(family)


def test_get_future_while_the_work_finishes():
    """Work.get_future() called while the core thread finishes the work and needs the GIL to
    drop a temporary input (tests/workers/future_gil.py): hung at the second iteration before
    get_future() released the GIL for that wait; 300 iterations on 2 ranks now."""
    res = run_job("future-gil", os.path.join(WORKERS, "future_gil.py"), 2,
                  env={"CHORUS_TEST_PG_TIMEOUT": "20"}, timeout=120)
    assert res.ok, res.describe()
    for r in res.ranks:
        assert "ok 300" in r.output, r.output[-2000:]
