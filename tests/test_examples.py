"""The examples in examples/ train on CPU under Chorus, and each loss curve matches its
reference within the tolerance the example itself states (its TOLERANCE, written into the
JSON record it saves):

  ddp_train.py       2 ranks: plain DDP, fp16 / bf16 compression hooks, PowerSGD   vs Gloo
  fsdp_train.py      2 ranks: FSDP1 and FSDP2, bf16 params + fp32 reduce, and fp32  vs Gloo
  deepspeed_zero.py  2 ranks: ZeRO stages 1, 2, 3 (overlap_comm, contiguous grads)  vs Gloo
  pipeline_p2p.py    3 ranks: 4 blocks in 3 stages, batch_isend_irecv, micro-batches
                     vs the whole model trained by one process (the "single" curve)
  dtensor_tp.py      2 ranks: ColwiseParallel/RowwiseParallel eager and under torch.compile
                     (aot_eager: see the test),
                     hand-written TP with functional collectives  vs one process

One job per example runs all its variants in one process group; the Gloo references are
separate runs of the same script (repeated if Gloo's teardown aborts a rank). With
CHORUS_TEST_BACKEND=gloo the "vs Gloo" comparisons compare Gloo with itself; the
single-process comparisons still hold.
"""
import json
import os
import sys

import pytest

from launch import REPO, backend_under_test, run_job, run_reference_job

EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, EXAMPLES)
import harness  # noqa: E402

TIMEOUT = 420


def _run(tmp, name, world, backend, args=(), reference=False, env=None):
    out = os.path.join(tmp, f"{name}-{backend}.json")
    run = run_reference_job if reference else run_job
    job = run(f"{name}-{backend}", os.path.join(EXAMPLES, f"{name}.py"), world,
              args=["--backend", backend, "--device", "cpu", "--out", out, *args],
              env={"CHORUS_TEST_BACKEND": backend, **(env or {})}, timeout=TIMEOUT,
              workdir=tmp)
    assert job.ok, job.describe()
    with open(out) as f:
        return json.load(f)


def _with_gloo_reference(tmp_path_factory, name, world, args=()):
    tmp = str(tmp_path_factory.mktemp(name))
    got = _run(tmp, name, world, backend_under_test(), args)
    ref = _run(tmp, name, world, "gloo", args, reference=True)
    return got, ref


def assert_matches(got, ref):
    problems = harness.compare(got, ref)
    assert not problems, "\n".join(problems)


def assert_trains(rec, variant):
    """The curve moved: a run that never updated its parameters would be flat."""
    curve = rec["losses"][variant]
    assert len(curve) == rec["steps"] and len(set(curve)) > 1, (variant, curve)


def assert_differs(rec, a, b):
    """Two variants that must not compute the same thing (e.g. a hook that was not applied)."""
    assert rec["losses"][a] != rec["losses"][b], f"{a} and {b} gave identical curves"


# ------------------------------------------------------------------ DDP
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return _with_gloo_reference(tmp_path_factory, "ddp_train", 2, ["--steps", "6"])


def test_ddp_with_and_without_comm_hooks_matches_gloo(ddp):
    got, ref = ddp
    assert sorted(got["losses"]) == ["bf16_hook", "fp16_hook", "plain", "powersgd"]
    assert_matches(got, ref)
    for v in got["losses"]:
        assert_trains(got, v)
    # Each hook changes the arithmetic: identical curves would mean it never ran.
    for hook in ("fp16_hook", "bf16_hook", "powersgd"):
        assert_differs(got, "plain", hook)


# ------------------------------------------------------------------ FSDP
@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _with_gloo_reference(tmp_path_factory, "fsdp_train", 2, ["--steps", "6"])


def test_fsdp1_and_fsdp2_mixed_precision_match_gloo(fsdp):
    got, ref = fsdp
    assert sorted(got["losses"]) == ["fsdp1_bf16", "fsdp1_fp32", "fsdp2_bf16", "fsdp2_fp32"]
    assert_matches(got, ref)
    for v in got["losses"]:
        assert_trains(got, v)
    assert_differs(got, "fsdp1_bf16", "fsdp1_fp32")  # bf16 parameters were in use
    assert_differs(got, "fsdp2_bf16", "fsdp2_fp32")


# ------------------------------------------------------------------ DeepSpeed
@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"deepspeed is not installed ({e}); `make test` installs it")
        pytest.skip(f"deepspeed is not installed ({e}); `make test` installs it")
    return _with_gloo_reference(tmp_path_factory, "deepspeed_zero", 2, ["--steps", "5"])


def test_deepspeed_zero_stages_match_gloo(zero):
    got, ref = zero
    assert sorted(got["losses"]) == ["zero1", "zero2", "zero3"]
    assert_matches(got, ref)
    for v in got["losses"]:
        assert_trains(got, v)


def test_deepspeed_zero_stages_agree_with_each_other(zero):
    got, _ = zero
    base = got["losses"]["zero1"]
    for v in ("zero2", "zero3"):
        for step, (a, b) in enumerate(zip(got["losses"][v], base)):
            assert abs(a - b) <= 1e-4 * abs(b), f"{v} step {step}: {a!r} vs zero1 {b!r}"


# ------------------------------------------------------------------ pipeline
def test_pipeline_p2p_three_stages_match_single_process(tmp_path):
    rec = _run(str(tmp_path), "pipeline_p2p", 3, backend_under_test(), ["--steps", "5"])
    # The reference curve "single" is the whole model trained by rank 0 alone.
    assert_matches({**rec, "losses": {"gpipe": rec["losses"]["gpipe"]}},
                   {**rec, "losses": {"gpipe": rec["losses"]["single"]}})
    assert_trains(rec, "gpipe")


# ------------------------------------------------------------------ DTensor / TP
def test_dtensor_tp_eager_compiled_and_funcol_match_single_process(tmp_path):
    # aot_eager: the same traced graphs, functional collectives included, without Inductor's
    # code generation, which alone would take most of this file's time budget on 2 cores.
    rec = _run(str(tmp_path), "dtensor_tp", 2, backend_under_test(), ["--steps", "4"],
               env={"CHORUS_EXAMPLE_COMPILE_BACKEND": "aot_eager"})
    single = {**rec, "losses": {"tp": rec["losses"]["single"], "funcol": rec["losses"]["single"]}}
    assert_matches({**rec, "losses": {v: rec["losses"][v] for v in ("tp", "funcol")}}, single)
    # tp_compiled is held to the eager TP curve with its own (looser) tolerance.
    assert_matches({**rec, "losses": {"tp_compiled": rec["losses"]["tp_compiled"]}}, rec)
    assert_trains(rec, "tp")


# ------------------------------------------------------------------ the comparison itself
def test_compare_reports_a_curve_outside_its_tolerance():
    ref = {"device": "cpu", "losses": {"a": [1.0, 0.5, 0.25]}}
    got = {"device": "cpu", "tolerance": {"a": {"rtol": 1e-3}}, "losses": {"a": [1.0, 0.5, 0.25]}}
    assert harness.compare(got, ref) == []
    got["losses"]["a"] = [1.0, 0.5006, 0.25]  # 1.2e-3 relative at step 1
    assert "step 1" in harness.compare(got, ref)[0]
    got["losses"]["a"] = [1.0, float("nan"), 0.25]
    assert "step 1" in harness.compare(got, ref)[0]
    got["losses"]["a"] = [1.0, 0.5]
    assert "2 steps" in harness.compare(got, ref)[0]
    got["losses"] = {"b": [1.0, 0.5, 0.25]}
    got["tolerance"] = {"b": {"rtol": 1e-3, "ref": "missing"}}
    assert "no curve" in harness.compare(got, ref)[0]
