#!/usr/bin/env bash
# gpu_check.sh - one device call: builds Chorus from source with CUDA, runs the GPU tests
# (kernels, every collective with 2-4 ranks sharing the GPU, stream semantics) and the GPU
# benchmark (4 ranks on one GPU; 1 rank against NCCL, which refuses two ranks per GPU) and
# the examples (examples/*.py on CUDA against NCCL on 2+ GPUs, else against Gloo on the CPU).
# Logs go to $OUT when it is set (the device tool), else to ./gpu-check-logs.
#   usage: bash scripts/gpu_check.sh [tests|bench|examples|perf|hang|all]   (default all)
# DeepSpeed is not in the GPU image: scripts/gpu_wheels.sh fills .whl/ here; carry .whl.
#   PYTEST_K (a pytest -k expression) narrows the tests; BENCH_OPS the benchmarked ops;
#   EXAMPLES the examples run (names without .py);
#   SKIP_BUILD=1 uses the build a previous step of the same call installed.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
LOG=${OUT:-$PWD/gpu-check-logs}
mkdir -p "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}
status=0

if [ -n "${SKIP_BUILD:-}" ]; then echo "== build skipped (SKIP_BUILD)"; else
echo "== build" | tee "$LOG/build.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$LOG/build.log" 2>&1
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
  >>"$LOG/build.log" 2>&1
if ! FORCE_CUDA=1 $PY -m pip install -q --no-build-isolation --no-deps . >>"$LOG/build.log" 2>&1; then
  echo "build FAILED"; tail -60 "$LOG/build.log"; exit 1
fi
$PY -c 'import chorus, chorus._C as c; print("chorus", chorus.__version__, "cuda built:", c.cuda_built())' \
  2>&1 | tee -a "$LOG/build.log"
fi

if [ "$what" = all ] || [ "$what" = tests ]; then
  echo "== tests"
  rm -rf "$LOG/jobs"; mkdir -p "$LOG/jobs"
  (cd tests && CHORUS_TEST_LOGS="$LOG/jobs" $PY -m pytest -q test_cuda.py test_build.py -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1) | tee "$LOG/tests.log" \
    | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "$what" = perf ]; then
  # Variants of the latency (2 ranks) and bandwidth (4 ranks) workers side by side, one line
  # per measurement in perf.log (PERF_VARIANTS: space-separated env settings, ',' between
  # variables of one variant).
  echo "== perf"
  for v in ${PERF_VARIANTS:-default}; do
    envs=$(echo "$v" | tr ',' ' '); [ "$v" = default ] && envs=""
    for job in "2 hostfree" "2 latency --loop 2000" "4 bandwidth"; do
      set -- $job ""
      echo "-- $v: $*" >>"$LOG/perf.log"
      env CHORUS_DEBUG=INFO CHORUS_DEBUG_SUBSYS=COLL $envs timeout 120 $PY -m torch.distributed.run \
        --nproc-per-node $1 --master-port 29533 tests/workers/cuda_perf.py $2 $3 $4 2>&1 \
        | grep -E "RESULT|Error|error|Traceback|cuda: [0-9]+ collectives" \
        | sed "s/^/$v $1 /" >>"$LOG/perf.log"
    done
  done
  cat "$LOG/perf.log"
fi

if [ "$what" = hang ]; then
  # A job that may hang: 2 ranks of tests/workers/cuda_perf.py hostfree (a synchronous
  # all_reduce behind a long kernel). If the ranks still run after HANG_WAIT seconds, every
  # thread's stack of each rank: Python's (faulthandler, SIGUSR1) and native ones
  # (cuda-gdb, the image's only debugger), into $LOG/stacks.txt.
  echo "== hang"
  CHORUS_DEBUG=INFO CHORUS_DEBUG_SUBSYS=ALL $PY -m torch.distributed.run \
    --nproc-per-node 2 --master-port 29545 tests/workers/cuda_perf.py hostfree \
    >"$LOG/hang.log" 2>&1 &
  launcher=$!
  for _ in $(seq "${HANG_WAIT:-30}"); do kill -0 $launcher 2>/dev/null || break; sleep 1; done
  if kill -0 $launcher 2>/dev/null; then
    for pid in $(pgrep -f "cuda_perf.py hostfree" | grep -vx "$launcher"); do
      kill -USR1 "$pid"; sleep 1
      echo "==== pid $pid" >>"$LOG/stacks.txt"
      timeout 120 cuda-gdb -q -p "$pid" -batch -ex "thread apply all bt" >>"$LOG/stacks.txt" 2>&1
    done
    kill $launcher; sleep 2; pkill -9 -f "cuda_perf.py hostfree"; status=1
    echo "hung: stacks in stacks.txt"
  fi
  grep -E "RESULT|Error" "$LOG/hang.log" | tail -5
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  echo "== bench"
  for op in ${BENCH_OPS:-all_reduce all_gather reduce_scatter broadcast alltoall}; do
    $PY -m chorus.bench --device cuda --nproc 4 -o $op -b 8 -e 256M -f 4 -n 20 -w 5 \
      --json "$LOG/bench4_$op.json" >>"$LOG/bench.log" 2>&1 || status=1
    $PY -m chorus.bench --device cuda --nproc 1 --compare nccl -o $op -b 8 -e 256M -f 4 -n 20 \
      -w 5 --json "$LOG/bench1_$op.json" >>"$LOG/bench.log" 2>&1 || status=1
  done
  tail -40 "$LOG/bench.log"
fi
if [ "$what" = all ] || [ "$what" = examples ]; then
  echo "== examples"
  if ! $PY -c "import deepspeed" 2>/dev/null && ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile .whl/*.whl >>"$LOG/examples.log" 2>&1
  fi
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  # The reference: NCCL with one rank per GPU where two GPUs exist, else Gloo on the CPU.
  if [ "$ngpu" -ge 2 ]; then ref="--compare nccl --ref-device cuda"; else ref="--compare gloo --ref-device cpu"; fi
  for ex in ${EXAMPLES:-ddp_train fsdp_train pipeline_p2p dtensor_tp deepspeed_zero}; do
    n=2
    if [ $ex = pipeline_p2p ]; then n=3; [ "$ngpu" -ge 2 ] && n=$(( ngpu < 3 ? ngpu : 3 )); fi
    if [ $ex = deepspeed_zero ] && ! $PY -c "import deepspeed" 2>/dev/null; then
      echo "deepspeed_zero: NOT RUN (deepspeed missing; run scripts/gpu_wheels.sh and carry .whl)"
      status=1; continue
    fi
    if $PY examples/$ex.py --nproc $n --device cuda $ref --out "$LOG/ex_$ex.json" \
        >"$LOG/ex_$ex.log" 2>&1; then
      grep -E "match|MISMATCH" "$LOG/ex_$ex.log" | tail -3
    else
      echo "$ex: FAILED"; grep -E "MISMATCH|Error|error" "$LOG/ex_$ex.log" | tail -8; status=1
    fi
  done
fi
exit $status
