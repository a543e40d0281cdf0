"""--model CONFIG.json: model shapes of one's own, validated with errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch

from memo.cli.main import main
from memo.errors import MemoError
from memo.models import build_model, fingerprint, get_config, load_config


def _write(tmp_path, data, name="deep-narrow.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.slow
def test_a_json_config_builds_profiles_and_trains(tmp_path) -> None:
    path = _write(tmp_path, {"arch": "llama", "n_layers": 6, "hidden": 64, "n_heads": 4, "n_kv_heads": 1,
                             "vocab_size": 300})
    config = get_config(path)
    assert config.name == "deep-narrow" and config.n_kv_heads == 1 and config.ffn_hidden == 256  # SwiGLU rule
    assert config == load_config(path) and fingerprint(config) == fingerprint(load_config(path))
    model = build_model(path, dtype=torch.float32)
    assert len(model.layers) == 6
    plan = tmp_path / "plan.json"
    assert main(["profile", "--model", path, "--seq-len", "256", "--device", "meta", "--bandwidth-gbps", "10",
                 "--layer-ms", "1", "--host-mem-gb", "8", "-o", str(plan), "--quiet"]) == 0
    assert json.loads(plan.read_text())["meta"]["model"] == "deep-narrow"
    assert main(["train", "--model", path, "--seq-len", "64", "--steps", "1", "--no-progress",
                 "--plan", str(plan)]) == 2  # a plan for 256 tokens is refused for 64
    assert main(["train", "--model", path, "--seq-len", "64", "--steps", "1", "--no-progress"]) == 0


@pytest.mark.parametrize(("data", "needle"), [
    ({"n_layers": 4, "hidden": 64, "n_heads": 4}, "missing field(s) arch"),
    ({"arch": "gpt", "hidden": 64}, "missing field(s) n_layers, n_heads"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "heads": 4}, "unknown field(s) heads"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 5}, "not divisible by n_heads=5"),
    ({"arch": "llama", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"arch": "gpt", "n_layers": 4, "hidden": 64, "n_heads": 4, "n_kv_heads": 2}, "n_kv_heads must equal"),
    ({"arch": "gpt", "n_layers": True, "hidden": 64, "n_heads": 4}, "n_layers must be a positive int"),
    ({"arch": "gpt", "n_layers": "4", "hidden": 64, "n_heads": 4}, "n_layers must be a positive int"),
    ({"arch": "mamba", "n_layers": 4, "hidden": 64, "n_heads": 4}, "arch must be one of"),
    ({"arch": "llama", "n_layers": 4, "hidden": 64, "n_heads": 4, "rope_theta": "big"}, "rope_theta must be"),
    ([1, 2], "JSON object"),
    ("{not json", "not valid JSON"),
])
def test_bad_config_files_name_what_is_wrong(tmp_path, data, needle) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(MemoError, match="memo.models") as err:
        get_config(path)
    assert needle in str(err.value), err.value


def test_missing_config_file_and_unknown_name(tmp_path) -> None:
    with pytest.raises(MemoError, match="does not exist"):
        get_config(str(tmp_path / "nope.json"))
    with pytest.raises(MemoError, match="CONFIG.json"):
        get_config("gpt-9000")


def test_llama_31_shapes_are_registered() -> None:
    small, big = get_config("llama-3.1-8b"), get_config("llama-3.1-70b")
    assert (small.n_layers, small.hidden, small.n_kv_heads, small.ffn_hidden) == (32, 4096, 8, 14336)
    assert (big.n_layers, big.hidden, big.n_heads, big.n_kv_heads, big.ffn_hidden) == (80, 8192, 64, 8, 28672)
    assert small.vocab_size == big.vocab_size == 128256 and small.rope_theta == 500000.0
