# The two commands a fresh machine needs:  make demo  and  make test.
# Both install first. PYTHON and TORCH_SPEC can be overridden, e.g. on a CUDA
# machine that already has its own torch:  make test TORCH_SPEC=
PYTHON     ?= python3
PIP        := $(PYTHON) -m pip
TORCH_SPEC ?= torch==2.13.0
DEMO_DIR   ?= demo_out
PYTEST_ARGS ?=

WHEELS     ?=
GPU_CHECK_ARGS ?=

.PHONY: install demo test lint bench clean gpu-check

install:
	@if [ -n "$(TORCH_SPEC)" ]; then $(PIP) install -q "$(TORCH_SPEC)"; fi
	$(PIP) install -q "setuptools>=64" wheel ninja pybind11 numpy "pulp>=2.8,<4" tqdm matplotlib \
		pytest hypothesis ruff "megatron-core==0.16.1"
	$(PIP) install -q --no-build-isolation --no-deps -e .
	$(PYTHON) -c "import memo, memo._C; print('memo installed:', memo._C.build_info())"

demo: install
	$(PYTHON) examples/demo.py --out $(DEMO_DIR)

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# Every GPU check in one go, on a machine with its own CUDA build of torch and no network:
#   make gpu-check WHEELS=dir   (dir holds PuLP, megatron-core, ... wheels; see README, "GPU checks")
# Stops at once, non-zero, where no CUDA device is present.
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py --preflight
	@if [ -n "$(WHEELS)" ]; then $(PIP) install -q --no-index --no-deps $(WHEELS)/*.whl; fi
	MEMO_BUILD_CUDA=1 $(PIP) install --no-build-isolation --no-deps -e .
	$(PYTHON) -c "import memo, memo._C; print('memo installed:', memo._C.build_info())"
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

bench: install
	$(PYTHON) benchmarks/head_memory.py

clean:
	rm -rf build *.egg-info memo/_C*.so memo/_lib $(DEMO_DIR)
