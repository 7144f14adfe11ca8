"""The C core's unit tests (tests/c, their own Makefile) build and pass."""
import os
import re
import subprocess

import pytest

from launch import REPO


def test_c_unit_tests_build_and_pass():
    if os.environ.get("CHORUS_C_UNITS_PASSED") == "1":
        # `make test` runs `make -C tests/c` right before pytest and stops if it fails.
        pytest.skip("make test ran the C unit tests (make -C tests/c) just before pytest; "
                    "they passed")
    proc = subprocess.run(["make", "-C", os.path.join(REPO, "tests", "c")], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"make -C tests/c exited {proc.returncode}:\n{out[-8000:]}"
    # tests/c/Makefile ends with a line "N passed, M failed".
    counts = re.findall(r"^(?:\w+: )?(\d+) passed, (\d+) failed", out, re.M)
    assert counts, f"no 'N passed, M failed' line in the output:\n{out[-4000:]}"
    passed, failed = map(int, counts[-1])
    assert failed == 0 and passed > 0, out[-8000:]
