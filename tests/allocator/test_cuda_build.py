"""The CUDA backend library compiles, links and exports its C API (needs nvcc, not a GPU).

Also drives the parts of the C API that touch no device (plan tables, phases,
stats) through ctypes. (memo_malloc throws a C++ exception on failure, for
libtorch to translate; ctypes cannot catch that, so it is exercised only by
the GPU tests.)
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import os
import re
import shutil
import subprocess

import pytest
import torch

import memo.allocator as ma
import memo.allocator._backends as backends
from memo import _C
from memo.errors import MemoError
from tests.allocator.test_allocator_core import CORE_TABLE_ERRORS
from tests.allocator.test_allocator_stat_names import _flat_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")
NM = shutil.which("nm")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA backend is not built")

# The allocator's C API (csrc/core/allocator_api.h) and the two functions CUDAPluggableAllocator loads.
EXPORTS = (
    "memo_malloc", "memo_free", "memo_alloc_last_error", "memo_alloc_runtime_version", "memo_alloc_device",
    "memo_alloc_create", "memo_alloc_destroy", "memo_alloc_check_plan", "memo_alloc_load_plan",
    "memo_alloc_unload_plan", "memo_alloc_has_plan", "memo_alloc_set_phase", "memo_alloc_suspend_phase",
    "memo_alloc_resume_phase", "memo_alloc_malloc", "memo_alloc_free", "memo_alloc_owns",
    "memo_alloc_arena_extent", "memo_alloc_set_poison", "memo_alloc_set_fallback_limit",
    "memo_alloc_set_min_segment", "memo_alloc_empty_cache", "memo_alloc_stat_count", "memo_alloc_stat_name",
    "memo_alloc_stats", "memo_alloc_reset_stats", "memo_alloc_deviation", "memo_alloc_start_logging",
    "memo_alloc_stop_logging", "memo_alloc_read_log", "memo_alloc_log_phase_count",
    "memo_alloc_log_phase_name",
)
MEMO_BACKEND_CUDA = 1


def core_sources() -> list[str]:
    """What setup.py archives as the core: csrc/core/*.cpp but the planner's dsa_*.cpp."""
    return sorted(p for p in glob.glob(os.path.join(ROOT, "csrc", "core", "*.cpp"))
                  if not os.path.basename(p).startswith("dsa_"))


def test_no_source_includes_another_cpp() -> None:
    """NOTE [The core is built once] (setup.py): the core is linked, never #include'd as a .cpp/.cu."""
    offenders = []
    for path in glob.glob(os.path.join(ROOT, "csrc", "**", "*.*"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if re.match(r'\s*#\s*include\s*["<][^">]*\.(cpp|cc|cu)[">]', line):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders
    assert "planned_allocator.cpp" in {os.path.basename(p) for p in core_sources()}


def header_functions() -> set[str]:
    """The functions csrc/core/allocator_api.h declares (each marked MEMO_API)."""
    with open(os.path.join(ROOT, "csrc", "core", "allocator_api.h"), encoding="utf-8") as f:
        return set(re.findall(r"^MEMO_API [^(]*?\b(memo_alloc_\w+)\(", f.read(), re.MULTILINE))


def exported(path: str) -> set[str]:
    cmd = [NM or "nm", "-D", "--defined-only", path]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def fresh_library(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Compile the current sources (one architecture, to keep it quick) with setup.py's flags; the core's
    sources go in as their own translation units, as setup.py's core archive does."""
    build = tmp_path_factory.mktemp("cuda")
    out = str(build / "libmemo_cuda.so")
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))) + core_sources()
    flags = [NVCC, "-O2", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
             f"-I{os.path.join(ROOT, 'csrc')}", "-gencode", "arch=compute_90,code=sm_90"]
    # One translation unit per nvcc, on every core (nvcc compiles the files of one command one after
    # another), then one link: what `nvcc -shared ... *sources` does in a single command.
    objects = [str(build / f"{i}-{os.path.basename(src)}.o") for i, src in enumerate(sources)]

    def compile_one(i: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*flags, "-c", sources[i], "-o", objects[i]], capture_output=True, text=True)

    workers = max(1, min(len(sources), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as p:
        compiled = list(p.map(compile_one, range(len(sources))))
    linked = subprocess.run([NVCC, "-shared", "-cudart", "shared", "-gencode", "arch=compute_90,code=sm_90",
                             *objects, "-o", out], capture_output=True, text=True)
    for result in [*compiled, linked]:
        assert result.returncode == 0, result.stderr
        assert "warning" not in result.stderr.lower(), result.stderr
    return out


def test_installed_library_exists_and_exports() -> None:
    path = ma.cuda_library_path()
    if torch.version.cuda is None and not os.path.exists(path):
        # setup.py builds the library for a CUDA torch or with MEMO_BUILD_CUDA=1; the fresh build
        # below is the link check a CPU-only machine keeps.
        pytest.skip("CPU-only torch: the CUDA library is built only with MEMO_BUILD_CUDA=1")
    assert os.path.exists(path), f"{path} missing: run `python setup.py build_ext --inplace`"
    assert set(EXPORTS) <= exported(path)


def test_the_library_exports_the_whole_c_api(fresh_library: str) -> None:
    """NOTE [One allocator C API]: every function csrc/core/allocator_api.h declares is in the library."""
    assert header_functions() <= exported(fresh_library)
    assert set(EXPORTS) == header_functions() | {"memo_malloc", "memo_free"}


def test_current_sources_compile_and_link(fresh_library: str) -> None:
    names = exported(fresh_library)
    assert set(EXPORTS) <= names
    # The core is compiled in, but only the C API is exported with C linkage.
    assert not any(n.startswith("memo_") and n not in EXPORTS for n in names)


def test_c_api_without_a_device(fresh_library: str) -> None:
    try:
        lib = ctypes.CDLL(fresh_library)
    except OSError as exc:  # libcudart not on the loader path
        pytest.skip(f"cannot load the CUDA library here: {exc}")
    c = ctypes
    lib.memo_alloc_last_error.restype = c.c_char_p
    lib.memo_malloc.restype = c.c_void_p
    lib.memo_malloc.argtypes = [c.c_ssize_t, c.c_int, c.c_void_p]
    lib.memo_alloc_device.restype = c.c_void_p
    lib.memo_alloc_device.argtypes = [c.c_int, c.c_int]
    lib.memo_alloc_load_plan.argtypes = [c.c_void_p, c.c_int, c.POINTER(c.c_char_p), c.POINTER(c.c_int64),
                                         c.POINTER(c.c_int64), c.POINTER(c.c_int64), c.POINTER(c.c_uint8),
                                         c.c_int64]
    lib.memo_alloc_unload_plan.argtypes = [c.c_void_p]
    lib.memo_alloc_set_phase.argtypes = [c.c_void_p, c.c_char_p]
    lib.memo_alloc_stats.argtypes = [c.c_void_p, c.POINTER(c.c_uint64), c.c_int]
    device = lib.memo_alloc_device(MEMO_BACKEND_CUDA, 0)  # made without touching the device

    # A bad table is refused with the native message.
    names = (c.c_char_p * 1)(b"layer.fwd[0]")
    rc = lib.memo_alloc_load_plan(device, 1, names, (c.c_int64 * 1)(1), (c.c_int64 * 1)(4096),
                                  (c.c_int64 * 1)(100), (c.c_uint8 * 1)(1), 8192)
    assert rc == -1 and b"multiple of 512" in lib.memo_alloc_last_error()
    # An all-unplanned table needs no arena, so it loads without a device.
    rc = lib.memo_alloc_load_plan(device, 1, names, (c.c_int64 * 1)(1), (c.c_int64 * 1)(4096),
                                  (c.c_int64 * 1)(0), (c.c_uint8 * 1)(0), 0)
    assert rc == 0
    lib.memo_alloc_set_phase(device, b"layer.fwd[0]")
    stats = (c.c_uint64 * 64)()
    assert lib.memo_alloc_stats(device, stats, 64) == len(_C.allocator.library().stat_names())
    lib.memo_alloc_set_phase(device, None)
    assert lib.memo_alloc_unload_plan(device) == 0


@pytest.fixture
def cuda_library(fresh_library: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """memo.allocator's CUDA backend pointed at the freshly built library (skips where it cannot load)."""
    try:
        ctypes.CDLL(fresh_library)
    except OSError as exc:  # libcudart not on the loader path
        pytest.skip(f"cannot load the CUDA library here: {exc}")
    monkeypatch.setattr(backends, "cuda_library_path", lambda: fresh_library)
    monkeypatch.setattr(backends, "_cuda_lib", None)
    return fresh_library


@pytest.mark.usefixtures("cuda_library")
def test_cuda_stats_keys_are_the_library_names() -> None:
    """The CUDA library names its counters from the core's one list, and memo.allocator's dict uses them."""
    backend = backends.CudaBackend(0)  # no device touched: no arena, no plan
    names = backend._library.stat_names()
    assert names == list(_C.allocator.library().stat_names())  # the same list, in the same order
    stats = backend.stats()
    assert _flat_keys(stats) == set(names) | {"first_deviation"}
    assert stats["requests"] == 0 and stats["fallback"]["segments"] == 0 and stats["first_deviation"] is None


@pytest.mark.usefixtures("cuda_library")
@pytest.mark.parametrize(("tables", "peak", "pattern"), CORE_TABLE_ERRORS)
def test_cuda_tables_are_checked_by_the_core(tables: dict, peak: int, pattern: str) -> None:
    """NOTE [Plan tables are checked in the core]: the CUDA C API gives the CPU path's messages."""
    cuda, cpu = backends.CudaBackend(0), backends.CpuBackend()
    with pytest.raises(MemoError, match=pattern) as on_cuda:
        cuda.check_plan(tables, peak)
    with pytest.raises(MemoError) as on_cpu:
        cpu.check_plan(tables, peak)
    assert str(on_cuda.value) == str(on_cpu.value)
    with pytest.raises(MemoError, match=pattern):
        cuda.load_plan(tables, peak)  # no device is touched: the check comes first


@pytest.mark.usefixtures("cuda_library")
def test_the_phase_reaches_every_cuda_device() -> None:
    """NOTE [One allocator C API]: a phase set on one device allocator is the process's phase, as it is for
    PyTorch's allocator; cuda:0 and cuda:1 are made without touching a device."""
    library = backends._load_cuda_library()
    first, second = library.device_allocator("cuda", 0), library.device_allocator("cuda", 1)
    second.start_logging()
    first.set_phase("layer.fwd[0]")
    first.set_phase(None)
    assert second.stop_logging() == ([], ["layer.fwd[0]"])
