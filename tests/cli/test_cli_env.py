"""`memo env` reports real facts of this machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import memo
from memo.cli.env import collect_env, format_env


def test_build_info_names_backends_and_compiler() -> None:
    from memo import _C

    info = _C.build_info()
    assert info["version"] == memo.__version__
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["compiler"].split()[0] in ("gcc", "clang")


def test_each_backend_build_info_names_serves_allocations() -> None:
    """A listed backend is one memo's allocator really runs on: a tensor made on that device inside
    ``memo.allocator.logging`` is a malloc of its size, in its phase, and a free."""
    import memo.allocator as ma
    from memo import _C

    backends = _C.build_info()["backends"]
    assert backends and set(backends) <= {"cpu", "cuda"}, backends
    usable = [b for b in backends if b == "cpu" or torch.cuda.is_available()]
    assert "cpu" in usable
    for device in usable:
        with ma.logging(device=device) as trace:
            ma.set_phase("layer.fwd[0]")
            try:
                t = torch.empty(12345, dtype=torch.uint8, device=device)
                del t
            finally:
                ma.set_phase(None)
        mine = [e for e in trace["events"] if e["op"] == "malloc" and e.get("phase") == "layer.fwd[0]"]
        assert [e["size"] for e in mine] == [12345], (device, trace["events"])
        assert {"op": "free", "id": mine[0]["id"]} in trace["events"], device


def test_collect_env_matches_this_process() -> None:
    env = collect_env(measure_bandwidth=False)
    assert env["torch"] == torch.__version__
    assert env["host_memory"]["total_bytes"] > 2**30
    assert len(env["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    text = format_env(env)
    assert torch.__version__ in text and "megatron-core" in text and "flash-attn" in text


def test_cli_json_roundtrip() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "memo", "env", "--json", "--no-bandwidth"],
        capture_output=True, text=True, check=True,
    ).stdout
    env = json.loads(out)
    assert env["python"].count(".") == 2
    from memo import _C

    assert env["memo_extension"] == _C.build_info()  # what the extension says, not a copy kept elsewhere


def test_env_on_cpu_reports_the_copy_engine_rate() -> None:
    from memo.cli.env import format_env

    env = collect_env(measure_bandwidth=True)
    if env["gpus"]:
        pytest.skip("a GPU is visible: memo env reports pinned PCIe bandwidth instead")
    assert env["cpu_copy_gbps"] > 0
    text = format_env(env)
    assert "copy engine" in text and "not a PCIe figure" in text
