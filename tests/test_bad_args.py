"""Bad arguments to a chorus process group: each raises on the calling rank, before anything
reaches the peers, a RuntimeError whose message names the operation and what to fix; the
group stays usable afterwards; a call after destroy_process_group raises too.
(tests/workers/bad_args.py makes the calls; 2 ranks, and 3 so that sizes are not all 2.)"""
import os
import re

import pytest

from launch import WORKERS, backend_under_test, run_job

WORKER = os.path.join(WORKERS, "bad_args.py")

# case -> (exception type, regular expression over the message; {w} is the world size)
EXPECTED = {
    "dtype_mismatch_all_gather": ("RuntimeError", r"all_gather_into_tensor: dtype mismatch "
                                  r"between input \(float32\) and output \(float64\)"),
    "output_size_all_gather": ("RuntimeError", r"all_gather_into_tensor: output must hold "
                               r"world_size \({w}\) x input \(8 elements\)"),
    "input_size_reduce_scatter": ("RuntimeError", r"reduce_scatter_tensor: input must hold "
                                  r"world_size \({w}\) x output"),
    "list_length_all_gather": ("RuntimeError", r"all_gather: expected {w} output tensors"),
    "list_length_all_to_all": ("RuntimeError", r"all_to_all: expected {w} input and output "
                               r"tensors"),
    "unsupported_dtype": ("RuntimeError", r"dtype UInt32 is not supported \(supported: "
                          r"float32, .*float8_e4m3fn, float8_e5m2\)"),
    "invalid_root_broadcast": ("RuntimeError", r"broadcast: invalid root rank {w5} for a "
                               r"group of {w} ranks"),
    "invalid_peer_send": ("RuntimeError", r"send: invalid peer rank {w3} for a group of {w}"),
    "negative_tag_send": ("RuntimeError", r"send: invalid tag -1"),
    "negative_tag_recv": ("RuntimeError", r"recv: invalid tag -2"),
    "split_sizes_sum": ("RuntimeError", r"all_to_all: input split sizes sum to {w} but the "
                        r"tensor's dim 0 is {w4}"),
    "split_sizes_length": ("RuntimeError", r"all_to_all: input split sizes have {w1} entries, "
                           r"expected one per rank \({w}\)"),
    "non_contiguous_is_staged": ("NO_ERROR", None),
    "sparse_tensor": ("RuntimeError", r"all_reduce: only dense \(strided\) tensors"),
    "bitwise_on_float": ("RuntimeError", r"BAND is not defined for float32"),
    "use_after_destroy": ("RuntimeError", r"process group was shut down"),
}


# The cases only a machine with a GPU can make (tests/test_cuda.py runs them).
EXPECTED_CUDA = {
    f"device_mix_{op}": ("RuntimeError", rf"{name}: all tensors must be on one device, got "
                         r"(cuda:\d+ and cpu|cpu and cuda:\d+)")
    for op, name in [("all_gather", "all_gather_into_tensor"), ("all_gather_list", "all_gather"),
                     ("all_to_all", "all_to_all")]
}


def check_bad_args(world, device="cpu"):
    """Runs tests/workers/bad_args.py on world ranks with its tensors on `device` and checks
    every case's exception type and message."""
    expected = dict(EXPECTED, **(EXPECTED_CUDA if device == "cuda" else {}))
    res = run_job(f"bad-args-{device}-ws{world}", WORKER, world, timeout=180,
                  env={"CHORUS_TEST_DEVICE": device})
    assert res.ok, res.describe()
    subst = {"w": world, "w1": world + 1, "w3": world + 3, "w4": 4 * world, "w5": world + 5}
    for r in res.ranks:
        assert "STILL_USABLE" in r.output and "BAD_ARGS_DONE" in r.output, res.describe()
        seen = {}
        for line in r.output.splitlines():
            m = re.match(r"CASE (\S+) (\S+) ?(.*)$", line)
            if m:
                seen[m.group(1)] = (m.group(2), m.group(3))
        assert set(seen) == set(expected), (sorted(seen), res.describe())
        for name, (etype, pattern) in expected.items():
            got_type, msg = seen[name]
            assert got_type == etype, f"rank {r.rank} {name}: {got_type} {msg}"
            if pattern:
                assert msg.startswith("chorus: "), f"rank {r.rank} {name}: {msg}"
                assert re.search(pattern.format(**subst), msg), f"rank {r.rank} {name}: {msg}"


@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
@pytest.mark.parametrize("world", [2, 3])
def test_every_bad_argument_raises_a_clear_error(world):
    check_bad_args(world)
