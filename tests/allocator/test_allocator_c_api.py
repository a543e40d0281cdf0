"""The allocator's one C API and its one binding (NOTE [One allocator C API] in csrc/core/allocator_api.h).

The CUDA library's side needs nvcc: tests/allocator/test_cuda_build.py."""

from __future__ import annotations

import os
import re

import pytest
import torch

import memo.allocator as ma
from memo import _C

A = _C.allocator
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_binding_looks_up_every_function_of_the_header() -> None:
    """The list the binding fills its table from (MEMO_ALLOC_API_FUNCTIONS) is the header's functions."""
    with open(os.path.join(ROOT, "csrc", "core", "allocator_api.h"), encoding="utf-8") as f:
        header = f.read()
    declared = re.findall(r"^MEMO_API [^(]*?\b(memo_alloc_\w+)\(", header, re.MULTILINE)
    listed = re.findall(r"X\((memo_alloc_\w+)\)", header[header.index("#define MEMO_ALLOC_API_FUNCTIONS"):])
    assert len(declared) == len(set(declared)) and sorted(listed) == sorted(declared)


def test_this_module_holds_the_cpu_backend_only() -> None:
    lib = A.library()
    assert lib.path == "" and lib.runtime_version("cpu") == 0 and lib.runtime_version("cuda") == -1
    with pytest.raises(A.AllocatorError, match="this library has no cuda backend"):
        lib.device_allocator("cuda", 0)
    with pytest.raises(A.AllocatorError, match="no backend for device type 'xpu'"):
        lib.device_allocator("xpu", 0)


def test_the_cpu_device_allocator_is_the_one_behind_torch() -> None:
    device = A.library().device_allocator("cpu", 0)
    with ma.logging():
        t = torch.empty(1 << 16, dtype=torch.uint8)
        assert device.owns(t.data_ptr())
    assert device.owns(t.data_ptr())  # freed through memo's deleter, also after the context
    ptr = t.data_ptr()
    del t
    assert not device.owns(ptr)


def test_a_missing_library_is_an_os_error(tmp_path) -> None:
    with pytest.raises(OSError, match="cannot open shared object file"):
        A.load_library(str(tmp_path / "libmissing.so"))


def test_a_library_without_the_c_api_is_refused() -> None:
    with pytest.raises(A.AllocatorError, match=r"lacks memo_alloc_last_error: it is from another memo build"):
        A.load_library(_C.__file__)  # a real shared object, whose C API is not exported
