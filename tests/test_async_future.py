"""async_op=True: six different collectives in flight at once, waited in reverse order
(Work.wait, Work.is_completed); Work.get_future() whose value is the output tensors themselves
and whose then() callback sees the finished result (what DDP comm hooks rely on); a then()
callback that blocks on another collective's future (what PowerSGD's hook does) returns."""
import pytest

from conftest import family_params

ASYNC_FAMILIES = [("async_wait", 1), ("async_future", 1), ("future_callback_waits", 1)]


@pytest.mark.parametrize("family,world,transport", family_params(ASYNC_FAMILIES))
def test_async_work_completes_with_correct_outputs(check_runs, family, world, transport):
    check_runs.get(world, transport).assert_family(family)
