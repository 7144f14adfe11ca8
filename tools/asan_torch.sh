#!/usr/bin/env bash
# tools/asan_torch.sh [PYTHON] - `make asan-torch`: builds Chorus (core and binding) with
# AddressSanitizer + UndefinedBehaviorSanitizer into build-asan-py/ (CHORUS_SANITIZE=1, apart
# from the normal build) and runs tools/asan_torch.py there: 4-rank PyTorch jobs (the
# correctness checks over shared memory and over sockets, and a soak), failing on any
# sanitizer report or wrong result. About 15 minutes on 2 cores (the build is half of it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BASE=build-asan-py
CHORUS_SANITIZE=1 "$PY" setup.py -q build --build-base "$BASE" >"$BASE.log" 2>&1 || {
  tail -50 "$BASE.log"; echo "asan_torch.sh: the sanitized build failed (log: $BASE.log)"; exit 1; }
LIB=$(ls -d "$BASE"/lib.*)
"$PY" tools/asan_torch.py "$LIB" --world 4 --soak "${ASAN_SOAK:-1000}"
