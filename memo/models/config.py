"""Model configurations for the reference GPT and Llama models, and their registry."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from memo.errors import MemoError
from memo.jsonio import read_json

__all__ = ["ModelConfig", "fingerprint", "get_config", "hf_shapes", "list_configs", "load_config",
           "register_config"]

_ARCHS = ("gpt", "llama")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a reference transformer. Frozen: configs are shared through the registry.

    GPT (Megatron's reference GPT): pre-LayerNorm, learned absolute positions, fused QKV
    with bias, GELU MLP, word embedding tied to the LM head. Llama: RMSNorm, rotary
    positions, grouped-query attention, SwiGLU MLP, no biases, untied LM head; with
    ``qk_norm`` also an RMSNorm of every query and key head (Qwen3).
    """

    name: str
    """Registry name, e.g. ``"gpt-7b"``; not part of :func:`fingerprint`."""
    arch: str
    """``"gpt"`` or ``"llama"``."""
    n_layers: int
    """Number of transformer layers."""
    hidden: int
    """Hidden size h."""
    n_heads: int
    """Query heads; unless ``head_dim`` is given, ``hidden`` must divide evenly into them."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention). ``None`` means ``n_heads``; GPT requires ``n_heads``."""
    ffn_hidden: int | None = None
    """MLP inner size. ``None`` means 4h for GPT, and for Llama the SwiGLU rule
    ``2/3 · 4h`` rounded up to a multiple of 256."""
    vocab_size: int = 50257
    """Vocabulary size (GPT-2's 50257 for the paper's GPT models)."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm (GPT) / RMSNorm (Llama)."""
    rope_theta: float | None = None
    """Rotary base for Llama (``None`` means 10000); must stay ``None`` for GPT, which has no rotary."""
    head_dim: int | None = None
    """Per-head size d of queries, keys and values. ``None`` means ``hidden // n_heads`` (and then
    ``hidden`` must divide by ``n_heads``); given, ``n_heads · head_dim`` may differ from ``hidden``
    (Qwen3-32B: hidden 5120, 64 heads of 128), and the QKV projection has ``(n_heads + 2 n_kv_heads)
    · head_dim`` outputs, the output projection ``n_heads · head_dim`` inputs."""
    qk_norm: bool = False
    """Llama only: an RMSNorm over ``head_dim`` (weights ``q_norm.weight``, ``k_norm.weight``, shared
    by the heads) applied to every query and key head before rotary, as Qwen3 and Gemma do."""

    def __post_init__(self) -> None:
        where = f"memo.models: config {self.name!r}"
        if self.arch not in _ARCHS:
            raise MemoError(f"{where}: arch must be one of {_ARCHS}, got {self.arch!r}")
        for field in ("n_layers", "hidden", "n_heads", "vocab_size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MemoError(f"{where}: {field} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden % self.n_heads != 0:
                raise MemoError(
                    f"{where}: hidden={self.hidden} is not divisible by n_heads={self.n_heads}; "
                    "the head dimension is hidden / n_heads unless head_dim is given"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise MemoError(f"{where}: head_dim must be a positive int (or unset for hidden / n_heads), "
                            f"got {self.head_dim!r}")
        if not isinstance(self.qk_norm, bool):
            raise MemoError(f"{where}: qk_norm must be true or false, got {self.qk_norm!r}")
        if self.qk_norm and self.arch != "llama":
            raise MemoError(f"{where}: qk_norm is a Llama-family option (Qwen3's norm of each query and key "
                            f"head); arch {self.arch!r} has none, use arch='llama' or leave qk_norm unset")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if isinstance(self.n_kv_heads, bool) or not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1:
            raise MemoError(f"{where}: n_kv_heads must be a positive int, got {self.n_kv_heads!r}")
        if self.arch == "gpt" and self.n_kv_heads != self.n_heads:
            raise MemoError(
                f"{where}: GPT uses multi-head attention, so n_kv_heads must equal n_heads={self.n_heads} "
                f"(got {self.n_kv_heads}); use arch='llama' for grouped-query attention"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise MemoError(
                f"{where}: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(each key/value head serves a whole group of query heads)"
            )
        if self.ffn_hidden is None:
            if self.arch == "gpt":
                ffn = 4 * self.hidden
            else:
                ffn = -(-(2 * 4 * self.hidden // 3) // 256) * 256
            object.__setattr__(self, "ffn_hidden", ffn)
        if isinstance(self.ffn_hidden, bool) or not isinstance(self.ffn_hidden, int) or self.ffn_hidden < 1:
            raise MemoError(f"{where}: ffn_hidden must be a positive int, got {self.ffn_hidden!r}")
        for field in ("norm_eps", "rope_theta"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise MemoError(f"{where}: {field} must be a number, got {value!r}")
        if not self.norm_eps > 0:
            raise MemoError(f"{where}: norm_eps must be > 0, got {self.norm_eps!r}")
        if self.arch == "gpt" and self.rope_theta is not None:
            raise MemoError(
                f"{where}: rope_theta={self.rope_theta} given for a GPT config; GPT uses learned "
                "absolute positions, leave rope_theta unset (or use arch='llama')"
            )
        if self.arch == "llama":
            if self.rope_theta is None:
                object.__setattr__(self, "rope_theta", 10000.0)
            if not self.rope_theta > 0:
                raise MemoError(f"{where}: rope_theta must be > 0, got {self.rope_theta!r}")
            if self.head_dim % 2 != 0:
                raise MemoError(f"{where}: rotary needs an even head_dim, got {self.head_dim}")

    @property
    def tied_embeddings(self) -> bool:
        """GPT ties the LM head to the word embedding (Megatron's default); Llama does not."""
        return self.arch == "gpt"


def _fingerprint_fields(config: ModelConfig) -> dict[str, object]:
    """The fields :func:`fingerprint` hashes (NOTE [Fingerprint of later fields])."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "name"}
    if config.hidden % config.n_heads == 0 and config.head_dim == config.hidden // config.n_heads:
        del fields["head_dim"]
    if not config.qk_norm:
        del fields["qk_norm"]
    return fields


# NOTE [Fingerprint of later fields]
# Saved plans and traces compare fingerprints, so a ModelConfig field whose default adds nothing to
# the architecture is hashed only when it is set to something else: head_dim when it is not
# hidden / n_heads, qk_norm when it is on. A config that does not use them, written with them or
# without, hashes as a config without those fields, so plans saved for it by a memo that lacks
# them still load.


def fingerprint(config: ModelConfig) -> str:
    """Stable 16-hex-digit hash of the architecture (every field but ``name``; ``head_dim`` and
    ``qk_norm`` only where they differ from their defaults, NOTE [Fingerprint of later fields]).

    Plans and traces store it so that loading one made for another model is detected. It is
    the sha256 of the fields as sorted JSON, so it does not change between Python runs.
    """
    fields = _fingerprint_fields(config)
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_REGISTRY: dict[str, ModelConfig] = {}


def register_config(config: ModelConfig) -> ModelConfig:
    """Add ``config`` to the registry under ``config.name`` (an existing name is an error)."""
    if config.name in _REGISTRY:
        raise MemoError(f"memo.models: a config named {config.name!r} is already registered")
    _REGISTRY[config.name] = config
    return config


def get_config(name: str) -> ModelConfig:
    """The registered config called ``name``, or the config in the JSON file ``name`` (a path ending
    in ``.json``, see :func:`load_config`); unknown names raise an error listing the valid ones."""
    if name.endswith(".json") or os.sep in name:
        return load_config(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise MemoError(
            f"memo.models: unknown model {name!r}; valid names: {', '.join(list_configs())}, "
            "or a path to a CONFIG.json with ModelConfig's fields"
        ) from None


_REQUIRED = ("arch", "n_layers", "hidden", "n_heads")


def load_config(path: str | os.PathLike[str]) -> ModelConfig:
    """A :class:`ModelConfig` from a JSON file holding its fields, for shapes of one's own::

        {"arch": "llama", "n_layers": 32, "hidden": 1024, "n_heads": 16, "n_kv_heads": 4,
         "ffn_hidden": 2816, "vocab_size": 32000}

    ``arch``, ``n_layers``, ``hidden`` and ``n_heads`` are required; the others (``head_dim`` and
    ``qk_norm`` among them, as in Qwen3: ``"head_dim": 128, "qk_norm": true``) default as in
    :class:`ModelConfig`; ``name`` defaults to the file name without ``.json``. Missing, unknown,
    mistyped or inconsistent fields are refused with an error that names them.
    """
    data = read_json(path, "memo.models", "write one with the fields of memo.models.ModelConfig")
    where = f"memo.models: {os.fspath(path)!r}"
    if not isinstance(data, dict):
        raise MemoError(f"{where} must hold a JSON object of ModelConfig fields, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise MemoError(f"{where}: unknown field(s) {', '.join(unknown)}; "
                        f"ModelConfig has {', '.join(sorted(known))}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise MemoError(f"{where}: missing field(s) {', '.join(missing)} (required: {', '.join(_REQUIRED)})")
    fields = dict(data)
    fields.setdefault("name", os.path.splitext(os.path.basename(os.fspath(path)))[0])
    if not isinstance(fields["name"], str) or not fields["name"]:
        raise MemoError(f"{where}: name must be a non-empty string, got {fields['name']!r}")
    try:
        return ModelConfig(**fields)
    except MemoError as err:
        raise MemoError(f"{err} (in {os.fspath(path)})") from None


def hf_shapes(hf: Any) -> ModelConfig:
    """memo's :class:`ModelConfig` (``arch="llama"``) with a Hugging Face decoder's shapes, from its
    transformers config (read by attribute: the sizes, ``head_dim`` where it is not hidden / heads,
    Qwen3's q/k norms, the RMSNorm epsilon)."""
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None)
    return ModelConfig(name=f"hf-{hf.model_type}", arch="llama", n_layers=hf.num_hidden_layers,
                       hidden=hf.hidden_size, n_heads=heads,
                       head_dim=None if head_dim is None or head_dim * heads == hf.hidden_size
                       else int(head_dim),
                       qk_norm=hf.model_type == "qwen3",
                       n_kv_heads=getattr(hf, "num_key_value_heads", None),
                       ffn_hidden=getattr(hf, "intermediate_size", None), vocab_size=hf.vocab_size,
                       norm_eps=float(getattr(hf, "rms_norm_eps", 1e-5)))


def list_configs() -> list[str]:
    """Registered config names, in registration order."""
    return list(_REGISTRY)


# The paper's GPT models (Zhao et al. 2024, Table 2) and the usual GPT-3 family sizes.
for _name, _layers, _hidden, _heads in (
    ("gpt-125m", 12, 768, 12),
    ("gpt-350m", 24, 1024, 16),
    ("gpt-1.3b", 24, 2048, 16),
    ("gpt-2.7b", 32, 2560, 32),
    ("gpt-7b", 32, 4096, 32),
    ("gpt-13b", 40, 5120, 40),
    ("gpt-30b", 48, 7168, 56),
    ("gpt-65b", 80, 8192, 64),
):
    register_config(ModelConfig(name=_name, arch="gpt", n_layers=_layers, hidden=_hidden, n_heads=_heads))

# Test-sized models. Their vocabulary is 512 rather than 50257 so that the LM head does not
# dominate CPU test time; 512 >= 256 still lets examples train on raw bytes.
register_config(ModelConfig(name="tiny", arch="gpt", n_layers=4, hidden=64, n_heads=4, vocab_size=512))
# The demo's model: gpt-125m's depth (12 layers, so ten of them offload; the last two never do)
# at a width that trains a 4K-token sequence on two CPU cores in about a second per step.
register_config(ModelConfig(name="gpt-mini", arch="gpt", n_layers=12, hidden=128, n_heads=4, vocab_size=512))
register_config(ModelConfig(name="llama-tiny", arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2,
                            ffn_hidden=176, vocab_size=512, norm_eps=1e-5, rope_theta=10000.0))
register_config(ModelConfig(name="llama-3-8b", arch="llama", n_layers=32, hidden=4096, n_heads=32,
                            n_kv_heads=8, ffn_hidden=14336, vocab_size=128256, norm_eps=1e-5,
                            rope_theta=500000.0))
# Llama 3.1 has Llama 3's shapes; its long-context RoPE scaling ("llama3" rope_type) changes the
# rotary frequencies, not the memory: memo's reference Llama uses plain RoPE with this base.
for _name, _layers, _hidden, _heads, _ffn in (("llama-3.1-8b", 32, 4096, 32, 14336),
                                              ("llama-3.1-70b", 80, 8192, 64, 28672)):
    register_config(ModelConfig(name=_name, arch="llama", n_layers=_layers, hidden=_hidden, n_heads=_heads,
                                n_kv_heads=8, ffn_hidden=_ffn, vocab_size=128256, norm_eps=1e-5,
                                rope_theta=500000.0))
# Llama 3.2 1B (meta-llama/Llama-3.2-1B, config.json: 16 layers, hidden_size 2048, 32 attention heads,
# 8 key/value heads, intermediate_size 8192, vocab_size 128256, rms_norm_eps 1e-5, rope_theta 500000):
# the 1B-class shape of benchmarks/gpu_bench.py. Llama 3.2 ties its LM head to the embedding
# (tie_word_embeddings: 1.24B parameters); memo's Llama has an untied head, so this model has 1.50B.
register_config(ModelConfig(name="llama-3.2-1b", arch="llama", n_layers=16, hidden=2048, n_heads=32,
                            n_kv_heads=8, ffn_hidden=8192, vocab_size=128256, norm_eps=1e-5,
                            rope_theta=500000.0))
# Qwen3-32B (Qwen/Qwen3-32B, config.json: 64 layers, hidden_size 5120, 64 attention heads of head_dim
# 128, so 8192 query channels from a 5120-wide stream, 8 key/value heads, intermediate_size 25600,
# vocab_size 151936, rms_norm_eps 1e-6, rope_theta 1e6, an RMSNorm on every query and key head, untied
# LM head): 32.8B parameters, 31.2B without the embedding and LM head.
register_config(ModelConfig(name="qwen3-32b", arch="llama", n_layers=64, hidden=5120, n_heads=64,
                            n_kv_heads=8, ffn_hidden=25600, vocab_size=151936, norm_eps=1e-6,
                            rope_theta=1e6, head_dim=128, qk_norm=True))
