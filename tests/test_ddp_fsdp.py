"""Training through the backend: DDP and FSDP2 (fully_shard) on CPU, 4 ranks, 20 steps of SGD
with momentum on a small MLP (tests/workers/train.py).

Bars: DDP parameters match a Gloo run within 1e-5 relative; FSDP2 per-step losses match a
Gloo run within 1e-5. Independently of Gloo, both must match one process training on all
ranks' batches (what data parallelism computes in exact arithmetic). With
CHORUS_TEST_BACKEND=gloo the "match Gloo" tests compare the run with itself; the single-process
comparisons are what validate the harness then.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from launch import WORKERS, backend_under_test, base_env, run_job, run_reference_job

TRAIN = os.path.join(WORKERS, "train.py")
RTOL = 1e-5


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    backends = [backend_under_test()] + (["gloo"] if backend_under_test() != "gloo" else [])
    jobs = {}
    for b in backends:
        run = run_job if b == backend_under_test() else run_reference_job
        jobs[b] = run(f"train-{b}", TRAIN, 4, args=["both", str(root / b)],
                      env={"CHORUS_TEST_BACKEND": b}, timeout=300)
    env = base_env(1, 0)
    single = subprocess.run([sys.executable, TRAIN, "single", str(root / "single.pt"), "4"],
                            env=env, capture_output=True, text=True, timeout=300)
    return root, jobs, single


def load(training, who, mode):
    root, jobs, single = training
    if who == "single":
        assert single.returncode == 0, single.stdout + single.stderr
        return torch.load(root / "single.pt")
    job = jobs[who]
    assert job.ok, job.describe()
    return torch.load(root / f"{who}-{mode}.pt")


def assert_params_close(got, ref, what):
    assert got.keys() == ref.keys(), (sorted(got), sorted(ref))
    for name in ref:
        a, b = got[name].double(), ref[name].double()
        # Normwise relative: max |a - b| against max |b| of the tensor.
        err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        assert err <= RTOL, f"{what}: parameter {name} differs by {err:.3g} (relative, max norm)"


def assert_losses_close(got, ref, what):
    a, b = np.array(got["losses"]), np.array(ref["losses"])
    assert a.shape == b.shape == (20, 4), (a.shape, b.shape)
    rel = np.abs(a - b) / np.abs(b)
    step, rank = np.unravel_index(np.argmax(rel), rel.shape)
    assert rel.max() <= RTOL, (f"{what}: loss of rank {rank} at step {step} is {a[step, rank]!r}, "
                               f"reference {b[step, rank]!r} (relative {rel.max():.3g})")


def test_ddp_parameters_match_gloo_run(training):
    assert_params_close(load(training, backend_under_test(), "ddp")["params"],
                        load(training, "gloo", "ddp")["params"], "DDP vs Gloo")


def test_ddp_matches_single_process_training(training):
    got, ref = load(training, backend_under_test(), "ddp"), load(training, "single", None)
    assert_losses_close(got, ref, "DDP vs one process")
    assert_params_close(got["params"], ref["params"], "DDP vs one process")


def test_fsdp2_losses_match_gloo_run(training):
    assert_losses_close(load(training, backend_under_test(), "fsdp"),
                        load(training, "gloo", "fsdp"), "FSDP2 vs Gloo")


def test_fsdp2_matches_single_process_training(training):
    got, ref = load(training, backend_under_test(), "fsdp"), load(training, "single", None)
    assert_losses_close(got, ref, "FSDP2 vs one process")
    assert_params_close(got["params"], ref["params"], "FSDP2 vs one process")
