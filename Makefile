# Top-level targets. Each one works on a fresh clone: it creates .venv (sharing the system's
# site-packages), installs the pinned torch and the test tools only if missing, builds and
# installs Chorus only when its sources changed, then runs.
#   make demo    4-rank DDP training with chorus, then gloo; compares them
#   make test    C unit tests, then the whole pytest suite (installs matplotlib and DeepSpeed
#                if missing)
#   make ctest   C unit tests only
#   make fuzz    libFuzzer targets (tests/fuzz: wire headers, parameters, bootstrap), FUZZ_SECONDS
#                (60) each; needs clang
#   make asan / make tsan / make valgrind   C unit tests under ASan+UBSan, TSan, memcheck
#                (see tests/c/Makefile)
#   make asan-torch  Chorus built with ASan+UBSan (build-asan-py/), 4-rank PyTorch jobs on it
#                (tools/asan_torch.sh: checks over shm and sockets, a soak; ~15 min)
#   make clean   build outputs (keeps .venv); make distclean also removes .venv
# CHORUS_TEST_BACKEND=gloo make test runs the suite against gloo (validates the harness).

PYTHON3 ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION := 2.13.0
export MAX_JOBS ?= 2

BUILD_STAMP := $(VENV)/.chorus-build.stamp
PREBUILD_PARTS := prebuild-c prebuild-asan prebuild-fuzz prebuild-fpsw prebuild-cuda
FUZZ_TARGETS := $(notdir $(basename $(wildcard tests/fuzz/fuzz_*.c)))
DEPS_STAMP := $(VENV)/.chorus-deps.stamp
# Tools only the tests need (matplotlib: tests/test_bench.py checks `chorus.bench --plot`);
# its own stamp, so that adding one does not rebuild Chorus.
TEST_DEPS_STAMP := $(VENV)/.chorus-test-deps.stamp
# Whatever the installed package is built from: a change to any of these rebuilds it.
BUILD_INPUTS := $(shell find csrc python -type f \( -name '*.c' -o -name '*.h' -o -name '*.cpp' \
                  -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \) 2>/dev/null) \
                $(wildcard setup.py pyproject.toml setup.cfg MANIFEST.in)

.PHONY: all demo test ctest fuzz asan tsan valgrind asan-torch pytest deps base-deps build clean \
        distclean readme-params prebuild $(PREBUILD_PARTS) fuzz-asan asan-run $(addprefix fuzz-run-,$(FUZZ_TARGETS))

all: build

$(PY):
	$(PYTHON3) -m venv --system-site-packages $(VENV)

# torch pinned: an unpinned install could pull a different (CUDA, multi-GB) build.
$(DEPS_STAMP): $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==$(TORCH_VERSION)"
	$(PY) -c "import pytest" 2>/dev/null || $(PIP) install pytest
	$(PY) -c "import numpy" 2>/dev/null || $(PIP) install numpy
	$(PY) -c "import setuptools, wheel" 2>/dev/null || $(PIP) install setuptools wheel
	$(PY) -c "import ninja" 2>/dev/null || $(PIP) install "ninja==1.13.2"
	touch $@

# matplotlib only if missing. It does not depend on torch, so this never installs a torch:
# the pinned one above stays the only torch install step.
# DeepSpeed (tests/test_examples.py runs examples/deepspeed_zero.py): pinned, --no-deps, so
# that it cannot pull another torch; its pure-Python requirements (its Requires-Dist, less
# torch) pinned one by one, each only if missing (all the missing ones in one pip call, also
# --no-deps). No DeepSpeed op is compiled (DS_BUILD_OPS unset): the example uses torch's Adam.
DS_DEPS := hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 einops==0.8.2 psutil==7.2.2 tqdm==4.70.1 \
           py-cpuinfo==9.0.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
           typing-inspection==0.4.2 typing-extensions==4.15.0 packaging==26.2
$(TEST_DEPS_STAMP): $(DEPS_STAMP) Makefile
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install matplotlib
	missing=; for spec in $(DS_DEPS); do \
	  mod=$$(echo $${spec%%==*} | tr - _ | sed 's/^py_cpuinfo$$/cpuinfo/'); \
	  $(PY) -c "import $$mod" 2>/dev/null || missing="$$missing $$spec"; \
	done; \
	if [ -n "$$missing" ]; then $(PIP) install --no-deps $$missing || exit 1; fi
	$(PY) -c "import deepspeed" 2>/dev/null || \
	  $(PIP) install --no-deps --no-build-isolation "deepspeed==0.19.8"
	touch $@

deps: $(DEPS_STAMP) $(TEST_DEPS_STAMP)
# .venv with torch, pytest, numpy, setuptools (what `make build` needs)
base-deps: $(DEPS_STAMP)

# --no-build-isolation: build against the torch in .venv (an isolated build would fetch
# another torch and break the ABI).
# .venv/bin on PATH: torch's BuildExtension compiles the binding's C++ files in parallel
# (MAX_JOBS) when it finds ninja there, one after the other without it.
$(BUILD_STAMP): $(DEPS_STAMP) $(BUILD_INPUTS)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PIP) install --no-build-isolation .
	touch $@

build: $(BUILD_STAMP)

demo: $(BUILD_STAMP)
	$(PY) examples/ddp_demo.py

ctest:
	$(MAKE) -C tests/c

FUZZ_SECONDS ?= 60
fuzz:
	$(MAKE) -C tests/fuzz fuzz FUZZ_SECONDS=$(FUZZ_SECONDS)

# For .ci/run. prebuild: what the checks after `make build` compile, built ahead (CI runs it,
# niced, beside the package build and the test tools' download): the C unit tests,
# their asan build, the fuzz targets, tools/fp_cost.sh's bench_comm build
# (tests/test_fingerprint_cost.py) and, where nvcc exists, the CUDA compile check
# (tests/test_cuda.py). Each later step finds its make targets up to date. The parts build
# into separate directories, so `make -j2 prebuild` runs them side by side.
prebuild: $(PREBUILD_PARTS)
prebuild-c:
	$(MAKE) -C tests/c build
prebuild-asan:
	$(MAKE) -C tests/c asan-build
prebuild-fuzz:
	$(MAKE) -C tests/fuzz build
prebuild-fpsw:
	$(MAKE) -s -C tests/c BUILD=$(CURDIR)/tests/c/build-fpsw EXTRA_CFLAGS=-DCHORUS_FP_SWITCH bench_comm
prebuild-cuda:
	if command -v nvcc >/dev/null 2>&1; then $(MAKE) -C tests/cuda compile; fi

# fuzz-asan: every fuzz target for FUZZ_SECONDS (each one single-threaded process) and
# `make asan`, CI_JOBS (2) at a time in this order: on 2 cores two fuzzers side by side, then
# the next one beside asan.
CI_JOBS ?= 2
fuzz-asan:
	$(MAKE) -C tests/fuzz -j$(MAX_JOBS) build
	$(MAKE) -C tests/c asan-build
	$(MAKE) -j$(CI_JOBS) --output-sync=target $(addprefix fuzz-run-,$(FUZZ_TARGETS)) asan-run
# (a static pattern rule: make looks for no implicit rule for a phony target)
$(addprefix fuzz-run-,$(FUZZ_TARGETS)): fuzz-run-%:
	$(MAKE) -C tests/fuzz run-$* FUZZ_SECONDS=$(FUZZ_SECONDS)
asan-run:
	$(MAKE) -C tests/c asan
asan tsan valgrind:
	$(MAKE) -C tests/c $@
asan-torch: $(DEPS_STAMP)
	bash tools/asan_torch.sh $(PY)

pytest: $(BUILD_STAMP) $(TEST_DEPS_STAMP)
	$(PY) -m pytest -q --durations=40 tests

# The C unit tests run first; pytest's tests/test_c_units.py (which runs them too, for a plain
# `pytest tests`) is told that they passed just before (CHORUS_C_UNITS_PASSED) and skips.
test: $(BUILD_STAMP) $(TEST_DEPS_STAMP)
	$(MAKE) -C tests/c
	CHORUS_C_UNITS_PASSED=1 $(PY) -m pytest -q --durations=40 tests

# Rewrites the README parameter table from `python -m chorus.params --markdown`.
readme-params: $(BUILD_STAMP)
	$(PY) tests/readme_params.py --update

clean:
	rm -rf build dist *.egg-info python/*.egg-info .pytest_cache $(BUILD_STAMP) build-asan-py build-asan-py.log
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +
	-$(MAKE) -C tests/c clean
	-$(MAKE) -C tests/fuzz clean
	-$(MAKE) -C tests/fakeverbs clean

distclean: clean
	rm -rf $(VENV)
