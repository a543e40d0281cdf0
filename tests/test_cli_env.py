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
    assert "cpu" in info["backends"]
    assert info["version"] == memo.__version__
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert info["compiler"].split()[0] in ("gcc", "clang")


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
    assert "cpu" in env["memo_extension"]["backends"]


def test_env_on_cpu_reports_the_copy_engine_rate() -> None:
    from memo.cli.env import format_env

    env = collect_env(measure_bandwidth=True)
    if env["gpus"]:
        pytest.skip("a GPU is visible: memo env reports pinned PCIe bandwidth instead")
    assert env["cpu_copy_gbps"] > 0
    text = format_env(env)
    assert "copy engine" in text and "not a PCIe figure" in text
