"""The CUDA path. On a machine without CUDA only the compile check runs (every .cu file and the
CUDA build of cuda.c compile for sm_90, so a CUDA build break fails CI); the GPU tests skip,
saying why. On a GPU (scripts/gpu_check.sh) several ranks share one GPU: every collective and
point-to-point op x dtypes x sizes over CUDA IPC and staged through host memory (also over
sockets), the stream semantics, mixed CPU/CUDA use, and the kernels against the CPU ones.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from launch import REPO, WORKERS, backend_under_test, run_job

HAVE_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU (scripts/gpu_check.sh "
                               "runs these on one)")


def test_cuda_sources_compile():
    """nvcc compiles every kernel and test .cu file, and gcc the CUDA build of the core's
    cuda.c (-Werror). Required in CI; elsewhere only where nvcc exists."""
    if not shutil.which("nvcc"):
        if os.environ.get("CI") == "true":
            pytest.fail("nvcc is not installed on the CI machine: CUDA sources cannot be checked")
        pytest.skip("nvcc not installed here")
    r = subprocess.run(["make", "-C", os.path.join(REPO, "tests", "cuda"), "compile"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


@needs_gpu
def test_cuda_kernels_match_cpu():
    r = subprocess.run(["make", "-C", os.path.join(REPO, "tests", "cuda"), "run"],
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    m = re.search(r"test_kernels: (\d+) cases passed, (\d+) failed", out)
    assert m and int(m.group(1)) > 0 and m.group(2) == "0", out[-3000:]


# (world, mode, quick): mode ipc runs on the shared GPU (rank 0 runs each collective on every
# rank's buffers; what it cannot run goes over the IPC scratch), scratch maps peers' scratch
# areas (the path between different GPUs of one host), staged goes through host memory and
# the host algorithms, socket stages over TCP (the path between hosts).
CASES = [(2, "ipc", False), (3, "ipc", True), (4, "ipc", False), (2, "scratch", True),
         (4, "scratch", False), (2, "staged", True), (4, "staged", True), (3, "socket", True)]


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus CUDA path only")
@pytest.mark.parametrize("world,mode,quick", CASES)
def test_cuda_collectives_on_one_gpu(tmp_path, world, mode, quick):
    env = {"CHORUS_DEBUG": "INFO", "CHORUS_DEBUG_SUBSYS": "TRANSPORT"}
    # 1 MiB of scratch: big messages take several chunks over IPC, and the staged paths
    # stage what does not fit in their 1 MiB pinned buffer through pageable memory.
    env["CHORUS_CUDA_SCRATCH"] = "1M"
    label = f"cuda-{mode}-{world}"
    if mode == "ipc":
        env["CHORUS_TEST_HOST_FREE"] = "1"
    elif mode == "scratch":
        env["CHORUS_CUDA_SAME_GPU"] = "0"
    elif mode == "staged":
        env["CHORUS_CUDA_IPC"] = "0"
    elif mode == "socket":
        env["CHORUS_SHM_DISABLE"] = "1"
    workdir = kept_dir(tmp_path, label)
    env["CHORUS_DEBUG_FILE"] = os.path.join(workdir, "core.%p.log")
    res = run_job(label, os.path.join(WORKERS, "cuda_checks.py"), world,
                  args=["--quick"] if quick else [], env=env, timeout=420, workdir=workdir)
    assert res.ok, res.describe()
    for r in res.ranks:
        m = re.search(r"CHECKS (\d+) passed (\d+) failed", r.output)
        assert m and int(m.group(1)) > 100 and m.group(2) == "0", r.output[-3000:]
    logs = "".join(open(os.path.join(workdir, f)).read() for f in os.listdir(workdir)
                   if f.startswith("core."))
    if mode == "ipc":
        # no scratch: what rank 0 does not run is staged
        assert len(re.findall(rf"all {world} ranks on one GPU", logs)) == world, logs[-3000:]
        assert "through CUDA IPC (" not in logs, logs[-3000:]
    elif mode == "scratch":
        assert len(re.findall(rf"maps {world - 1} peers through CUDA IPC \(", logs)) == world, \
            logs[-3000:]
        assert "same GPU" in logs, logs[-2000:]
        assert "ranks on one GPU" not in logs, logs[-3000:]
    else:
        assert "staged through host memory" in logs, logs[-3000:]


def kept_dir(tmp_path, name):
    """Where a GPU job keeps its logs: CHORUS_TEST_LOGS/name when that is set (by
    scripts/gpu_check.sh, so the logs come back from the device), else tmp_path."""
    keep = os.environ.get("CHORUS_TEST_LOGS")
    d = os.path.join(keep, name) if keep else str(tmp_path)
    os.makedirs(d, exist_ok=True)
    return d


def results_of(res, path):
    """The RESULT lines of rank 0 (tests/workers/cuda_perf.py), also written to path."""
    import json
    rows = [json.loads(line[7:]) for line in res.ranks[0].output.splitlines()
            if line.startswith("RESULT ")]
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


@needs_gpu
def test_cuda_reduce_kernel_bandwidth():
    """sum of two bf16 and of two fp32 buffers of 1 GiB into a third reaches at least 85% of
    the device-to-device copy bandwidth measured in the same run (bytes read + written)."""
    r = subprocess.run(["make", "-C", os.path.join(REPO, "tests", "cuda"), "bench",
                        "BENCH_ARGS=--size 1073741824 --min 0.85 --all"],
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    keep = os.environ.get("CHORUS_TEST_LOGS")
    if keep:
        with open(os.path.join(keep, "bench_kernels.log"), "w") as f:
            f.write(out)
    ratios = dict(re.findall(r"sum (\w+) +[\d.]+ GB/s \(2 reads \+ 1 write\) = ([\d.]+) of copy",
                             out))
    assert "bfloat16" in ratios and "float32" in ratios, out[-3000:]
    assert float(ratios["bfloat16"]) >= 0.85 and float(ratios["float32"]) >= 0.85, out
    assert r.returncode == 0, out[-3000:]


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus CUDA path only")
def test_cuda_allreduce_latency_two_ranks_one_gpu(tmp_path):
    """2 ranks on one GPU, float32 all_reduce of 8 B to 64 KiB: at most 100 us per op over
    1000 back-to-back ops timed with CUDA events; a loop of 10,000 ops does not stall."""
    d = kept_dir(tmp_path, "cuda-latency-2")
    res = run_job("cuda-latency-2", os.path.join(WORKERS, "cuda_perf.py"), 2,
                  args=["latency"], timeout=300, workdir=d)
    assert res.ok, res.describe()
    rows = results_of(res, os.path.join(d, "results.jsonl"))
    lat = [r for r in rows if r["test"] == "latency"]
    assert [r["bytes"] for r in lat] == [8, 64, 512, 4096, 32768, 65536], rows
    slow = [r for r in lat if not r["correct"] or r["us_per_op"] > 100]
    assert not slow, slow
    loop = [r for r in rows if r["test"] == "loop"]
    # No stall: the 10,000 ops, each behind a small copy on the caller's stream (so each
    # also waits for the GPU to switch to that rank's context), average under 1 ms: no op
    # can have waited for anything like a timeout.
    assert loop and loop[0]["correct"] and loop[0]["us_per_op"] <= 1000, loop


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus CUDA path only")
def test_cuda_host_not_blocked(tmp_path):
    """2 ranks on one GPU: an all_reduce issued behind ~100 ms of GPU work returns to Python
    before that work ends (under 50 ms), as its first device collective and later, and the
    result is right (default settings: the shared-GPU path)."""
    d = kept_dir(tmp_path, "cuda-hostfree-2")
    res = run_job("cuda-hostfree-2", os.path.join(WORKERS, "cuda_perf.py"), 2,
                  args=["hostfree"], timeout=90, workdir=d)
    assert res.ok, res.describe()
    rows = [r for r in results_of(res, os.path.join(d, "results.jsonl"))
            if r["test"] == "hostfree"]
    assert [r["which"] for r in rows] == ["first", "later"], rows
    bad = [r for r in rows if not r["correct"] or r["host_ms"] > 50]
    assert not bad, bad


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus CUDA path only")
def test_cuda_allreduce_bandwidth_four_ranks_one_gpu(tmp_path):
    """4 ranks on one GPU, all_reduce of 64 MiB to 1 GiB: the HBM traffic the path moves
    (2 N x bytes on the shared-GPU path, see tests/workers/cuda_perf.py) per second, timed as
    nccl-tests times (ops issued back to back, a host timer), is at least 60% of the
    device-to-device copy bandwidth measured in the same job. The loop of synchronous calls
    is reported beside it (each call then pays the ranks' host round trips) and must reach
    half of that bar."""
    d = kept_dir(tmp_path, "cuda-bandwidth-4")
    res = run_job("cuda-bandwidth-4", os.path.join(WORKERS, "cuda_perf.py"), 4,
                  args=["bandwidth"], timeout=420, workdir=d)
    assert res.ok, res.describe()
    rows = results_of(res, os.path.join(d, "results.jsonl"))
    bw = [r for r in rows if r["test"] == "allreduce_bw"]
    assert [r["bytes"] >> 20 for r in bw] == [64, 128, 256, 512, 1024], rows
    low = [r for r in bw if not r["correct"] or r["of_copy"] < 0.60 or r["sync_of_copy"] < 0.30]
    assert not low, low


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus CUDA path only")
def test_cuda_ddp_and_fsdp2_match_cpu_training(tmp_path):
    """DDP and FSDP2 with 4 ranks sharing one GPU match one CPU process training on all ranks'
    batches within the tolerance of the CPU tests (tests/test_ddp_fsdp.py)."""
    import numpy as np
    from launch import base_env
    from test_ddp_fsdp import RTOL
    d = kept_dir(tmp_path, "cuda-train-4")
    train = os.path.join(WORKERS, "train.py")
    res = run_job("cuda-train-4", train, 4, args=["both", os.path.join(d, "chorus")],
                  env={"CHORUS_TRAIN_DEVICE": "cuda"}, timeout=300, workdir=d)
    assert res.ok, res.describe()
    single = subprocess.run([sys.executable, train, "single", os.path.join(d, "single.pt"), "4"],
                            env=base_env(1, 0), capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stdout + single.stderr
    ref = torch.load(os.path.join(d, "single.pt"))
    for mode in ("ddp", "fsdp"):
        got = torch.load(os.path.join(d, f"chorus-{mode}.pt"))
        a, b = np.array(got["losses"]), np.array(ref["losses"])
        rel = float((np.abs(a - b) / np.abs(b)).max())
        assert rel <= RTOL, f"{mode}: losses differ by {rel:.3g} relative"
        for name in ref["params"]:
            x, y = got["params"][name].double(), ref["params"][name].double()
            err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
            assert err <= RTOL, f"{mode}: parameter {name} differs by {err:.3g}"


# ------------------------------------------------------------------ reliability on CUDA
# The CPU bars of tests/test_peer_failure.py and tests/test_mismatch.py with CUDA tensors, all
# four ranks on the one GPU (the shared-GPU path over shared memory; staged over sockets).
@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
@pytest.mark.parametrize("mode,transport", [("kill", "shm"), ("silent", "shm"),
                                            ("kill", "socket")])
def test_cuda_survivors_raise_naming_the_failed_rank(tmp_path, mode, transport):
    from test_peer_failure import check_peer_failure
    check_peer_failure(tmp_path, mode, transport, device="cuda")


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
@pytest.mark.parametrize("transport", ["shm", "socket"])
def test_cuda_mismatch_raises_on_every_rank(tmp_path, transport):
    from test_mismatch import check_mismatch
    check_mismatch(transport, tmp_path, device="cuda")


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's profiler events")
def test_cuda_profile_shows_chorus_all_reduce_and_its_kernels(tmp_path):
    # DDP on CUDA, 2 ranks on the GPU, CPU + CUDA activities: each rank's trace holds the
    # chorus:all_reduce events with the bucket's size and dtype (as on CPU); the GPU timeline
    # holds chorus:all_reduce ranges and chorus's kernels (rank 0 runs them for both ranks on
    # the shared GPU).
    from test_profiler import check_profile
    traces = check_profile(tmp_path, device="cuda")
    on_gpu = [e for t in traces for e in t["traceEvents"]
              if e.get("cat") == "gpu_user_annotation" and e.get("name") == "chorus:all_reduce"]
    assert on_gpu, "no chorus:all_reduce range on the GPU timeline"
    kernels = [e for t in traces for e in t["traceEvents"]
               if e.get("cat") == "kernel" and "chorus::" in str(e.get("name"))]
    assert kernels, sorted({str(e.get("name"))[:80] for t in traces for e in t["traceEvents"]
                            if e.get("cat") == "kernel"})
    assert all(e.get("dur", 0) > 0 for e in kernels), kernels[:3]


@needs_gpu
@pytest.mark.skipif(backend_under_test() != "chorus", reason="chorus's own messages")
def test_cuda_bad_arguments_raise_clear_errors():
    # Every bad-argument case of tests/test_bad_args.py with CUDA tensors (2 ranks on the one
    # GPU), plus the calls whose tensors sit on two devices.
    from test_bad_args import check_bad_args
    check_bad_args(2, device="cuda")
