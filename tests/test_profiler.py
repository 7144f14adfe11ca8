"""torch.profiler sees Chorus collectives (issue bar): 2 ranks run 3 DDP steps under
torch.profiler (record_shapes=True) and export Chrome traces (tests/workers/profile_ddp.py).
Each trace must hold at least 3 `chorus:all_reduce` events (one gradient bucket per step)
whose recorded input is the flat float32 bucket of every gradient element of the model
("Input Dims" [[n]], "Input type" ["float"]), with a positive duration."""
import json
import os
import re

import pytest

from launch import WORKERS, backend_under_test, run_job

WORKER = os.path.join(WORKERS, "profile_ddp.py")


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's profiler events")
def test_ddp_profile_shows_chorus_all_reduce_with_sizes(tmp_path):
    check_profile(tmp_path)


def check_profile(tmp_path, device="cpu"):
    """The test above; tests/test_cuda.py runs it on CUDA. Returns both ranks' traces."""
    res = run_job(f"profile-ddp-{device}", WORKER, 2, args=[str(tmp_path)], timeout=180,
                  env={"CHORUS_TEST_DEVICE": device})
    assert res.ok, res.describe()
    params = int(re.search(r"^PARAMS (\d+)$", res.ranks[0].output, re.M).group(1))
    assert params == 16 * 32 + 32 + 32 * 4 + 4
    traces = []
    for rank in range(2):
        with open(tmp_path / f"trace{rank}.json") as f:
            trace = json.load(f)
        traces.append(trace)
        # the host-side events (with CUDA activities the profiler also draws each range on
        # the GPU timeline, cat "gpu_user_annotation", which carries no shapes)
        events = [e for e in trace["traceEvents"] if e.get("name") == "chorus:all_reduce"
                  and e.get("cat") != "gpu_user_annotation"]
        assert len(events) >= 3, sorted({e.get("name") for e in trace["traceEvents"]
                                         if "chorus" in str(e.get("name"))})
        for e in events:
            args = e.get("args", {})
            assert args.get("Input Dims") == [[params]], e
            assert args.get("Input type") == ["float"], e
            assert e.get("dur", 0) > 0, e
    return traces
