"""Build script for memo.

Builds three native pieces:

* ``memo._planner_native`` -- the planner's exact DSA search (``csrc/core/dsa_*.cpp``)
  and its binding (``csrc/planner/``), a plain setuptools extension against the
  pybind11 package's headers. It links no libtorch, so ``memo.planner`` works where
  torch is not installed (NOTE [A torch-free planner module] in
  ``csrc/planner/module.cpp``). Always built, with or without torch.
* ``libmemo_core.a`` (in the build directory, not installed) -- the
  backend-neutral allocator core (plan lookup, arena, fallback allocator,
  stream ordering, trace logging, stats) and its C API
  (``core/allocator_api.h``): ``csrc/core/*.cpp`` but the planner's
  ``dsa_*.cpp``. Plain C++17, no torch or CUDA headers; compiled once, with
  the compiler the extensions use, and linked into both binaries below (NOTE
  [The core is built once]).
* ``memo._C`` -- a torch C++ extension (pybind11, ninja) holding the CPU
  backend, the rounding buffers' copy worker and the bindings (every other C++
  source under ``csrc/``), linked with the core archive. Built when torch is
  installed; without torch, setup.py says so and builds the planner alone (CI
  checks that ``memo.planner`` makes plans there).
* ``memo/_lib/libmemo_cuda.so`` -- the CUDA backend as a standalone shared
  library: ``csrc/cuda/*.cu`` compiled with plain ``nvcc`` and linked with the
  core archive. It needs no torch headers (the functions
  ``torch.cuda.memory.CUDAPluggableAllocator`` loads are plain C), so it also
  builds against a CPU-only torch when asked to (``MEMO_BUILD_CUDA=1``); CI uses
  that to check that the CUDA sources compile and link.

NOTE [The core is built once]
Both binaries reach the core through its C API (``core/allocator_api.h``, NOTE
[One allocator C API]), each with its own backend behind it: ``memo._C`` the
CPU backend, the CUDA library the CUDA backend; memo's one Python binding (in
``memo._C``) calls the same functions in either. The core is one set of
objects, archived and linked into each, never a ``.cpp`` that another file
``#include``s (tests/allocator/test_cuda_build.py checks). Each binary holds
its own copy of the archive's code, which is why visibility matters:

All are compiled with hidden symbol visibility: the core's C++ symbols stay
private to each binary (each extension exports its ``PyInit_*``, which
``PYBIND11_MODULE`` marks visible). The CUDA library exports the C API
(``MEMO_API``) and the two functions PyTorch loads (``MEMO_CUDA_API``);
``memo._C`` links the archive with ``--exclude-libs`` and so exports none of
it. The dynamic linker can thus never bind one binary's calls to the other's
copy of the core, and the export tables stay small.

Switches (one prefix, ``MEMO_``):

* ``MEMO_BUILD_CUDA=auto|0|1`` -- ``auto`` (default) builds the CUDA backend
  when this torch is a CUDA build (``torch.version.cuda`` is set) and nvcc is
  found; a CPU-only torch skips it, as it could never load it. ``1`` builds it
  whatever torch is and makes a missing nvcc an error; ``0`` skips it. At load
  time memo checks that the library's CUDA runtime has torch's major version.
* ``MEMO_CUDA_ARCHS="90;80"`` -- compute capabilities for nvcc (default 80;90); ``make gpu-bench``
  passes the device's own (90 on Hopper), which halves the CUDA build. An unchanged CUDA library is
  not rebuilt (NOTE [An unchanged CUDA library is not rebuilt]).
* ``MAX_JOBS`` -- ninja parallelism (torch's own variable); by default capped
  by memory (about 2 GiB per job) and printed.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pybind11
from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# torch is needed for memo._C only; the planner's module builds without it (see the docstring).
# find_spec, not a caught ImportError: a torch that is installed but broken must fail loudly.
HAVE_TORCH = importlib.util.find_spec("torch") is not None
if HAVE_TORCH:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"
# Keep every symbol of the core private to its binary (see the docstring).
HIDDEN = "-fvisibility=hidden"


def _log(msg: str) -> None:
    print(f"[memo setup] {msg}", file=sys.stderr)


def _find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def _nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else "unknown"


def _cap_jobs() -> None:
    if "MAX_JOBS" in os.environ:
        _log(f"MAX_JOBS={os.environ['MAX_JOBS']} (from environment)")
        return
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8.0
    jobs = max(1, min(os.cpu_count() or 1, int(mem_gib // 2)))
    os.environ["MAX_JOBS"] = str(jobs)
    _log(f"MAX_JOBS={jobs} (capped by {mem_gib:.0f} GiB memory; set MAX_JOBS to override)")


def _cuda_plan() -> tuple[str | None, str]:
    """Decide whether to build the CUDA backend; return (nvcc path or None, version)."""
    mode = os.environ.get("MEMO_BUILD_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"memo setup: MEMO_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    if not HAVE_TORCH:
        if mode == "1":
            raise SystemExit("memo setup: MEMO_BUILD_CUDA=1 but torch is not installed; install torch first")
        _log("CUDA backend: skipped (torch is not installed)")
        return None, "none"
    if mode == "0":
        _log("CUDA backend: skipped (MEMO_BUILD_CUDA=0)")
        return None, "none"
    if mode == "auto" and torch.version.cuda is None:
        # The library must share torch's CUDA runtime; a CPU-only torch has none to share.
        _log(f"CUDA backend: skipped (torch {torch.__version__} is a CPU-only build; "
             "MEMO_BUILD_CUDA=1 builds it anyway, e.g. to check that it compiles)")
        return None, "none"
    nvcc = _find_nvcc()
    if nvcc is None:
        if mode == "1":
            raise SystemExit("memo setup: MEMO_BUILD_CUDA=1 but nvcc was not found; set CUDA_HOME")
        _log("CUDA backend: skipped (nvcc not found)")
        return None, "none"
    version = _nvcc_version(nvcc)
    torch_cuda = torch.version.cuda or "none (CPU-only torch)"
    _log(f"CUDA backend: building with {nvcc} (CUDA {version}; torch's CUDA: {torch_cuda})")
    return nvcc, version


NVCC, CUDA_VERSION = _cuda_plan()

# The planner's sources: its binding and the core files it runs (the exact DSA search).
PLANNER_SOURCES = sorted(glob.glob(os.path.join("csrc", "planner", "*.cpp"))
                         + glob.glob(os.path.join("csrc", "core", "dsa_*.cpp")))
# The allocator core, archived once and linked into memo._C and the CUDA library
# (NOTE [The core is built once]).
CORE_SOURCES = sorted(p for p in glob.glob(os.path.join("csrc", "core", "*.cpp")) if p not in PLANNER_SOURCES)
# -g0: Python's own CFLAGS (sysconfig) add -g, and debug info for sources that include torch's headers
# made memo._C 14 MB and the build a third slower; `make test` builds memo in every fresh clone.
CORE_FLAGS = ["-O2", "-g0", "-std=c++17", HIDDEN]
# memo._C's own sources are pybind11 bindings, PyTorch's allocator hook and the copy worker's
# orchestration (its copies are memcpy, the allocator's work is the core's, at -O2): -O1 builds its two
# binding files in 15 s instead of 20 each, on the critical path of every fresh `make test`.
EXTENSION_FLAGS = ["-O1", "-g0", "-std=c++17", HIDDEN]


class BuildWithCuda(BuildExtension if HAVE_TORCH else build_ext):
    """torch's BuildExtension (plain build_ext without torch), plus the core archive both native
    backends link (NOTE [The core is built once]) and the standalone CUDA backend library."""

    core_archive: str | None = None

    def build_extensions(self) -> None:
        if HAVE_TORCH:
            self.core_archive = self._build_core_archive()
            for ext in self.extensions:
                if ext.name == "memo._C":
                    ext.extra_objects = [*ext.extra_objects, self.core_archive]
                    ext.depends = [*ext.depends, self.core_archive]  # relink when the core changes
        super().build_extensions()

    def run(self) -> None:
        super().run()
        if NVCC is not None:
            self._build_cuda_library()

    def _build_core_archive(self) -> str:
        # The extensions' own compiler (before BuildExtension hands it to ninja), so both binaries get
        # the same objects; -fPIC comes with it, as the archive goes into shared objects.
        # One source per job, MAX_JOBS at once: distutils compiles a list one file after another.
        out_dir = os.path.join(self.build_temp, "memo_core")
        with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("MAX_JOBS", "1"))) as pool:
            include = [os.path.join(ROOT, "csrc")]
            per_source = pool.map(lambda src: self.compiler.compile(
                [src], output_dir=out_dir, include_dirs=include, extra_postargs=CORE_FLAGS), CORE_SOURCES)
            objects = [obj for objs in per_source for obj in objs]
        self.compiler.create_static_lib(objects, "memo_core", output_dir=out_dir)
        archive = os.path.join(out_dir, self.compiler.library_filename("memo_core"))
        _log(f"core: {len(objects)} objects archived in {archive}, linked into memo._C and the CUDA library")
        return archive

    def _build_cuda_library(self) -> None:
        sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        if not sources:
            return
        archs = os.environ.get("MEMO_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
        gencode = []
        for arch in filter(None, (a.strip() for a in archs)):
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        # The library must share the CUDA runtime of the torch process that loads it
        # (streams and events are per runtime), hence -cudart shared. --threads 0: one nvcc thread per
        # architecture; -g0 for the host code, as CORE_FLAGS.
        flags = [NVCC, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-Xcompiler", HIDDEN,
                 "-Xcompiler", "-g0", "--threads", "0", "-cudart", "shared",
                 f"-I{os.path.join(ROOT, 'csrc')}", *gencode, *sources, self.core_archive]
        out_dirs = [os.path.join(ROOT, "memo", "_lib")]
        if not self.inplace:
            out_dirs.append(os.path.join(self.build_lib, "memo", "_lib"))
        stamp = _cuda_stamp(flags, [*sources, *glob.glob(os.path.join(ROOT, "csrc", "core", "*.h"))])
        for out_dir in out_dirs:
            os.makedirs(out_dir, exist_ok=True)
            target = os.path.join(out_dir, "libmemo_cuda.so")
            # NOTE [An unchanged CUDA library is not rebuilt]
            if os.path.exists(target) and _read(target + ".stamp") == stamp:
                _log(f"nvcc: {target} is up to date (same sources, core and flags); not rebuilt")
                continue
            cmd = [*flags, "-o", target]
            _log("nvcc: " + " ".join(cmd))
            subprocess.run(cmd, check=True)
            with open(target + ".stamp", "w") as f:
                f.write(stamp)


# NOTE [An unchanged CUDA library is not rebuilt]
# A GPU session's build time comes out of its device time (`make gpu-bench`), and nvcc compiles the
# CUDA backend for every architecture again on each install. The library is rebuilt only when the
# sha256 of its nvcc command, its sources, the core headers and the core archive's bytes (the archive
# is compiled again on every build, so its time stamp says nothing) differs from the one written
# beside it (``libmemo_cuda.so.stamp``) when it was last built.
def _cuda_stamp(flags: list[str], files: list[str]) -> str:
    digest = hashlib.sha256("\0".join(flags).encode())
    for path in sorted(files) + [flags[-1]]:  # the core archive is the last of the flags
        with open(path, "rb") as f:
            digest.update(path.encode() + b"\0" + f.read())
    return digest.hexdigest()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _planner_extension() -> Extension:
    # No torch headers and no libtorch: NOTE [A torch-free planner module] in csrc/planner/module.cpp.
    return Extension(
        name="memo._planner_native",
        sources=PLANNER_SOURCES,
        include_dirs=[os.path.join(ROOT, "csrc"), pybind11.get_include()],
        language="c++",
        extra_compile_args=CORE_FLAGS,
    )


def _torch_extension() -> CppExtension:
    # Every other C++ source under csrc/: not the CUDA backend, which is its own library, nor the
    # planner's, which are their own module, nor the core's, which come as the archive
    # (BuildWithCuda.build_extensions).
    sources = sorted(
        p for p in glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)
        if not p.startswith(os.path.join("csrc", "cuda"))
        and p not in PLANNER_SOURCES and p not in CORE_SOURCES
    )
    defines = [("MEMO_VERSION", f'"{VERSION}"'), ("MEMO_CUDA_VERSION", f'"{CUDA_VERSION}"')]
    if NVCC is not None:
        defines.append(("MEMO_WITH_CUDA_BACKEND", "1"))
    return CppExtension(
        name="memo._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=defines,
        extra_compile_args=EXTENSION_FLAGS,
        # The core archive's C API stays private to memo._C (NOTE [The core is built once]).
        extra_link_args=["-Wl,--exclude-libs,ALL"],
    )


_cap_jobs()
if HAVE_TORCH:
    EXTENSIONS = [_planner_extension(), _torch_extension()]
else:
    _log("memo._C: skipped (torch is not installed); building memo._planner_native alone, so "
         "memo.planner works but the runtime, allocator and profiler do not: install torch and "
         "build again for those")
    EXTENSIONS = [_planner_extension()]

packages = find_packages(include=["memo", "memo.*"])
packages += ["memo.planner"] + [
    "memo.planner." + p for p in find_packages(where="planner")
]

setup(
    name="memo",
    version=VERSION,
    description="Train transformers on million-token sequences: token-wise offload/recompute "
    "and a planned, fragmentation-free activation allocator.",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"memo": "memo", "memo.planner": "planner"},
    package_data={"memo": ["_lib/*.so"]},
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": BuildWithCuda.with_options(use_ninja=True) if HAVE_TORCH else BuildWithCuda},
    install_requires=[
        "torch>=2.11,<2.14",  # tested: 2.13 (CPU, CI) and 2.11 + CUDA 13 (make gpu-check)
        "numpy>=1.24",
        # 3.x bundles the CBC binary on Python 3.11; on 3.12+ pulp 4.x needs
        # `pulp[cbc]` or highspy (see README, "Solvers").
        "pulp>=2.8",
        "tqdm>=4.60",  # progress bars on profiling, planning and training
        "matplotlib>=3.6",  # `memo plot` and loss curves
    ],
    extras_require={
        "megatron": ["megatron-core>=0.16"],
        # Hugging Face causal LMs (memo.adapters.hf); tested with this version, written for 4.46+.
        "hf": ["transformers==5.23.0"],
        "highs": ["highspy>=1.7"],
        "test": ["pytest>=7", "pytest-xdist>=3", "hypothesis>=6", "ruff>=0.5", "mypy>=1.10"],
    },
    entry_points={"console_scripts": ["memo=memo.cli.main:main"]},
    zip_safe=False,
)
