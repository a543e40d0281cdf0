# The two commands a fresh machine needs:  make demo  and  make test.
# Both install first. PYTHON and TORCH_SPEC can be overridden, e.g. on a CUDA
# machine that already has its own torch:  make test TORCH_SPEC=
SHELL      := /bin/bash
PYTHON     ?= python3
PIP        := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR   ?= demo_out
# Two workers, one test file each at a time (module fixtures stay in one process): CI has 2 cores,
# and most tests are single-threaded Python. Files in collection order, which tests/conftest.py
# makes longest first (LONGEST_FIRST), not xdist's most-tests-first.
PYTEST_ARGS ?= --durations=15 -n 2 --dist loadfile --no-loadscope-reorder

WHEELS     ?=
GPU_CHECK_ARGS ?=
GPU_BENCH_ARGS ?=

.PHONY: install requirements demo test lint bench clean gpu-check gpu-bench gpu-bench-plans notorch-check typecheck

# The install runs again only when something native changed (the stamp is older than a
# source under csrc/, setup.py or pyproject.toml) or memo cannot be imported: the Python
# files are an editable install and need nothing. `make clean` forces a full install.
STAMP  := build/.memo-installed
NATIVE := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)

# Reinstall also when the memo Python imports is another checkout's (one environment, two clones).
# torch first: memo._C links libtorch, and "import memo" alone no longer loads torch (lazy __init__).
# One interpreter checks and prints (each start imports torch: seconds of every `make test`).
INSTALLED := cd / && $(PYTHON) -c "import os, torch, memo, memo._C, memo.planner as p; \
	assert all(os.path.realpath(m.__file__).startswith('$(CURDIR)/') for m in (memo, p)); \
	print('memo installed:', memo._C.build_info())"
install: $(STAMP)
	@($(INSTALLED)) 2>/dev/null || { rm -f $(STAMP); $(MAKE) --no-print-directory $(STAMP) && ($(INSTALLED)); }

# What memo needs and its tests use; pip runs only when one is missing (.ci/have_requirements.py).
REQUIREMENTS := "setuptools>=64" wheel ninja pybind11 numpy "pulp>=2.8,<4" tqdm matplotlib pytest \
	pytest-xdist hypothesis ruff "mypy>=1.10" "megatron-core==0.16.1" "transformers==5.23.0" "peft==0.21.2" \
	"accelerate==1.15.0"

requirements:
	@$(PYTHON) .ci/have_requirements.py $(if $(TORCH_SPEC),"$(TORCH_SPEC)") $(REQUIREMENTS) 2>/dev/null || { \
		if [ -n "$(TORCH_SPEC)" ]; then $(PIP) install -q "$(TORCH_SPEC)"; fi; \
		$(PIP) install -q $(REQUIREMENTS); }

$(STAMP): $(NATIVE) | requirements
	@mkdir -p build
	@echo "memo: building the extension (compiler progress below; full log in build/install.log)"
	@set -o pipefail; $(PIP) install -v --no-build-isolation --no-deps -e . 2>&1 | tee build/install.log \
		| { grep --line-buffered -E "^\s*\[[0-9]+/[0-9]+\]|memo setup|error:|Successfully installed" || true; } \
		| sed -u -E 's#^\s*(\[[0-9]+/[0-9]+\]) .* -c ([^ ]+) .*#  \1 compiling \2#'

	@touch $@

demo: install
	$(PYTHON) examples/demo.py --out $(DEMO_DIR)

# One intra-op thread per worker: two workers on two cores, each spinning a second thread at its
# barriers, run the suite ~15% slower (measured on 4 test files, 2026-11-28). Tests that time threads
# set their own.
# ruff and mypy read sources only: they run beside the install, whose build leaves a core idle half
# the time.
test:
	@$(MAKE) --no-print-directory -j2 install lint notorch-check
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q $(PYTEST_ARGS)

lint: requirements
	$(PYTHON) -m ruff check .
	@$(MAKE) --no-print-directory typecheck

# mypy --strict on the torch-free planner, as the package memo.planner, and on the memo modules it
# imports (issue 32); mypy.ini names them. mypy cannot follow memo's __path__ to planner/, so
# build/typecheck/memo/planner links to it (NOTE [Type-checking the planner as memo.planner] in
# mypy.ini). A few seconds once build/mypy_cache is warm; tests/project/test_typecheck.py runs the same.
typecheck:
	@$(PYTHON) -c "import mypy" 2>/dev/null || { echo "make typecheck: mypy is not installed; it is" \
		"a test dependency: make install, or $(PIP) install 'mypy>=1.10'"; exit 1; }
	@mkdir -p build/typecheck/memo && ln -sfn ../../../planner build/typecheck/memo/planner
	$(PYTHON) -m mypy --strict

# The planner is the lower, torch-free layer (issue 17): memo.planner must import and make plans
# with its native exact search where torch is not installed. Checked with `python -S` (no
# site-packages), importing this checkout and a folder of links to the planner's own requirements
# (setup.py's, less torch and matplotlib) from PYTHONPATH, with the memo/_planner_native*.so
# `install` built here: tests/notorch_check.py --make-site makes the folder (kept in
# build/notorch; made again when this Makefile or the check changes).
NOTORCH := build/notorch
$(NOTORCH)/.ready: Makefile tests/notorch_check.py | requirements
	@rm -rf $(NOTORCH)
	$(PYTHON) tests/notorch_check.py --make-site $(NOTORCH)/site
	@touch $@

notorch-check: install $(NOTORCH)/.ready
	@cd / && PYTHONPATH=$(CURDIR)/$(NOTORCH)/site:$(CURDIR) $(PYTHON) -S -s $(CURDIR)/tests/notorch_check.py || { \
		echo "make test: memo.planner fails without torch (above); it must stay torch-free: NOTE [A" \
			"torch-free planner module] in csrc/planner/module.cpp, check: tests/notorch_check.py"; exit 1; }

# Every GPU check in one go, on a machine with its own CUDA build of torch and no network:
#   make gpu-check WHEELS=dir   (dir holds PuLP, megatron-core, ... wheels; see README, "GPU checks")
# Stops at once, non-zero, where no CUDA device is present.
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py --preflight
	@if [ -n "$(WHEELS)" ]; then $(PIP) install -q --no-index --no-deps $(WHEELS)/*.whl; fi
	MEMO_BUILD_CUDA=1 $(PIP) install --no-build-isolation --no-deps -e .
	$(PYTHON) -c "import torch, memo, memo._C; print('memo installed:', memo._C.build_info())"
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# memo against its peers on one GPU (issues 27, 45), llama-3.2-1b in bf16, in stages that fit a short
# loan, within a time budget that starts when this target does (the build is inside it;
# benchmarks/gpu_bench.py, NOTE [Stages of a loan], NOTE [Time budget]):
#   make gpu-bench-plans                           (first, on any machine's CPU: see below)
#   make gpu-bench WHEELS=dir                      (GPU_BENCH_ARGS="--time-budget-s 400" for less time)
#   make gpu-bench GPU_BENCH_ARGS="--resume benchmarks/results/gpu_bench.records.jsonl"   (the next loan)
# Writes benchmarks/results/gpu_bench.md (to paste into benchmarks/RESULTS.md), gpu_bench.json and the
# records a later loan resumes from (gpu_bench.records.jsonl). Stops at once, non-zero, where no CUDA
# device is present; `python benchmarks/gpu_bench.py --dry-run` runs the same code on the CPU,
# `--dry-run --predict` prints the predicted device time. The build: the device's own architecture only
# (MEMO_CUDA_ARCHS from nvidia-smi, e.g. 90 on Hopper), parallel jobs (MAX_JOBS, setup.py), -g0, and an
# unchanged CUDA library is not rebuilt (setup.py). GPU_BENCH_START: make expands the recipe before its
# first line runs.
#
# gpu-bench-plans: what the loan need not spend device time on, made here on the CPU (~2 CPU minutes)
# into build/gpu_bench_plans, which then travels with the loan (the device tool's carry): memo's plans
# for the headline and wide rows, made on meta for GPU_BENCH_GPU (the kind lent, H200), and every row's
# predicted device memory (NOTE [Plans made ahead on meta], NOTE [Rows that cannot fit] in
# benchmarks/gpu_bench_prep.py). Their keys hold memo's sources: make them again after a change to memo.
GPU_BENCH_GPU ?= H200
gpu-bench-plans: install
	$(PYTHON) benchmarks/gpu_bench.py --make-plans --predict-gpu $(GPU_BENCH_GPU)
	$(PYTHON) benchmarks/gpu_bench.py --predict --predict-gpu $(GPU_BENCH_GPU)

GPU_ARCH = $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.')
gpu-bench:
	@$(PYTHON) benchmarks/gpu_bench.py --preflight
	$(eval GPU_BENCH_START := $(shell date +%s))
	@if [ -n "$(WHEELS)" ]; then $(PIP) install -q --no-index --no-deps $(WHEELS)/*.whl; fi
	MEMO_BUILD_CUDA=1 MEMO_CUDA_ARCHS="$${MEMO_CUDA_ARCHS:-$(or $(GPU_ARCH),80;90)}" \
		$(PIP) install --no-build-isolation --no-deps -e .
	$(PYTHON) -c "import torch, memo, memo._C; print('memo installed:', memo._C.build_info())"
	@echo "gpu-bench: build and install took $$(( $$(date +%s) - $(GPU_BENCH_START) )) s"
	$(PYTHON) benchmarks/gpu_bench.py --started-at $(GPU_BENCH_START) $(GPU_BENCH_ARGS)

bench: install
	$(PYTHON) benchmarks/head_memory.py

clean:
	rm -rf build *.egg-info memo/_C*.so memo/_planner_native*.so memo/_lib $(DEMO_DIR) $(STAMP)
