#!/usr/bin/env bash
# gpu_wheels.sh - fills .whl/ (git-ignored through .git/info/exclude) with the wheels that
# examples/deepspeed_zero.py needs on the GPU machine, whose image lacks DeepSpeed and a few
# of its requirements (Python 3.12 there). Run it here, then name .whl in the device call's
# carry; scripts/gpu_check.sh installs them with --no-index --no-deps when DeepSpeed is missing.
# DeepSpeed ships only a source archive: its wheel is built here, pure Python (no op built).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
PY=${PYTHON:-.venv/bin/python}
$PY -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==0.19.8"
# What that image lacks of DeepSpeed's Requires-Dist (it has einops, msgpack, ninja, psutil,
# py-cpuinfo, tqdm, numpy, packaging, typing-extensions).
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2
ls -la .whl
